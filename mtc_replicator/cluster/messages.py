"""The ``mtc.v1.Coordinator`` messages in our own types, both ways, and the checks on them.

Pure: no I/O. A request is hostile input until these checks pass (a bug or an attacker on
another node can send anything), and so is an answer (the address in a registry entry may
belong to anything by now). Every check raises ``BadMessage`` naming the field; the servicer
turns it into INVALID_ARGUMENT, the client into ``CoordinatorError``. The requests the
servicer takes are checked here whole (``join_call``, ``status_call``, ``restore_report_call``,
``progress_call``), in the order the checks were always made, so the servicer only calls
``cluster.coordinators`` and answers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field, replace

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2
from mtc_replicator.cluster.registry import MalformedEntry
from mtc_replicator.cluster.registry import check_address as _registry_check_address
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.coordination import Phase, ProgressAnswer, RankStatus
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import check_owner
from mtc_replicator.core.policy import Source
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.rank_holders import MAX_NODE_CHARS
from mtc_replicator.core.restore_plan import Fetch, NodeInventory, SourceKey

SERVICE = "mtc.v1.Coordinator"
"""The full service name (health checks, method paths)."""
MAX_ITEMS = 65_536
"""Items in one join or failures in one report. A node holds a few steps of its own items
and its peers' (``workers-per-node`` each), far below this; ~7 MB of message at most."""
MAX_JOIN_STEPS = 64
"""Steps of one rank a join may list: a node keeps a rank's newest complete step, the
steps still arriving and those being uploaded, a handful (``core.policy``)."""
MAX_CLUSTER_VIEW_CHARS = 4096
MAX_DETAIL_CHARS = 1024
"""A failure's detail is for logs: longer ones are cut, not refused."""
MAX_WAIT_SECONDS = 30
MAX_PRODUCERS = 16
"""Nodes a source's rank has had, on the wire: the coordinator keeps 8 (``MAX_HISTORY``)."""
INCARNATION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

State = pb.RoundStatusResponse.State


class BadMessage(ValueError):
    """A request or answer breaks the protocol; the message names the field and value."""


def cluster_view_json(config: JobConfig) -> str:
    """The canonical JSON of the keys every rank must agree on (``JoinRequest.cluster_view``)."""
    return json.dumps(config.cluster_view(), sort_keys=True, separators=(",", ":"))


# --- field checks ----------------------------------------------------------------------------


def check_job(job: str, what: str = "job") -> str:
    if not is_job_name(job):
        raise BadMessage(f"{what}: unsafe job name {job!r:.80}")
    return job


def check_incarnation(incarnation_id: str) -> str:
    if not INCARNATION_RE.fullmatch(incarnation_id):
        raise BadMessage(
            f"incarnation_id must match {INCARNATION_RE.pattern}: {incarnation_id!r:.80}"
        )
    return incarnation_id


def check_digest(digest: str, what: str) -> str:
    if not _DIGEST_RE.fullmatch(digest):
        raise BadMessage(f"{what}: a digest is 64 lowercase hex digits, not {digest!r:.80}")
    return digest


def check_address(address: str, what: str = "address") -> str:
    try:
        return _registry_check_address(address)
    except MalformedEntry as exc:
        raise BadMessage(f"{what}: {exc}") from None


def check_producers(source: pb.ItemSource, what: str) -> tuple[str, ...] | None:
    """The nodes a source's item may come from (None: not known, as from a coordinator
    older than the field): at most ``MAX_PRODUCERS`` node names."""
    if not source.producers_known:
        if source.producers:
            raise BadMessage(f"{what}: producers are given but not known")
        return None
    if len(source.producers) > MAX_PRODUCERS:
        raise BadMessage(f"{what}: {len(source.producers)} producers, more than {MAX_PRODUCERS}")
    for name in source.producers:
        if len(name) > MAX_NODE_CHARS or not name.isascii() or not name.isprintable():
            raise BadMessage(f"{what}: producer {name[:40]!r} is not a node name")
    return tuple(source.producers)


def check_count(values: Sized, what: str, limit: int = MAX_ITEMS) -> None:
    if len(values) > limit:
        raise BadMessage(f"{what}: {len(values)} entries, at most {limit}")


MAX_HELD_STEPS = 1024
"""Most steps a progress report may promise to keep (a rank keeps a handful)."""


def check_held_steps(steps: Sequence[int]) -> frozenset[int]:
    """A progress report's promised steps, bounded."""
    check_count(steps, "held_steps", MAX_HELD_STEPS)
    return frozenset(steps)


