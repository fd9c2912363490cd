"""Prometheus metrics of one daemon: what the code reports, and how it is recorded.

``Metrics`` is the interface the daemon's code calls, one line per event; as it is, it does
nothing, so a daemon started without ``--metrics`` pays one method call per event.
``PrometheusMetrics`` records on its own ``CollectorRegistry`` (never the process-global
one, so tests can make several); ``obs.metrics_endpoint`` serves a registry over HTTP.
``process_metrics`` adds what every process exports (memory, CPU, descriptors, build) and
``FilesystemCollector`` a directory's free and total bytes. No I/O except at scrape time
(``/proc`` and ``statvfs``).

Labels stay few and bounded: a transfer or error kind, a tier, an outcome, and the job a
daemon serves now, as ``mtc_job`` (``job`` is Prometheus' own target label); the series of a
job go when the daemon accepts another job. Step numbers are values, never labels.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mtc_replicator import __version__

# No ``*_created`` series: they double a scrape and say nothing Prometheus cannot see itself
# (a counter's reset shows as a drop). The switch is process-wide and read at scrape time.
disable_created_metrics()  # type: ignore[no-untyped-call]

JOB_LABEL = "mtc_job"
"""The training job's label: not ``job``, which Prometheus gives every target (its scrape
job), so that neither renames the other (``exported_job``) or needs ``honor_labels``."""


class TransferKind(StrEnum):
    """Which way an item's bytes moved (``mtc_transfer_*{kind}``)."""

    INGEST = "ingest"
    """A step taken from the workload and hashed into the store."""
    REPLICATE_OUT = "replicate_out"
    """A push of an own item to a peer."""
    REPLICATE_IN = "replicate_in"
    """A peer's push received, verified and committed here."""
    RESTORE_LOCAL = "restore_local"
    """A local item re-read and verified for a restore."""
    RESTORE_PEER = "restore_peer"
    """An item pulled from a peer for a restore."""
    RESTORE_BACKUP = "restore_backup"
    """An item downloaded from the backup for a restore."""
    BACKUP_UPLOAD = "backup_upload"
    """A step's items uploaded to the backup."""
    SERVE_PULL = "serve_pull"
    """An item sent to a peer that restores from this node."""


class ErrorKind(StrEnum):
    """What a reported problem was about (``mtc_errors_total{kind}``)."""

    INGEST = "ingest"
    REPLICATION = "replication"
    BACKUP = "backup"
    RESTORE = "restore"
    CONFIG = "config"
    OTHER = "other"


class StepTier(StrEnum):
    """``mtc_newest_step{tier}``."""

    COMMITTED = "committed"
    REPLICATED = "replicated"
    BACKUP = "backup"


class RestoreTier(StrEnum):
    """``mtc_newest_restorable_*{tier}``."""

    LOCAL = "local"
    CLUSTER = "cluster"
    BACKUP = "backup"


class RoundOutcome(StrEnum):
    RESTORED = "restored"
    FRESH = "fresh"
    FAILED = "failed"


TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RESTORE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
"""Seconds. Clients give up on a restore after 300 s, so the upper buckets mean trouble."""
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
"""Seconds: a phase takes milliseconds (a local join) to minutes (a backup download)."""

NewestSteps = dict[tuple[str, StepTier], int]
"""(job, tier) -> newest step."""
Restorable = dict[tuple[str, RestoreTier], tuple[int, float]]
"""(job, tier) -> (newest restorable step, Unix time since which it is restorable there)."""
JobState = tuple[NewestSteps, Restorable]
PacingCounts = tuple[Mapping[str, int], Mapping[str, float]]
"""Per traffic class (``restore``, ``replication``, ``backup``): bytes booked, seconds waited."""


class PeerContact(Protocol):
    """The last contact with one peer, as ``core.contacts.Contact`` has it (metrics.py does
    not import the core: the CSI plugin shares this module)."""

    @property
    def peer(self) -> str: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def last_answer_at(self) -> float | None: ...


