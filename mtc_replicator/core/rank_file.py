"""A pod's assigned rank as the node stack hands it over: ``jax-init-info.txt`` and
``mtc-rank.json`` in CHECKPOINT_DIR (docs/protocol.md, "Assigned ranks"). Pure.

mtc-controller decides which rank each pod of a restarted job takes (``core.ranks``) and
calls ``Node/AssignRank`` on the pod's node; the daemon checks the request here and writes
both files. ``jax-init-info.txt`` is what Orbax's ``initialize_multi_tier_checkpointing``
reads (the process index, then the coordinator's ``HOST:PORT``); ``mtc-rank.json`` says
the same for everything else (``python -m mtc_replicator.client.rank`` for torchrun) and
names the pod it is for, so a file written for a previous pod is never taken.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from mtc_replicator.core.contract import JAX_INIT_INFO_FILE, MAX_NODES
from mtc_replicator.core.jobname import is_job_name

RANK_FILE = "mtc-rank.json"
"""Written by the node stack only, beside ``jax-init-info.txt``."""
RANK_FILES = (JAX_INIT_INFO_FILE, RANK_FILE)
"""The two files an assignment writes, in the order they are written: Orbax polls the first,
our tools the second, so the second appearing means both are there."""
MAX_RANK_FILE_BYTES = 4096
SOURCES = ("holdings", "index")
"""How a rank was chosen: where the job's bytes are, or the pod's own index."""

_ASSIGNMENT_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
_POD_UID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
_HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]")


class BadRankRecord(ValueError):
    """A field of an assignment is not one we write; the message says which and why."""


@dataclass(frozen=True)
class RankRecord:
    """One pod's part of an assignment: what ``mtc-rank.json`` holds."""

    job: str
    rank: int
    nodes: int
    coordinator: str
    """``HOST:PORT`` of the pod that got rank 0 (JAX's coordinator, torchrun's master)."""
    pod_uid: str
    """The pod it is for ("" outside Kubernetes: any pod)."""
    assignment: str
    """The whole assignment's id, the same on every node."""
    source: str

    def __post_init__(self) -> None:
        check_record(self)

    @property
    def coordinator_host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0]

    @property
    def coordinator_port(self) -> int:
        return int(self.coordinator.rsplit(":", 1)[1])


def check_record(r: RankRecord) -> None:
    """Every field bounded and of its form; ``BadRankRecord`` naming the first that is not."""
    if not isinstance(r.job, str) or not is_job_name(r.job):
        raise BadRankRecord(f"not a job name: {r.job!r:.80}")
    for name, value in (("rank", r.rank), ("nodes", r.nodes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRankRecord(f"{name} must be an integer, got {value!r:.40}")
    if not 1 <= r.nodes <= MAX_NODES:
        raise BadRankRecord(f"nodes must be 1..{MAX_NODES}, got {r.nodes}")
    if not 0 <= r.rank < r.nodes:
        raise BadRankRecord(f"rank {r.rank} is not one of {r.nodes} nodes' (0..{r.nodes - 1})")
    if not isinstance(r.coordinator, str) or not is_host_port(r.coordinator):
        raise BadRankRecord(f"the coordinator must be HOST:PORT, got {r.coordinator!r:.80}")
    if not isinstance(r.pod_uid, str) or (r.pod_uid and not _POD_UID_RE.fullmatch(r.pod_uid)):
        raise BadRankRecord(f"not a pod uid: {r.pod_uid!r:.80}")
    if not isinstance(r.assignment, str) or not _ASSIGNMENT_RE.fullmatch(r.assignment):
        raise BadRankRecord(
            f"the assignment id must be 1-64 letters, digits or '-', got {r.assignment!r:.80}"
        )
    if r.source not in SOURCES:
        raise BadRankRecord(f"the source must be one of {', '.join(SOURCES)}, got {r.source!r:.40}")


def is_host_port(text: str) -> bool:
    """``HOST:PORT``: a DNS name, IPv4 address or bracketed IPv6 address, and a port 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or len(text) > 300 or not (port.isascii() and port.isdigit()) or len(port) > 5:
        return False
    return 1 <= int(port) <= 65535 and _HOST_RE.fullmatch(host) is not None


def jax_init_info(record: RankRecord) -> bytes:
    """``jax-init-info.txt``: exactly the two lines Orbax reads."""
    return f"{record.rank}\n{record.coordinator}\n".encode()


def rank_file_bytes(record: RankRecord) -> bytes:
    """``mtc-rank.json``."""
    return (json.dumps(asdict(record), indent=2) + "\n").encode()


def parse_rank_file(raw: bytes) -> RankRecord:
    """``mtc-rank.json``'s record; ``BadRankRecord`` when it is not one we wrote."""
    if len(raw) > MAX_RANK_FILE_BYTES:
        raise BadRankRecord(f"larger than {MAX_RANK_FILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise BadRankRecord(f"not JSON: {exc}") from None
    keys = ("job", "rank", "nodes", "coordinator", "pod_uid", "assignment", "source")
    if not isinstance(data, dict) or set(data) != set(keys):
        raise BadRankRecord(f"not a rank record (keys must be {', '.join(keys)})")
    return RankRecord(**{k: data[k] for k in keys})