MAX_ADDRESS_RANKS = 1024
"""Most ranks a caller may ask the addresses of (its replication targets: a handful)."""


def node_map(message: Mapping[int, str]) -> dict[int, str]:
    """The ranks' node names from the wire (at most one per rank asked for), each checked."""
    check_count(message, "nodes", MAX_ADDRESS_RANKS)
    for rank, name in message.items():
        if len(name) > MAX_NODE_CHARS or not (name.isascii() and name.isprintable()):
            raise BadMessage(f"nodes[{rank}] is not a node name: {name[:80]!r}")
    return dict(message)


def check_address_ranks(ranks: Sequence[int], given: bool) -> frozenset[int] | None:
    """The ranks whose addresses a request asks for; None: every rank's (older callers)."""
    if not given:
        return None
    check_count(ranks, "address_ranks", MAX_ADDRESS_RANKS)
    return frozenset(ranks)


# --- items -----------------------------------------------------------------------------------


def item_ref(item: ItemId) -> peer_pb2.ItemRef:
    return peer_pb2.ItemRef(job=item.job, step=item.step, rank=item.rank, worker=item.worker)


def item_id(ref: peer_pb2.ItemRef, job: str, what: str) -> ItemId:
    """``ref`` as an ItemId; it must be an item of ``job`` (one job per conversation)."""
    if ref.job != job:
        raise BadMessage(f"{what}: an item of job {ref.job!r:.80} where job {job} was expected")
    return ItemId(ref.job, ref.step, ref.rank, ref.worker)


def held_items(items: Mapping[ItemId, str]) -> list[pb.HeldItem]:
    return [
        pb.HeldItem(item=item_ref(item), manifest_digest=digest)
        for item, digest in sorted(items.items())
    ]


def join_item_limit(config: JobConfig) -> int:
    """The most items one join of ``config``'s job may list: every rank's workers, each
    at ``MAX_JOIN_STEPS`` steps, and never more than ``MAX_ITEMS``. Counted before any item
    is converted: 65,535 invented items cost a coordinator's loop up to 2.6 s per join."""
    return min(MAX_ITEMS, config.nodes * config.workers_per_node * MAX_JOIN_STEPS)


def inventory_items(
    job: str, held: Sequence[pb.HeldItem], limit: int = MAX_ITEMS
) -> dict[ItemId, str]:
    """A join's items: at most ``limit``, each of ``job``, a real digest, none listed twice."""
    check_count(held, "items", limit)
    items: dict[ItemId, str] = {}
    for i, entry in enumerate(held):
        item = item_id(entry.item, job, f"items[{i}]")
        digest = check_digest(entry.manifest_digest, f"items[{i}] ({item})")
        if items.setdefault(item, digest) != digest:
            raise BadMessage(f"items[{i}]: {item} is listed twice with different digests")
    return items


# --- sources and assignments -----------------------------------------------------------------

_KINDS = {
    Source.LOCAL: pb.ItemSource.LOCAL,
    Source.PEER: pb.ItemSource.PEER,
    Source.BACKUP: pb.ItemSource.BACKUP,
}
_SOURCES = {kind: source for source, kind in _KINDS.items()}


def item_source(fetch: Fetch, address: str = "") -> pb.ItemSource:
    """``fetch`` on the wire; a PEER source carries its holder's rank and ``address``."""
    source = pb.ItemSource(
        kind=_KINDS[fetch.source],
        item=item_ref(fetch.item),
        manifest_digest=fetch.digest,
        equivalent=fetch.equivalent,
    )
    if fetch.producers is not None:
        source.producers_known = True
        source.producers.extend(fetch.producers)
    if fetch.source is Source.PEER:
        assert fetch.holder is not None
        source.holder_rank = fetch.holder
        source.address = address
        source.after_restore = fetch.pending
    return source


def _source(source: pb.ItemSource, what: str) -> Source:
    found = _SOURCES.get(source.kind)
    if found is None:
        raise BadMessage(f"{what}: unknown source kind {source.kind}")
    return found


