"""The handshakes on one CHECKPOINT_DIR and the incarnations they start: reads
``replicator.yaml`` until it is settled (``core.settle``), accepts or refuses it, resumes the
incarnation a restart interrupted, hosts rank 0's coordinator, ends the running job and
empties the store when its node changes hands (``core.handoff``), and drains it on SIGTERM
and before a job switch or a job end.
Does I/O through the pieces it is given; the daemon calls it from its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.registry import BlockedName, OwnedByAnother, Registry
from mtc_replicator.core.contract import (
    CONFIG_FILE,
    FAILED_FILE,
    ConfigError,
    IncompleteConfigError,
    JobConfig,
    parse_config,
)
from mtc_replicator.core.drain import Drained
from mtc_replicator.core.handoff import StoreHandoff, decide_handoff
from mtc_replicator.core.layout import off_node_copies, replication_targets
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.repeats import CLIENT_DEADLINE, Repeat, Serving, differences, judge_repeat
from mtc_replicator.core.settle import Act, Reading, SettleRules, judge
from mtc_replicator.local import fsutil
from mtc_replicator.local.holders_file import HoldersFile
from mtc_replicator.local.store_owner import read_store_owner, write_store_owner
from mtc_replicator.node.agent import AgentContext, Incarnation
from mtc_replicator.node.bucket_probes import BucketProbes
from mtc_replicator.node.checkpoint_dir import cleanup_workload_files
from mtc_replicator.node.handshake_file import HandshakeFile
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.owner_watch import OwnerWatch
from mtc_replicator.node.rank0_coordinator import Rank0Coordinator, Stopping
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.node.saved_incarnation import (
    IncarnationPhase,
    forget_every_state,
    load_state,
    new_incarnation_id,
    save_state,
)
from mtc_replicator.obs.metrics import ErrorKind

log = logging.getLogger(__name__)

HANDED = "the node changed hands while the daemon was down, and its store was emptied"
SURVEY_WAIT = 5.0
"""Seconds a job's end waits for the bucket's word on the ended job (for ``mtc status``)."""


class Neighbours(Protocol):
    """What a supervisor must know of the job directories beside its own
    (``node.tenancy``): the node's rules for a handshake, and what the others run."""

    def refusal(self, config: JobConfig) -> tuple[str, str] | None:
        """Why ``config`` may not run in this directory, and the remedy; None: it may."""

    def views(self) -> Collection[str]:
        """The incarnations the others run: their views stay when this one starts."""

    def jobs(self) -> Collection[str]:
        """The jobs the others run: their coordinators and records stay."""

    async def end(self) -> None:
        """A node handoff: end the others' incarnations too, before the store is purged."""


class Alone:
    """No job directory beside this one, and no rule of the node's for a handshake."""

    def refusal(self, config: JobConfig) -> tuple[str, str] | None:
        return None

    def views(self) -> Collection[str]:
        return ()

    def jobs(self) -> Collection[str]:
        return ()

    async def end(self) -> None:
        return None