class Metrics:
    """What the daemon reports; this base class records nothing (no ``--metrics``)."""

    def jobs_from(self, running: Callable[[], Collection[str]]) -> None:
        """Where the jobs this node runs now are read (every job directory's): a job's
        series stay while it runs; those of a job that ended go when another starts."""

    def transfer(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        """One item (or a step's items) moved: ``nbytes`` in ``seconds``."""

    def error(self, kind: ErrorKind) -> None:
        """A problem was reported (logged and written to ``replicator.errors``)."""

    def transfer_too_slow(self, kind: TransferKind) -> None:
        """A peer's push or pull was dropped under the minimum transfer rate."""

    def pin_delete_failed(self, job: str) -> None:
        """A used restore pin of ``job`` could not be deleted from the bucket."""

    def pin_refused(self, job: str) -> None:
        """A restore pin of ``job`` was not honoured: not an operator's, used or expired."""

    def identity_refused(self, where: str) -> None:
        """A caller was refused for who its certificate says it is: ``rpc`` (it names no
        node), ``rank`` (another node holds the rank it acts as) or ``assign`` (an
        ``AssignRank`` not from the controller's certificate)."""

    def serving(self, job: str) -> None:
        """The daemon serves ``job`` now: the series of any other job go."""

    def off_node_copies(self, job: str, count: int) -> None:
        """How many other nodes hold this rank's steps of ``job`` (``core.layout``)."""

    def committed(self, job: str, step: int | None) -> None:
        """The newest step complete in the local store (None: none is)."""

    def replicated(self, job: str, step: int | None) -> None:
        """The newest own step every replication target holds (None: unknown, unchanged)."""

    def cluster_restorable(self, job: str, step: int | None) -> None:
        """The cluster's restorable step, as the coordinator last said (None: unchanged)."""

    def backed_up(self, job: str, step: int, created: float | None) -> None:
        """A committed backup of ``step``, its ``COMMIT`` written at ``created`` (Unix
        seconds); None: not committed (yet), nothing to record."""

    def restore_done(self, job: str, step: int | None, seconds: float) -> None:
        """Markers published after ``seconds``: ``step`` restored, or None: a fresh start."""

    def restore_failed(self, job: str, seconds: float) -> None:
        """The restore could not complete (``replicator.failed`` was written)."""

    def restore_phases(self, seconds: Mapping[str, float]) -> None:
        """A restore ended (done or failed): the seconds of each phase it went through
        (``core.timeline.RestorePhase`` values)."""

    def peer_contacts(
        self,
        read: Callable[[], Sequence[PeerContact]],
        current: Callable[[], Collection[str]],
    ) -> None:
        """Export ``read()``, the last contact per peer, at each scrape: only the contacts of
        ``current()``, the running job's peer addresses (an address a peer left behind when
        it moved, or a restore's source, is not a peer to alert on)."""

    def pacing(self, read: Callable[[], PacingCounts], limit: float | None) -> None:
        """Export the daemon's pacer: ``read`` is called at every scrape."""

    def held_without_backup(self, bytes_by_job: Mapping[str, int]) -> None:
        """Bytes held here of each job that does not run here and whose newest step held
        is not in the backup (kept: they may be its only copy); replaces the last set."""

    def foreign_dropped(self, job: str, nbytes: int) -> None:
        """A job that does not run here was dropped from this node (TTL, room, operator)."""


NO_METRICS = Metrics()
"""The default everywhere: records nothing."""


IDENTITY_REFUSALS = ("rpc", "rank", "assign")
"""Where a caller is refused for its certificate (``Metrics.identity_refused``)."""


def _identity_refusals(registry: CollectorRegistry) -> Counter:
    counter = Counter(
        "mtc_identity_refusals",
        "Calls refused for the caller's certificate: names no node (rpc), another node "
        "holds the rank it acts as (rank), or an AssignRank not from the controller (assign).",
        ["where"],
        registry=registry,
    )
    for where in IDENTITY_REFUSALS:
        counter.labels(where)  # exported at 0 from the start, as every bounded label
    return counter


class PrometheusMetrics(Metrics):
    """Records into ``registry`` (a new one by default); ``clock`` is wall time, for ages;
    ``phases``: every restore phase's name, exported from the start (``obs`` may not
    import ``core``, which the CSI plugin must not carry: the daemon names them)."""

    # Long: one declaration per metric, all in one place: what the endpoint serves.
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        phases: Iterable[str] = (),
    ) -> None:
        r = self.registry = CollectorRegistry() if registry is None else registry
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: set[str] = set()
        """The jobs whose series are exported."""
        self._running: Callable[[], Collection[str]] = frozenset
        self._steps: NewestSteps = {}
        self._restorable: Restorable = {}
        self._bytes = Counter(
            "mtc_transfer_bytes", "Bytes moved, by transfer kind.", ["kind"], registry=r
        )
        self._seconds = Histogram(
            "mtc_transfer_seconds",
            "Duration of each transfer, by kind.",
            ["kind"],
            registry=r,
            buckets=TRANSFER_BUCKETS,
        )
        self._errors = Counter(
            "mtc_errors", "Problems reported to the workload, by kind.", ["kind"], registry=r
        )
        self._too_slow = Counter(
            "mtc_transfers_too_slow",
            "Peer transfers dropped for moving under --min-transfer-rate, by kind.",
            ["kind"],
            registry=r,
        )
        self._identity_refusals = _identity_refusals(r)
        self._pin_delete_failures = Counter(
            "mtc_pin_delete_failures",
            "Used restore pins this node's coordinator could not delete from the bucket.",
            [JOB_LABEL],
            registry=r,
        )
        self._pins_refused = Counter(
            "mtc_pins_refused",
            "Restore pins this node's coordinator refused: not signed by an operator, used "
            "already or expired.",
            [JOB_LABEL],
            registry=r,
        )
        self._rounds = Counter(
            "mtc_restore_rounds", "Restores, by outcome.", [JOB_LABEL, "outcome"], registry=r
        )
        self._restore_seconds = Histogram(
            "mtc_restore_seconds",
            "Duration of each restore, from its start to the markers (or the failure).",
            ["outcome"],
            registry=r,
            buckets=RESTORE_BUCKETS,
        )
        self._phase_seconds = Histogram(
            "mtc_restore_phase_seconds",
            "Seconds each restore spent in each phase on this node (core.timeline).",
            ["phase"],
            registry=r,
            buckets=PHASE_BUCKETS,
        )
        # Every bounded label value exists from the start: rate() needs the zero.
        for phase in phases:
            self._phase_seconds.labels(phase)
        for transfer in TransferKind:
            self._bytes.labels(transfer.value)
            self._seconds.labels(transfer.value)
        for transfer in (TransferKind.REPLICATE_IN, TransferKind.SERVE_PULL):
            self._too_slow.labels(transfer.value)
        for error in ErrorKind:
            self._errors.labels(error.value)
        for outcome in RoundOutcome:
            self._restore_seconds.labels(outcome.value)
        self._held_unbacked = Gauge(
            "mtc_held_without_backup_bytes",
            "Bytes held here of a job that does not run here and whose newest step held is "
            "not in the backup: kept, as they may be its only copy.",
            [JOB_LABEL],
            registry=r,
        )
        self._foreign_dropped = Counter(
            "mtc_foreign_dropped_bytes",
            "Bytes of jobs that do not run here, dropped from this node (TTL, room, mtc drop).",
            registry=r,
        )
        self._off_node = Gauge(
            "mtc_off_node_copies",
            "Other nodes holding this rank's steps (its peers' copies and data-parallel "
            "equivalents); 0 in a multi-node job: a lost node restores from the backup.",
            [JOB_LABEL],
            registry=r,
        )
        r.register(_JobStateCollector(self.job_state, clock))

    def transfer(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        self._bytes.labels(kind.value).inc(max(nbytes, 0))
        self._seconds.labels(kind.value).observe(max(seconds, 0.0))

    def error(self, kind: ErrorKind) -> None:
        self._errors.labels(kind.value).inc()

    def transfer_too_slow(self, kind: TransferKind) -> None:
        self._too_slow.labels(kind.value).inc()

    def pin_delete_failed(self, job: str) -> None:
        self._pin_delete_failures.labels(job).inc()

    def pin_refused(self, job: str) -> None:
        self._pins_refused.labels(job).inc()

    def identity_refused(self, where: str) -> None:
        self._identity_refusals.labels(where).inc()

    def held_without_backup(self, bytes_by_job: Mapping[str, int]) -> None:
        with self._lock:
            self._held_unbacked.clear()
            for job, nbytes in bytes_by_job.items():
                self._held_unbacked.labels(job).set(nbytes)

    def foreign_dropped(self, job: str, nbytes: int) -> None:
        self._foreign_dropped.inc(max(nbytes, 0))

    def serving(self, job: str) -> None:
        with self._lock:
            self._adopt(job)

    def off_node_copies(self, job: str, count: int) -> None:
        with self._lock:
            self._adopt(job)
            self._off_node.labels(job).set(count)

    def jobs_from(self, running: Callable[[], Collection[str]]) -> None:
        self._running = running

    def _adopt(self, job: str) -> None:
        """Export ``job``'s series (under the lock); a job new here forgets those of every
        job that no longer runs: bounded by the jobs a node runs at once."""
        if job in self._jobs:
            return
        keep = {job, *self._running()}
        for gone in self._jobs - keep:
            for outcome in RoundOutcome:
                self._rounds.remove(gone, outcome.value)
            with contextlib.suppress(KeyError):
                self._pin_delete_failures.remove(gone)
            with contextlib.suppress(KeyError):
                self._pins_refused.remove(gone)
            with contextlib.suppress(KeyError):
                self._off_node.remove(gone)
        self._jobs = (self._jobs & keep) | {job}
        self._steps = {k: v for k, v in self._steps.items() if k[0] in self._jobs}
        self._restorable = {k: v for k, v in self._restorable.items() if k[0] in self._jobs}
        for outcome in RoundOutcome:
            self._rounds.labels(job, outcome.value)

    def _set_restorable(self, job: str, tier: RestoreTier, step: int, since: float) -> None:
        held = self._restorable.get((job, tier))
        if held is None or held[0] != step:
            self._restorable[(job, tier)] = (step, since)

    def committed(self, job: str, step: int | None) -> None:
        with self._lock:
            self._adopt(job)
            if step is None:
                self._steps.pop((job, StepTier.COMMITTED), None)
                self._restorable.pop((job, RestoreTier.LOCAL), None)
                return
            self._steps[(job, StepTier.COMMITTED)] = step
            self._set_restorable(job, RestoreTier.LOCAL, step, self._clock())

    def replicated(self, job: str, step: int | None) -> None:
        if step is None:
            return
        with self._lock:
            self._adopt(job)
            self._steps[(job, StepTier.REPLICATED)] = step

    def cluster_restorable(self, job: str, step: int | None) -> None:
        if step is None:
            return
        with self._lock:
            self._adopt(job)
            self._set_restorable(job, RestoreTier.CLUSTER, step, self._clock())

    def backed_up(self, job: str, step: int, created: float | None) -> None:
        if created is None:
            return
        with self._lock:
            self._adopt(job)
            newest = self._steps.get((job, StepTier.BACKUP))
            if newest is not None and step <= newest:
                return  # backups only ever get newer; a listing may lag a commit
            self._steps[(job, StepTier.BACKUP)] = step
            self._restorable[(job, RestoreTier.BACKUP)] = (step, created)

    def restore_done(self, job: str, step: int | None, seconds: float) -> None:
        self._round(job, RoundOutcome.FRESH if step is None else RoundOutcome.RESTORED, seconds)

    def restore_failed(self, job: str, seconds: float) -> None:
        self._round(job, RoundOutcome.FAILED, seconds)

    def _round(self, job: str, outcome: RoundOutcome, seconds: float) -> None:
        with self._lock:
            self._adopt(job)
            self._rounds.labels(job, outcome.value).inc()
        self._restore_seconds.labels(outcome.value).observe(max(seconds, 0.0))

    def restore_phases(self, seconds: Mapping[str, float]) -> None:
        for phase, secs in seconds.items():
            self._phase_seconds.labels(phase).observe(max(secs, 0.0))

    def pacing(self, read: Callable[[], PacingCounts], limit: float | None) -> None:
        self.registry.register(_PacingCollector(read, limit))

    def peer_contacts(
        self,
        read: Callable[[], Sequence[PeerContact]],
        current: Callable[[], Collection[str]],
    ) -> None:
        self.registry.register(_PeerCollector(read, current))

    def job_state(self) -> JobState:
        """A copy of the per-job state: newest steps, and restorable steps with since when."""
        with self._lock:
            return dict(self._steps), dict(self._restorable)


class _JobStateCollector:
    """The per-job gauges, computed at scrape time (ages are relative to the scrape)."""

    def __init__(self, state: Callable[[], JobState], clock: Callable[[], float]) -> None:
        self._state = state
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        steps, restorable = self._state()
        now = self._clock()
        newest = GaugeMetricFamily(
            "mtc_newest_step",
            "Newest step of the job committed here, replicated to this rank's peers, "
            "or committed in the backup.",
            labels=[JOB_LABEL, "tier"],
        )
        for (job, step_tier), step in sorted(steps.items()):
            newest.add_metric([job, step_tier.value], step)
        step_of = GaugeMetricFamily(
            "mtc_newest_restorable_step",
            "Newest step restorable from the tier.",
            labels=[JOB_LABEL, "tier"],
        )
        since = GaugeMetricFamily(
            "mtc_newest_restorable_timestamp_seconds",
            "Unix time since which the newest restorable step is restorable from the tier.",
            labels=[JOB_LABEL, "tier"],
        )
        age = GaugeMetricFamily(
            "mtc_newest_restorable_age_seconds",
            "Seconds since the newest restorable step became restorable from the tier.",
            labels=[JOB_LABEL, "tier"],
        )
        for (job, tier), (step, at) in sorted(restorable.items()):
            step_of.add_metric([job, tier.value], step)
            since.add_metric([job, tier.value], at)
            age.add_metric([job, tier.value], max(now - at, 0.0))
        yield from (newest, step_of, since, age)


class _PacingCollector:
    """What the daemon's outgoing transfers sent and waited, per traffic class, at scrape."""

    def __init__(self, read: Callable[[], PacingCounts], limit: float | None) -> None:
        self._read = read
        self._limit = limit

    def collect(self) -> Iterator[Metric]:
        sent, waited = self._read()
        nbytes = CounterMetricFamily(
            "mtc_paced_bytes",
            "Bytes this daemon sent, by traffic class (restore, replication, backup).",
            labels=["traffic"],
        )
        seconds = CounterMetricFamily(
            "mtc_paced_wait_seconds",
            "Seconds transfers waited for the rate limit, a higher class or a save, by class.",
            labels=["traffic"],
        )
        for traffic in sorted(set(sent) | set(waited)):
            nbytes.add_metric([traffic], sent.get(traffic, 0))
            seconds.add_metric([traffic], waited.get(traffic, 0.0))
        limit = GaugeMetricFamily(
            "mtc_max_transfer_rate_bytes",
            "--max-transfer-rate in bytes per second (0: unlimited).",
        )
        limit.add_metric([], self._limit or 0.0)
        yield from (nbytes, seconds, limit)


# --- every process ---------------------------------------------------------------------------


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def process_metrics(registry: CollectorRegistry) -> None:
    """``process_*`` (resident memory, CPU seconds, open and max descriptors, from
    ``/proc``), ``python_info`` and ``mtc_build_info{version, python, grpc}`` = 1."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    info = Gauge(
        "mtc_build_info",
        "Always 1: the mtc version and the Python and grpcio it runs on.",
        ["version", "python", "grpc"],
        registry=registry,
    )
    info.labels(__version__, platform.python_version(), _distribution_version("grpcio")).set(1)


class FilesystemCollector:
    """``<prefix>_free_bytes`` and ``<prefix>_size_bytes`` of the filesystem holding
    ``path``, read with ``statvfs`` at each scrape; nothing while ``path`` is missing (the
    readiness probe says why). With ``kind`` (the filesystem's type, None: unknown, and
    whether it keeps its files in RAM), ``<prefix>_in_memory{fstype}`` too."""

    def __init__(
        self,
        path: Path,
        prefix: str,
        what: str,
        kind: Callable[[], tuple[str | None, bool]] | None = None,
    ) -> None:
        self._path = path
        self._prefix = prefix
        self._what = what
        self._kind = kind

    def collect(self) -> Iterator[Metric]:
        try:
            st = os.statvfs(self._path)
        except OSError:
            return
        free = GaugeMetricFamily(
            f"{self._prefix}_free_bytes",
            f"Bytes an unprivileged writer can still write to {self._what}.",
        )
        free.add_metric([], st.f_bavail * st.f_frsize)
        size = GaugeMetricFamily(
            f"{self._prefix}_size_bytes", f"Total bytes of the filesystem of {self._what}."
        )
        size.add_metric([], st.f_blocks * st.f_frsize)
        yield from (free, size)
        if self._kind is not None:
            fs_type, in_memory = self._kind()
            memory = GaugeMetricFamily(
                f"{self._prefix}_in_memory",
                f"1 when {self._what} is on a filesystem in RAM (tmpfs, ramfs), else 0.",
                labels=["fstype"],
            )
            memory.add_metric([fs_type or "unknown"], 1.0 if in_memory else 0.0)
            yield memory


class _PeerCollector:
    """Whether each of the running job's peers answered its last call or probe, and when it
    last answered."""

    def __init__(
        self,
        read: Callable[[], Sequence[PeerContact]],
        current: Callable[[], Collection[str]],
    ) -> None:
        self._read = read
        self._current = current

    def collect(self) -> Iterator[Metric]:
        reachable = GaugeMetricFamily(
            "mtc_peer_reachable",
            "1 when the peer (HOST:PORT) answered this daemon's last call or health probe.",
            labels=["peer"],
        )
        answered = GaugeMetricFamily(
            "mtc_peer_last_contact_timestamp_seconds",
            "When the peer last answered this daemon (unix seconds); absent: never.",
            labels=["peer"],
        )
        current = set(self._current())
        for contact in self._read():
            if contact.peer not in current:
                continue
            reachable.add_metric([contact.peer], 1.0 if contact.reachable else 0.0)
            if contact.last_answer_at is not None:
                answered.add_metric([contact.peer], contact.last_answer_at)
        yield from (reachable, answered)