def fetch_of(source: pb.ItemSource, target: ItemId, what: str) -> tuple[Fetch, str | None]:
    """One way to obtain ``target``, and the holder's address for a PEER source.

    The source must be ``target`` itself or (``equivalent``) another rank's item of the same
    step and worker: a coordinator can never send a rank to restore something else.
    """
    kind = _source(source, what)
    item = item_id(source.item, target.job, what)
    if (item.step, item.worker) != (target.step, target.worker) or (
        source.equivalent != (item.rank != target.rank)
    ):
        equivalent = "an equivalent" if source.equivalent else "the item itself"
        raise BadMessage(f"{what}: {item} is not {equivalent} of {target}")
    digest = check_digest(source.manifest_digest, what)
    producers = check_producers(source, what)
    if kind is Source.PEER:
        if source.holder_rank == target.rank:
            raise BadMessage(f"{what}: rank {target.rank} is sent to itself as a peer")
        address = check_address(source.address, what)
        fetch = Fetch(
            kind,
            item,
            source.holder_rank,
            digest,
            source.equivalent,
            source.after_restore,
            producers,
        )
        return fetch, address
    if source.after_restore:
        # Only a peer can obtain an item for us: a pending local or backup copy is nonsense.
        raise BadMessage(f"{what}: a {kind.value} source cannot be obtained after the restore")
    # LOCAL is held by the restoring rank itself (its own item or an equivalent's copy).
    holder = target.rank if kind is Source.LOCAL else None
    return Fetch(kind, item, holder, digest, source.equivalent, producers=producers), None


def assignment_messages(
    assignments: Mapping[ItemId, Sequence[Fetch]], addresses: Mapping[int, str]
) -> list[pb.ItemAssignment]:
    return [
        pb.ItemAssignment(
            target=item_ref(target),
            sources=[
                item_source(f, "" if f.holder is None else addresses[f.holder]) for f in fetches
            ],
        )
        for target, fetches in sorted(assignments.items())
    ]


def address_map(message: Mapping[int, str]) -> dict[int, str]:
    """A map of peer addresses by rank from the wire, every address checked."""
    return {r: check_address(a, f"addresses[{r}]") for r, a in message.items()}


def _add_address(addresses: dict[int, str], rank: int, address: str) -> None:
    if addresses.setdefault(rank, address) != address:
        raise BadMessage(f"rank {rank} is given two addresses: {addresses[rank]} and {address}")


def assignments_of(
    messages: Sequence[pb.ItemAssignment], job: str, rank: int, step: int | None
) -> tuple[dict[ItemId, list[Fetch]], dict[int, str]]:
    """A rank's assignments of ``step``, and the PEER holders' addresses by rank."""
    check_count(messages, "assignments")
    assignments: dict[ItemId, list[Fetch]] = {}
    addresses: dict[int, str] = {}
    for i, message in enumerate(messages):
        target = item_id(message.target, job, f"assignments[{i}]")
        if target.rank != rank or target.step != step or target in assignments:
            raise BadMessage(f"assignments[{i}]: {target} is not for rank {rank}, step {step}")
        if not message.sources:
            raise BadMessage(f"assignments[{i}]: {target} has no source")
        check_count(message.sources, f"assignments[{i}].sources")
        fetches = []
        for j, source in enumerate(message.sources):
            fetch, address = fetch_of(source, target, f"assignments[{i}].sources[{j}]")
            if address is not None and fetch.holder is not None:
                _add_address(addresses, fetch.holder, address)
            fetches.append(fetch)
        assignments[target] = fetches
    return assignments, addresses


@dataclass(frozen=True)
class FailedFetch:
    """A source that failed during a restore, as a rank reports it."""

    fetch: Fetch
    corrupt: bool
    """The bytes differed from the digest (else the source was unreachable or refused)."""
    detail: str = ""


@dataclass(frozen=True)
class RestoreReport:
    """A rank's ReportRestore, in our types: its outcome for one plan of a round."""

    round: int
    plan_version: int
    ready: bool
    """Every assigned item is present and verified."""
    failures: tuple[FailedFetch, ...] = ()
    """The sources that failed, in the order they were tried."""
    addresses: Mapping[int, str] = field(default_factory=dict)
    """The round's addresses by rank: a PEER failure names its holder's (for the logs)."""


def failure_message(failure: FailedFetch, address: str = "") -> pb.FailedSource:
    """``failure`` for ReportRestore; ``address`` is the PEER holder's, for the logs."""
    # The coordinator keys a failure by holder and item: the producers would be ballast.
    source = item_source(replace(failure.fetch, producers=None), address)
    return pb.FailedSource(
        source=source, corrupt=failure.corrupt, detail=failure.detail[:MAX_DETAIL_CHARS]
    )