class Supervisor:
    """One incarnation at a time on one job directory (CHECKPOINT_DIR's root, or a
    ``jobs/<job>/`` below it), from the handshakes written there."""

    def __init__(
        self,
        opts: DaemonOptions,
        ctx: AgentContext,
        *,
        foreign: ForeignItems,
        buckets: BucketProbes,
        host: CoordinatorHost,
        registry: Registry | None,
        advertise: Callable[[], str | None],
        stop: asyncio.Event,
        neighbours: Neighbours | None = None,
    ) -> None:
        self.opts = opts
        self.neighbours: Neighbours = neighbours or Alone()
        self.ctx = ctx
        self.store = ctx.store
        self.executor = ctx.executor
        self.metrics = ctx.metrics
        self.foreign = foreign
        self.buckets = buckets
        self.incarnation: Incarnation | None = None
        self.handshake = HandshakeFile(opts.checkpoint_dir)
        # A job directory's handshake comes from our clients, renamed into place; one found
        # by the rescan of a directory just created (its rename came before the watch) is
        # taken at its first read once closed, not after a second read 0.1 s later.
        settle = 0.0 if ctx.job_dir is not None else SettleRules.valid_settle
        self.settle_rules = SettleRules(opts.settle_seconds, opts.config_wait_seconds, settle)
        self._recheck_in = self.settle_rules.poll
        self.owner = OwnerWatch(opts.owner_file, self.executor)
        self.rank0 = Rank0Coordinator(
            host,
            registry,
            advertise=advertise,
            stop=stop,
            on_refused=self._registration_refused,
            forget_holders=HoldersFile(self.store.root).keep_only,
            others=self.neighbours.jobs,
        )

    def next_check_in(self) -> float:
        """How long the daemon's loop may wait for a file event before checking again: a
        pending handshake is re-read soon (``core.settle``)."""
        return self._recheck_in if self.handshake.reads is not None else 1.0

    async def drain(self, why: str = "SIGTERM", *, shutting_down: bool = True) -> Drained | None:
        """The running job's newest step to its peers and the backup, within
        ``--drain-seconds``: on SIGTERM, and before a job switch or a job end
        (``shutting_down`` False, ``why`` says which). Past the deadline, paced transfers
        still going are halted at once on SIGTERM; otherwise the incarnation's ``stop``
        cancels them. None: no drain ran, or it did not end."""
        running = self.incarnation
        if running is None or self.opts.drain_seconds <= 0:
            return None
        job = running.config.job_name
        if not shutting_down:
            log.info(
                "draining job %s before it stops here (%s): at most %gs (--drain-seconds)",
                job,
                why,
                self.opts.drain_seconds,
                extra={"job": job},
            )
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.opts.drain_seconds):
                drained = await running.drain()
        except TimeoutError:
            log.warning(
                "drain of job %s stopped at its deadline (--drain-seconds %g): the newest step "
                "may not have reached the peers or the backup",
                job,
                self.opts.drain_seconds,
                extra={"job": job},
            )
            if shutting_down:
                self.ctx.pacer.halt()
            return None
        except Exception as exc:
            log.exception("drain of job %s failed: %s", job, exc, extra={"job": job})  # noqa: TRY401
            return None
        if drained is not None:
            log.info(
                "drain of job %s done in %.2fs (step %s)",
                job,
                time.monotonic() - t0,
                drained.plan.step,
                extra={"job": job},
            )
        return drained

    async def check_config(self) -> None:
        """Read the handshake and act on it once it is settled (``core.settle``)."""
        # Taken before the read: a close seen now covers the text we read, while one that
        # arrives during the read may follow a write our read missed.
        closed, renamed = self.handshake.finished, self.handshake.renamed
        try:
            text = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.handshake.read
            )
        except fsutil.NotRegularFile as exc:
            await self._reject_not_regular(exc.kind)
            return
        now = time.monotonic()
        reads = self.handshake.observe(text, now)
        if text is None or reads is None:
            return
        # Read after the handshake: the CSI plugin rewrote owner.json before the pod that
        # wrote it started, so a handoff is seen, and done, before it is judged. A bad owner
        # file: an accepted handshake is refused for it in _accept.
        with contextlib.suppress(BadOwner):
            await self.owner_now()
        config: JobConfig | None = None
        error: ConfigError | None = None
        if not text.strip():
            reading = Reading.EMPTY
        else:
            try:
                config, reading = parse_config(text, self.ctx.env), Reading.VALID
            except IncompleteConfigError as exc:
                error, reading = exc, Reading.INCOMPLETE
            except ConfigError as exc:
                error, reading = exc, Reading.INVALID
        verdict = judge(self.settle_rules, reads, reading, now, closed=closed, renamed=renamed)
        self._recheck_in = verdict.recheck_in or self.settle_rules.poll
        if verdict.act is Act.CLEAR:
            log.info("empty %s stayed empty: stopping the current job", CONFIG_FILE)
            # The job ended (``client.finish_job``): its newest step drains first, and the
            # yaml goes last, the client's cue that the drain is over.
            await self.end_incarnation(drain=f"an empty {CONFIG_FILE}")
            self.handshake.delete(text)
        elif verdict.act is Act.REJECT:
            assert error is not None
            waited = f"after {verdict.waited:.0f}s of waiting for a complete file"
            await self._reject(text, error, waited if verdict.timed_out else "")
        elif verdict.act is Act.ACCEPT:
            assert config is not None
            if not await self._repeated(config, text):
                await self._accept(config, text, reads.first_seen)

    async def _repeated(self, config: JobConfig, text: str) -> bool:
        """A handshake for the job and rank this node serves (``core.repeats``): the same
        one again is consumed and served once more, a conflicting one refused in
        ``replicator.errors`` (never ``replicator.failed``, which would stop the process of
        the accepted one too); True when it was one of those."""
        running = self.incarnation
        serving = None
        if running is not None:
            serving = Serving(
                running.config,
                alive=running.repeats.alive,
                # Its markers out (published, though the round's last steps may still
                # run): a same handshake now is the workload's restart.
                restoring=running.phase is IncarnationPhase.RESTORING
                and running.repeats.outcome is None,
                accepted_for=time.monotonic() - running.repeats.since,
            )
        verdict = judge_repeat(serving, config)
        if verdict is Repeat.NEW:
            return False
        assert running is not None
        self.handshake.delete(text)
        if verdict is Repeat.SAME:
            running.repeats.serve_again()
            running.wake()
            return True
        running.error(
            f"refused a second {CONFIG_FILE} for job {config.job_name} rank "
            f"{config.node_rank} while incarnation {running.id} restores from the first: "
            f"{'; '.join(differences(running.config, config))}. Every process of a node "
            "must hand over the same config, and only one (the node's local rank 0) needs "
            "to; the restore goes on with the first. To restart the job with the new "
            f"config, stop it and start it again once this restore is done (or after "
            f"{CLIENT_DEADLINE:.0f} s)",
            None,
            ErrorKind.CONFIG,
        )
        return True

    async def _reject(self, text: str, exc: ConfigError, when: str) -> None:
        await self._refuse(
            text,
            f"{exc}{' (' + when + ')' if when else ''}",
            f"Fix {CONFIG_FILE} and write it again (atomically: {CONFIG_FILE}.tmp, then rename)",
        )

    async def _refuse(self, text: str | None, reason: str, remedy: str) -> None:
        """Refuse the handshake ``text`` (None: one that could not be read): ``replicator.failed``
        says why, nothing committed is touched."""
        log.error("rejecting %s: %s", CONFIG_FILE, reason)
        self.metrics.error(ErrorKind.CONFIG)
        await self.end_incarnation()
        message = f"{reason}.\n{remedy}; committed checkpoints on this node were not touched.\n"
        fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, message.encode())
        if text is not None:
            self.handshake.delete(text)

    async def check_owner(self) -> None:
        """Once a second, whether or not a job runs: a node that changed hands ends its job
        and empties its store (``owner_now``); an owner file gone bad ends the job.

        The CSI plugin publishes CHECKPOINT_DIR to another namespace's pod only when no pod
        of the last one holds it, and rewrites ``owner.json`` then; from that moment nothing
        of the old owner's (a marker, a view, an item in the store) may be reached there.
        """
        if not self.owner.due():
            return
        owner: str | None = None
        try:
            owner = await self.owner_now()
        except BadOwner as exc:
            why = str(exc)
        running = self.incarnation
        if running is None or running.owner == owner:
            return
        log.warning(
            "stopping job %s (incarnation %s) and removing its markers and views: %s",
            running.config.job_name,
            running.id,
            "CHECKPOINT_DIR was published to another namespace's pod" if owner else why,
            extra={"job": running.config.job_name},
        )
        await self._end_and_clean()

    async def owner_now(self) -> str:
        """The namespace whose pod holds the node now, once the store holds nothing of any
        other's: at a handoff the running job ends, its markers and views go, then every
        item in the store, before the new owner is recorded (``core.handoff``). Raises
        ``BadOwner`` without touching anything when the owner file cannot be read."""
        owner = await self.owner.read()
        if self.owner.path is None:
            return owner
        loop = asyncio.get_running_loop()
        recorded = await loop.run_in_executor(self.executor, read_store_owner, self.store.root)
        decision = decide_handoff(recorded, owner)
        if decision is StoreHandoff.KEEP:
            return owner
        if decision is StoreHandoff.PURGE:
            await self.neighbours.end()
            log.warning(
                "this node changed hands (CHECKPOINT_DIR was published to another namespace's "
                "pod): ending the job here and removing every item of the previous owner's "
                "from this node's store; its copies on other nodes and in the backup stay"
            )
            await self._end_and_clean()
            gone = await loop.run_in_executor(self.executor, self.foreign.purge)
            await loop.run_in_executor(self.executor, forget_every_state, self.store)
            for job, nbytes in gone.items():
                log.warning(
                    "node handoff: removed job %s from this node: %d bytes",
                    job,
                    nbytes,
                    extra={"job": job},
                )
        # Last: a crash before this line finds the old record, and purges again.
        await loop.run_in_executor(self.executor, write_store_owner, self.store.root, owner)
        return owner

    async def _end_and_clean(self) -> None:
        await self.end_incarnation()
        await asyncio.get_running_loop().run_in_executor(
            self.executor,
            cleanup_workload_files,
            self.opts.checkpoint_dir,
            self.store,
            self.neighbours.views(),
        )

    async def _reject_not_regular(self, kind: str) -> None:
        """A ``replicator.yaml`` that is a symlink or FIFO: never read, refused, removed."""
        await self._refuse(
            None,
            f"{CONFIG_FILE} is {kind}, not a regular file: the replicator reads only a regular "
            "file",
            f"Write it as one (atomically: {CONFIG_FILE}.tmp, then rename)",
        )
        self.handshake.remove_not_regular()

    async def _registration_refused(self, job: str, exc: OwnedByAnother) -> None:
        """The job name ``job`` turned out registered to another owner after a resume: the
        job stops here as a refused handshake would."""
        running = self.incarnation
        if running is not None and running.config.job_name == job:
            log.error("stopping job %s: %s", job, exc, extra={"job": job})
            # Not recorded for ``mtc upload``: the name is another owner's in the backup.
            await self.end_incarnation(remember=False)
            text = f"mtc-replicator: job {job} stopped: {exc}.\n{_restart(exc)}.\n"
            fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, text.encode())

    async def resume(self, resumed: Incarnation) -> None:
        """Resume the incarnation a restart interrupted, under the owner the node has now
        (the same pod's, unless the handshake was refused before)."""
        job = resumed.config.job_name
        try:
            resumed.owner = await self.owner_now()
            if load_state(self.store, self.ctx.state_name) is None:
                log.warning(
                    "not resuming incarnation %s of job %s: %s",
                    resumed.id,
                    job,
                    HANDED,
                    extra={"job": job},
                )
                return
            await self.rank0.host(
                resumed.config,
                resumed.owner,
                incarnation=resumed.id,
                resume_steady=resumed.phase is IncarnationPhase.STEADY,
                register_later=True,
            )
        except Stopping as exc:
            log.info(
                "not resuming incarnation %s of job %s: %s",
                resumed.id,
                job,
                exc,
                extra={"job": job},
            )
            return  # its saved state stays: the next start resumes it
        except (BadOwner, OwnedByAnother) as exc:
            log.error(
                "not resuming incarnation %s of job %s: %s",
                resumed.id,
                job,
                exc,
                extra={"job": job},
            )
            save_state(self.store, None, self.ctx.state_name)
            text = f"mtc-replicator: not resuming job {job}: {exc}.\n{_restart(exc)}.\n"
            fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, text.encode())
            return
        log.info(
            "resuming incarnation %s of job %s (phase %s)",
            resumed.id,
            job,
            resumed.phase,
            extra={"job": job},
        )
        self.incarnation = resumed
        resumed.start()

    async def end_incarnation(self, *, drain: str | None = None, remember: bool = True) -> None:
        """Stop the running incarnation, if any; its items stay, as another job's.

        ``drain``: why its job ends here (a switch, a job end): its newest step is drained
        first, as on SIGTERM, within ``--drain-seconds``. ``remember``: keep its config for
        ``mtc upload`` (``node.reclaim.ForeignItems.configs``).
        """
        running = self.incarnation
        if running is None:
            return
        job = running.config.job_name
        if drain is not None:
            self._tell_drained(running, await self.drain(drain, shutting_down=False))
        log.info("stopping incarnation %s of job %s", running.id, job, extra={"job": job})
        await running.stop()
        self.foreign.ended(job, running.config_text if remember else None)
        self.incarnation = None
        save_state(self.store, None, self.ctx.state_name)
        if drain is not None:
            # What the bucket holds of it now, for mtc status at once (not at the next
            # reclaim): the drain may just have committed it. Waited for a little only: a
            # slow bucket must not hold the next job's handshake (it lands when it lands).
            self.foreign.recheck(job)
            survey = asyncio.get_running_loop().run_in_executor(
                self.executor, self.foreign.held, frozenset(self.neighbours.jobs())
            )
            await asyncio.wait([survey], timeout=SURVEY_WAIT)

    def _tell_drained(self, running: Incarnation, drained: Drained | None) -> None:
        """Tell the workload (``replicator.errors``, which ``client.finish_job`` relays) when
        its ending job's newest step did not reach the backup here."""
        if self.ctx.backups is None or self.opts.drain_seconds <= 0:
            return
        job = running.config.job_name
        if drained is None:
            if running.phase is not IncarnationPhase.STEADY:
                return  # never restored: nothing of this incarnation's to drain
            why = f"the drain did not end within --drain-seconds {self.opts.drain_seconds:g}"
            step = None
        elif drained.upload_failed:
            why, step = "the drain's upload failed (see the daemon's log)", drained.plan.step
        elif drained.plan.upload and not drained.committed and running.config.nodes == 1:
            why, step = "its COMMIT could not be written", drained.plan.step
        else:
            # Committed, not this rank's to upload, or uploaded and waiting for the other
            # ranks' items: the last of them to drain commits it (docs/daemon.md).
            return
        newest = "its newest step" if step is None else f"its newest step, {step},"
        running.error(
            f"job {job} stopped on this node and {newest} may not be in the backup ({why}): "
            f"its items are kept here; `mtc upload --job {job}` on this node uploads it",
            step,
            ErrorKind.BACKUP,
        )

    def _switching_from(self, job: str) -> str | None:
        """Why the running job drains before ``job`` starts here; None when it is ``job``
        itself (its items stay its own, and the new incarnation restores from them)."""
        running = self.incarnation
        if running is None or running.config.job_name == job:
            return None
        return f"job {job}'s handshake"

    async def _accept(self, config: JobConfig, text: str, seen_at: float | None = None) -> None:
        """Handshake steps 1-4, then hand over to a new incarnation (steps 5-8); ``seen_at``:
        when the yaml was first read (``time.monotonic``), where the restore's timeline
        starts."""
        if config.unknown_keys:
            log.warning(
                "ignoring unknown keys in %s: %s", CONFIG_FILE, ", ".join(config.unknown_keys)
            )
        refusal = self.neighbours.refusal(config)
        if refusal is not None:
            await self._refuse(text, *refusal)
            return
        refused = await self.buckets.verdict(config)
        if refused is not None:
            await self._refuse(
                text,
                refused,
                "Fix the daemon's credentials or the bucket's policy (docs/permissions.md), "
                "then restart the job",
            )
            return
        loop = asyncio.get_running_loop()
        try:
            owner = await self.owner_now()
        except BadOwner as exc:
            await self._refuse(
                text,
                f"cannot tell which namespace this node's pod belongs to: {exc}",
                "The CSI plugin writes that file when it publishes the volume; restart the pod",
            )
            return
        await self.end_incarnation(drain=self._switching_from(config.job_name))
        removed = await loop.run_in_executor(
            self.executor,
            cleanup_workload_files,
            self.opts.checkpoint_dir,
            self.store,
            self.neighbours.views(),
        )
        incarnation_id = new_incarnation_id()
        try:
            # Before the incarnation exists: a refused rank 0 must leave nothing to resume.
            await self.rank0.host(config, owner, incarnation=incarnation_id)
        except OwnedByAnother as exc:
            await self._refuse(text, str(exc), exc.remedy)
            return
        except Stopping as exc:
            log.info("not accepting %s: %s", CONFIG_FILE, exc)
            return  # the yaml stays: the next start takes it
        self.incarnation = Incarnation(
            config,
            self.ctx,
            config_text=text,
            owner=owner,
            incarnation_id=incarnation_id,
            handshake_at=seen_at,
        )
        log.info(
            "accepted %s: job=%s rank=%d/%d framework=%s workers=%d peers=%s incarnation=%s "
            "(removed %d stale files)",
            CONFIG_FILE,
            config.job_name,
            config.node_rank,
            config.nodes,
            config.framework.value,
            config.workers_per_node,
            _peers_said(config),
            self.incarnation.id,
            len(removed),
            extra={"job": config.job_name},
        )
        # Persist before the yaml goes: a crash in between must still end in markers.
        await loop.run_in_executor(self.executor, self.incarnation.persist)
        self.handshake.delete(text)
        self.incarnation.start()


def _peers_said(config: JobConfig) -> str:
    """The accepted-handshake line's word on copies off this node (``core.layout``)."""
    if config.nodes == 1:
        return "none (one node)"
    if off_node_copies(config) == 0:
        return "NONE (no other node holds this rank's steps: a lost node restores from the backup)"
    targets = replication_targets(config)
    equivalents = config.equivalent_ranks(config.node_rank)
    said = [f"copies to {list(targets)}"] if targets else []
    said += [f"equivalents {list(equivalents)}"] if equivalents else []
    return " and ".join(said)


def _restart(exc: Exception) -> str:
    """What the job's owner does after a refusal found at a resume."""
    return exc.remedy if isinstance(exc, BlockedName) else "Restart the job"