def source_keys(
    failures: Sequence[pb.FailedSource], job: str, rank: int, nodes: int, limit: int = MAX_ITEMS
) -> list[SourceKey]:
    """The copies a rank reports as failed, as the state machine excludes them: at most
    ``limit`` (``join_item_limit``: a plan gives a rank far fewer sources), counted first."""
    check_count(failures, "failures", limit)
    keys = []
    for i, failure in enumerate(failures):
        what = f"failures[{i}]"
        kind = _source(failure.source, what)
        item = item_id(failure.source.item, job, what)
        if kind is Source.PEER:
            holder: int | None = failure.source.holder_rank
            if not 0 <= failure.source.holder_rank < nodes:
                raise BadMessage(f"{what}: holder rank {holder} is not in [0, {nodes})")
        else:
            holder = rank if kind is Source.LOCAL else None
        keys.append(SourceKey(holder, item))
    return keys


# --- round status ----------------------------------------------------------------------------

_STATES = {Phase.WAITING: State.WAITING, Phase.FETCH: State.FETCH, Phase.RELEASED: State.RELEASED}
_PHASES = {state: phase for phase, state in _STATES.items()}

StatusKey = tuple[int, State.ValueType, int]
"""(round, state, plan version): what a long poll compares to what its caller saw."""


def state_of(phase: Phase | None) -> State.ValueType:
    return State.REJOIN if phase is None else _STATES[phase]


def status_key(status: RankStatus) -> StatusKey:
    return (status.round, state_of(status.phase), status.plan_version)


def long_poll_wait(seconds: float) -> int:
    """A long poll's wait as the wire carries it: whole seconds, 0 to ``MAX_WAIT_SECONDS``."""
    return max(0, min(MAX_WAIT_SECONDS, math.ceil(seconds)))


def seen_key(request: pb.RoundStatusRequest) -> StatusKey:
    return (request.round, request.seen_state, request.seen_plan_version)


@dataclass(frozen=True)
class RoundState:
    """A RoundStatus answer in our types: the round as one rank should see it."""

    round: int
    phase: Phase | None
    """None: this incarnation is not a member of the current round; join again."""
    plan_version: int = 0
    step: int | None = None
    """FETCH and RELEASED: the restored step; None means a fresh start."""
    assignments: dict[ItemId, list[Fetch]] = field(default_factory=dict)
    """Each item this rank must end up with -> its sources, in the order to try."""
    missing: tuple[int, ...] = ()
    message: str = ""
    addresses: dict[int, str] = field(default_factory=dict)
    """FETCH and RELEASED: every member's Peer address by rank (PEER sources' holders too)."""

    @property
    def key(self) -> StatusKey:
        return (self.round, state_of(self.phase), self.plan_version)


@dataclass(frozen=True)
class Joined:
    """A Join answer: the round it counts for and, when the join long-polled, the round as
    the rank sees it after the wait (None: not asked for, or an older coordinator)."""

    round: int
    state: RoundState | None = None


def status_message(
    identity: pb.CoordinatorIdentity, status: RankStatus, addresses: Mapping[int, str]
) -> pb.RoundStatusResponse:
    """``status`` on the wire; ``addresses`` are the members' by rank."""
    planned = status.phase in (Phase.FETCH, Phase.RELEASED)
    return pb.RoundStatusResponse(
        coordinator=identity,
        round=status.round,
        state=state_of(status.phase),
        missing_ranks=status.missing,
        fresh_start=planned and status.step is None,
        step=status.step or 0,
        plan_version=status.plan_version,
        assignments=assignment_messages(status.assignments, addresses) if planned else (),
        message=status.message,
        addresses=dict(addresses) if planned else {},
    )


def round_state(message: pb.RoundStatusResponse, job: str, rank: int) -> RoundState:
    """Check and convert an answer to rank ``rank``'s RoundStatus."""
    phase = _PHASES.get(message.state)
    if phase is None and message.state != State.REJOIN:
        raise BadMessage(f"state: unknown round state {message.state}")
    planned = phase in (Phase.FETCH, Phase.RELEASED)
    step = message.step if planned and not message.fresh_start else None
    addresses = address_map(message.addresses)
    assignments, holders = assignments_of(message.assignments, job, rank, step)
    for holder, address in holders.items():
        _add_address(addresses, holder, address)
    check_count(message.missing_ranks, "missing_ranks")
    return RoundState(
        round=message.round,
        phase=phase,
        plan_version=message.plan_version,
        step=step,
        assignments=assignments,
        missing=tuple(message.missing_ranks),
        message=message.message[:MAX_DETAIL_CHARS],
        addresses=addresses,
    )


# --- the servicer's calls and answers -------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who answers a coordinator call: every answer names it, so callers notice a stale
    registry entry (another job) or a restarted coordinator (another id)."""

    job: str
    coordinator_id: str


def identity_message(identity: Identity) -> pb.CoordinatorIdentity:
    return pb.CoordinatorIdentity(job=identity.job, coordinator_id=identity.coordinator_id)


@dataclass(frozen=True)
class JoinCall:
    """A JoinRequest, checked, in our types."""

    incarnation: str
    cluster_view: str
    owner: str
    inventory: NodeInventory
    address_ranks: frozenset[int] | None


def join_call(request: pb.JoinRequest, job: str, item_limit: Callable[[str], int]) -> JoinCall:
    """Check a join of ``job`` (its name checked already). ``item_limit(owner)`` is the most
    items the job takes in a join of that owner's; it raises for an owner who may not join,
    before the items are read, so a refusal tells nothing of the job."""
    incarnation = check_incarnation(request.incarnation_id)
    address = check_address(request.address)
    if not 0 < len(request.cluster_view) <= MAX_CLUSTER_VIEW_CHARS:
        raise BadMessage(f"cluster_view must have 1 to {MAX_CLUSTER_VIEW_CHARS} characters")
    owner = check_owner(request.owner)
    items = inventory_items(job, request.items, item_limit(owner))
    address_ranks = check_address_ranks(request.address_ranks, request.address_ranks_given)
    inventory = NodeInventory(request.rank, address, items)
    return JoinCall(incarnation, request.cluster_view, owner, inventory, address_ranks)


@dataclass(frozen=True)
class StatusCall:
    """A RoundStatusRequest, checked, in our types."""

    incarnation: str
    seen: StatusKey
    address_ranks: frozenset[int] | None


def status_call(request: pb.RoundStatusRequest) -> StatusCall:
    return StatusCall(
        check_incarnation(request.incarnation_id),
        seen_key(request),
        check_address_ranks(request.address_ranks, request.address_ranks_given),
    )


@dataclass(frozen=True)
class RestoreReportCall:
    """A ReportRestoreRequest, checked, in our types."""

    incarnation: str
    failed: list[SourceKey]
    """The request's failures, in their order."""
    address_ranks: frozenset[int] | None


def restore_report_call(
    request: pb.ReportRestoreRequest, job: str, config_of: Callable[[], JobConfig]
) -> RestoreReportCall:
    """Check a restore report to ``job`` (its name checked already). ``config_of()`` is the
    job's config as its coordinator has it (it raises for a rank out of range): the bound
    on the failures a report may list."""
    incarnation = check_incarnation(request.incarnation_id)
    config = config_of()
    failed = source_keys(request.failures, job, request.rank, config.nodes, join_item_limit(config))
    address_ranks = check_address_ranks(request.address_ranks, request.address_ranks_given)
    return RestoreReportCall(incarnation, failed, address_ranks)


def progress_call(request: pb.ReportProgressRequest) -> tuple[str, Progress]:
    """A ReportProgressRequest, checked: the incarnation and its progress."""
    incarnation = check_incarnation(request.incarnation_id)
    progress = Progress(
        replicated_step=request.replicated_step if request.HasField("replicated_step") else None,
        uploaded_step=request.uploaded_step if request.HasField("uploaded_step") else None,
        address=check_address(request.address) if request.address else "",
        held=check_held_steps(request.held_steps) if request.reports_holdings else None,
        replicating_step=(
            request.replicating_step if request.HasField("replicating_step") else None
        ),
        address_ranks=check_address_ranks(request.address_ranks, request.address_ranks_given),
    )
    return incarnation, progress


def progress_message(identity: Identity, answer: ProgressAnswer) -> pb.ReportProgressResponse:
    """A ReportProgress answer on the wire."""
    response = pb.ReportProgressResponse(coordinator=identity_message(identity))
    if answer.restorable_step is not None:
        response.restorable_step = answer.restorable_step
    if answer.backup_step is not None:
        response.backup_step = answer.backup_step
    response.addresses.update(answer.addresses)
    response.nodes.update(answer.nodes)
    response.keep_steps.extend(sorted(answer.keep_steps))
    response.report_every_seconds = answer.report_every
    if answer.last_backup is not None:
        response.committed_backup_step = answer.last_backup.step
        response.committed_backup_at = answer.last_backup.at
    return response
