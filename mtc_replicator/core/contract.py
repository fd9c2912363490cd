"""The workload contract: names in CHECKPOINT_DIR and the ``replicator.yaml`` handshake.

Pure: no I/O, no gRPC, no cloud SDKs, so ``mtc_replicator/client/`` imports it too. docs/protocol.md
is the specification; every rule here cites its behaviour, not a wish.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from mtc_replicator.core.jobname import JOB_NAME_PATTERN, JOB_NAME_RULE, is_job_name

# --- File names owned by one side of the contract ------------------------------------------

CONFIG_FILE = "replicator.yaml"
CONFIG_TMP_FILE = "replicator.yaml.tmp"
PRERESTORE_FILE = "replicator.prerestore"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
JOB_DIRS = "jobs"
"""CHECKPOINT_DIR's directory of job directories, ``jobs/<job>/``: a further job on the node
hands its files there, with the root's whole contract (docs/protocol.md)."""
JAX_INIT_INFO_FILE = "jax-init-info.txt"
RESULT_FILE = "replicator.result"
KEEP_FILE = "replicator.keep"
"""Steps the job asks the daemon to keep however old (our Tune client: the step of the
checkpoint Tune may hand a trial next), one per line, at most ``MAX_KEPT_STEPS``."""
MAX_KEPT_STEPS = 16
"""Our client's extension: the handshake's outcome, written by the node's local rank 0 for
the node's other processes (``client.election``); removed at the next accepted handshake."""
STORE_DIR = ".mtc"

MAX_CONFIG_BYTES = 64 * 1024
MAX_NODES = 1 << 20
MAX_WORKERS_PER_NODE = 1024
"""Far above any real host (GPUs per node); the daemon creates one marker per worker."""
"""A handshake is a few hundred bytes; anything this large is not one."""

STEP_DIR_RE = re.compile(r"0|[1-9][0-9]*")


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is a non-empty run of ASCII digits. ``str.isdigit`` alone also says
    yes to "²" or "١٢", which ``int`` then refuses: a name a pod or a bucket writer chose
    must never crash the daemon."""
    return text.isascii() and text.isdigit()


"""Plain decimal, no padding: the only spelling markers use, so one step has one name."""
_MARKER_BODY = (
    rf"(?P<job>{JOB_NAME_PATTERN})"
    r"-s(?P<step>[0-9]+)-n(?P<rank>[0-9]+)-w(?P<worker>[0-9]+)"
)
SAVE_FILE_RE = re.compile(_MARKER_BODY + r"\.save")
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
"""In the name of a step directory Orbax is still writing (``<N>.orbax-checkpoint-tmp-*``)."""
STEP_TMP_PREFIX = "step="
"""Starts the name of a step directory the PyTorch clients are still writing (``step=<N>``,
ours ``step=<N>-unfinished``), renamed to ``<N>`` when done."""
STEP_TMP_SUFFIX = "-unfinished"
"""After ``step=<N>``: the directory our client writes a step in (``client_step_tmp_name``)."""
SAVE_TMP_SUFFIX = ".tmp"
"""After a ``.save`` name: the file our client writes before renaming it into place."""
RESTORE_MARKER_RE = re.compile(_MARKER_BODY + r"\.restore")


class Framework(enum.StrEnum):
    """How the workload hands over a checkpoint."""

    ORBAX = "orbax"
    PYTORCH_DISTRIBUTED = "pytorch.distributed"
    PYTORCH = "pytorch"

    @property
    def item_is_file(self) -> bool:
        """``pytorch`` hands one ``.save`` file per worker; the others hand ``<N>/`` dirs."""
        return self is Framework.PYTORCH


@dataclass(frozen=True)
class BackupInterval:
    """When to back up: every ``minutes`` or every ``steps`` (exactly one is set)."""

    minutes: int | None = None
    """Back up every this many minutes; 30 when neither field is given."""
    steps: int | None = None
    """Back up every this many steps (newer Orbax writes this instead of minutes)."""

    def __post_init__(self) -> None:
        if self.minutes is None and self.steps is None:
            # The protocol's default, so that ``BackupInterval(steps=100)`` means what it says.
            object.__setattr__(self, "minutes", 30)
        elif self.minutes is not None and self.steps is not None:
            raise ValueError("exactly one of minutes or steps must be set")


@dataclass(frozen=True)
class ContinueFrom:
    """Another job's step this job continues from (``continue-from-job`` and
    ``continue-from-step``: our Ray Tune client's keys for PopulationBasedTraining's
    exploit; no other client writes them)."""

    job: str
    step: int


@dataclass(frozen=True)
class JobConfig:
    """One accepted ``replicator.yaml``: the job as this node sees it for one incarnation."""

    job_name: str
    """Safe name used in marker names, store paths and backup keys."""
    framework: Framework
    node_rank: int
    """This node's rank, ``0 <= node_rank < nodes``."""
    nodes: int
    peer_ranks: tuple[int, ...] = ()
    """Explicit peers (Orbax: the data-parallel equivalents); may be empty."""
    peers_per_node: int = 0
    """How many peers to choose when ``peer_ranks`` is empty (``parse_config`` makes it
    ``DEFAULT_PEERS_PER_NODE`` for a multi-node job that names neither key)."""
    data_parallelism: int | None = None
    """``D`` identical replicas of ``nodes // D`` nodes each, or None when not declared."""
    workers_per_node: int = 1
    backup_interval: BackupInterval = field(default_factory=BackupInterval)
    continue_from: ContinueFrom | None = None
    """Before its first round, each node brings the donor's step here as this job's own
    (``cluster.donor``), when it holds no step of this job as new."""
    unknown_keys: tuple[str, ...] = ()
    """Keys we ignored; the daemon logs them at warning level."""
    assumed: tuple[str, ...] = ()
    """What was not written, or was written and ignored, and was assumed, one sentence each
    (MaxText's first multi-tier release writes no ``framework``; an unknown key, with the
    nearest known one); the daemon warns in its log and ``replicator.errors``."""

    @property
    def nodes_per_replica(self) -> int:
        """Ranks per data-parallel replica; ``nodes`` when no parallelism is declared."""
        return self.nodes // (self.data_parallelism or 1)

    def equivalent_ranks(self, rank: int) -> tuple[int, ...]:
        """Ranks holding a data-parallel equivalent of ``rank``'s checkpoint (rank excluded)."""
        stride = self.nodes_per_replica
        return tuple(r for r in range(rank % stride, self.nodes, stride) if r != rank)

    def cluster_view(self) -> dict[str, Any]:
        """The keys every rank of one job must agree on."""
        return {
            "job-name": self.job_name,
            "framework": self.framework.value,
            "nodes": self.nodes,
            "assume-data-parallelism": self.data_parallelism,
            "workers-per-node": self.workers_per_node,
            "backup-interval-minutes": self.backup_interval.minutes,
            "backup-interval-steps": self.backup_interval.steps,
            "continue-from-job": None if self.continue_from is None else self.continue_from.job,
            "continue-from-step": None if self.continue_from is None else self.continue_from.step,
        }


class ConfigError(ValueError):
    """``replicator.yaml`` is invalid; the message names the key, the value and the rule."""

    def __init__(self, key: str, value: object, rule: str) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        shown = _shorten(_repr(value))
        super().__init__(f"replicator.yaml: {key!r} = {shown} is invalid: {rule}")


NO_FRAMEWORK_ASSUMED = (
    "replicator.yaml has no 'framework' key: assuming 'orbax' (MaxText's first multi-tier "
    "release writes none); write 'framework: orbax' to silence this warning"
)


DEFAULT_PEERS_PER_NODE = 1
"""Peers of a multi-node job whose handshake names neither ``peer-ranks`` nor
``peers-per-node``. The GKE contract's default is ``len(peer-ranks)``, 0 when both are absent:
no copy off the node, so a lost node restores every rank from the backup, a rollback to its
last interval. Both keys are optional in that contract, so choosing 1 changes nothing a
client relies on; every client that writes either key keeps exactly what it wrote."""

NO_PEERS_ASSUMED = (
    "replicator.yaml names neither 'peer-ranks' nor 'peers-per-node': assuming "
    f"'peers-per-node: {DEFAULT_PEERS_PER_NODE}' (each step is copied to another node, so a "
    "lost node restores from a peer, not from the backup); write 'peers-per-node: 0' to keep "
    "no peer copy, or set it to silence this note"
)


class IncompleteConfigError(ConfigError):
    """The text does not (yet) parse to a mapping with every required key.

    A writer that does not publish atomically (the PyTorch reference client) can leave the
    daemon reading a partial file, so this error means "maybe not finished": re-read it.
    """


_REQUIRED = ("job-name", "node-rank", "nodes")
_KNOWN = {
    *_REQUIRED,
    "framework",
    "peer-ranks",
    "peers-per-node",
    "assume-data-parallelism",
    "workers-per-node",
    "backup-interval-minutes",
    "backup-interval-steps",
    "continue-from-job",
    "continue-from-step",
}
_INT_RE = re.compile(r"[+-]?[0-9]+")
_INT_LIMIT = 2**63 - 1
"""Every count, rank and interval fits a signed 64-bit integer; larger is a typo or an attack."""
_INT_RANGE_RULE = f"must be an integer from -{_INT_LIMIT} to {_INT_LIMIT}"
_MAX_NESTING = 16
"""A handshake nests three deep (mapping, list, int); this is generous and keeps parsing O(n)."""
_VAR_RE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _repr(value: object) -> str:
    try:
        return repr(value)
    except ValueError:
        # int -> str refuses more than 4300 digits; an error message must never raise.
        return f"<{type(value).__name__} too large to show>"


def expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Expand ``$VAR`` and ``${VAR}`` from ``env``; unknown variables stay as written."""

    def sub(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        return env.get(name, match.group(0))

    return _VAR_RE.sub(sub, value)


class _HandshakeLoader(yaml.SafeLoader):
    """A YAML loader that keeps every scalar as the text the client wrote.

    Clients write values unquoted (``job-name: {run_name}``), and YAML 1.1 typing would turn
    the job name ``0123`` into 83, ``2024-01-01`` into a date and ``on`` into True, so the
    daemon's marker names would not match the client's. Only null is typed (an empty value
    is what a partial write leaves); we parse integers ourselves. Tags other than str, seq,
    map and null, aliases and deep nesting are refused: no client writes them, PyYAML's
    other constructors leak KeyError/AttributeError on bad input, and aliases let a 64 KiB
    file expand exponentially.
    """

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 (PyYAML's class registry)
    yaml_constructors: ClassVar[dict[str | None, Any]] = {
        tag: yaml.SafeLoader.yaml_constructors[tag]
        for tag in (
            "tag:yaml.org,2002:null",
            "tag:yaml.org,2002:str",
            "tag:yaml.org,2002:seq",
            "tag:yaml.org,2002:map",
            None,
        )
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise ConfigError("<file>", "*alias", "YAML aliases (*name) are not supported")
        self._depth += 1
        try:
            if self._depth > _MAX_NESTING:
                raise ConfigError(
                    "<file>", f"depth {self._depth}", f"nested deeper than {_MAX_NESTING} levels"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_HandshakeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)


def _yaml_problem(exc: Exception) -> str:
    """One line for ``replicator.failed``; PyYAML's own text spans lines with a caret drawing."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return ", ".join(filter(None, [exc.context, exc.problem])) + where
    return _shorten(" ".join(str(exc).split()), 160)


def _load_mapping(text: str) -> dict[str, Any]:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError("<file>", f"{len(text)} characters", f"at most {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.load(text, Loader=_HandshakeLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError:
        raise
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as exc:
        # ValueError: PyYAML's scanner calls chr() on escapes like "\U0011ffff".
        rule = f"not valid YAML: {_yaml_problem(exc)}"
        raise IncompleteConfigError("<file>", _shorten(text), rule) from None
    if data is None:
        raise IncompleteConfigError("<file>", text, "empty; expected a mapping of keys")
    if not isinstance(data, dict):
        raise IncompleteConfigError("<file>", data, "expected a YAML mapping of keys")
    missing = [k for k in _REQUIRED if k not in data or data[k] is None]
    if missing:
        raise IncompleteConfigError(missing[0], None, "required key is missing")
    return {str(k): v for k, v in data.items()}


def _expand(value: object, env: Mapping[str, str]) -> object:
    if isinstance(value, str):
        return expand_vars(value, env).strip()
    if isinstance(value, list):
        return [_expand(v, env) for v in value]
    return value


def _as_int(key: str, value: object) -> int:
    # bool is an int subclass in Python; "true" is never a rank or a count.
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and _INT_RE.fullmatch(value):
        # Checked before int(): it raises a plain ValueError past 4300 digits.
        if len(value.lstrip("+-").lstrip("0")) > len(str(_INT_LIMIT)):
            raise ConfigError(key, value, _INT_RANGE_RULE)
        number = int(value)
    else:
        raise ConfigError(key, value, "must be an integer (a number or a string of digits)")
    if abs(number) > _INT_LIMIT:
        raise ConfigError(key, value, _INT_RANGE_RULE)
    return number


def _opt_int(data: Mapping[str, object], key: str) -> int | None:
    value = data.get(key)
    return None if value is None or value == "" else _as_int(key, value)


def _int_list(key: str, value: object) -> list[int]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        # `peer-ranks: "1, 2"` or a single `3` after $VAR expansion.
        parts = [p for p in re.split(r"[\s,\[\]]+", value) if p]
        return [_as_int(key, p) for p in parts]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, list):
        raise ConfigError(key, value, "must be a list of integers, e.g. [1, 2]")
    return [_as_int(key, v) for v in value]


def parse_config(text: str, env: Mapping[str, str] | None = None) -> JobConfig:
    """Parse and validate one ``replicator.yaml``.

    ``$VAR`` and ``${VAR}`` expand from ``env``: the caller passes only the variables it
    allows (the daemon: ``--expand-vars``), never its own credentials. An error names the
    value as written, never as expanded, since ``replicator.failed`` is read by the pod.
    Raises ``IncompleteConfigError`` when the text may be a partial write and
    ``ConfigError`` for every other problem; never any other exception.
    """
    env = env if env is not None else {}
    raw = _load_mapping(text)
    data = {k: _expand(v, env) for k, v in raw.items()}
    try:
        return _validated(data)
    except ConfigError as exc:
        written = raw.get(exc.key, exc.value)
        if written != data.get(exc.key, written):
            raise ConfigError(exc.key, written, exc.rule + " (after $VAR expansion)") from None
        raise


def _validated(data: Mapping[str, Any]) -> JobConfig:

    job = data["job-name"]
    if not isinstance(job, str):
        raise ConfigError("job-name", job, "must be a string")
    if not is_job_name(job):
        raise ConfigError("job-name", job, JOB_NAME_RULE)

    framework, assumed = _framework(data)

    nodes = _as_int("nodes", data["nodes"])
    if not 1 <= nodes <= MAX_NODES:
        raise ConfigError("nodes", nodes, f"must be >= 1 and <= {MAX_NODES}")
    rank = _as_int("node-rank", data["node-rank"])
    if not 0 <= rank < nodes:
        raise ConfigError("node-rank", rank, f"must satisfy 0 <= node-rank < nodes ({nodes})")

    peers = _peer_ranks(data, nodes, rank)

    ppn = _opt_int(data, "peers-per-node")
    if ppn is None and data.get("peer-ranks") is None and nodes > 1:
        ppn = DEFAULT_PEERS_PER_NODE
        assumed.append(NO_PEERS_ASSUMED)
    elif ppn is None:
        ppn = len(peers)
    if ppn < 0:
        raise ConfigError("peers-per-node", ppn, "must be >= 0")
    if not peers and ppn > nodes - 1:
        raise ConfigError("peers-per-node", ppn, f"must be <= nodes - 1 ({nodes - 1})")

    dp = _opt_int(data, "assume-data-parallelism")
    if dp is not None and (dp < 1 or nodes % dp != 0):
        raise ConfigError("assume-data-parallelism", dp, f"must be >= 1 and divide nodes ({nodes})")

    workers = _opt_int(data, "workers-per-node")
    workers = 1 if workers is None else workers
    if not 1 <= workers <= MAX_WORKERS_PER_NODE:
        raise ConfigError(
            "workers-per-node", workers, f"must be >= 1 and <= {MAX_WORKERS_PER_NODE}"
        )

    interval = _backup_interval(data)
    continue_from = _continue_from(data, job)

    unknown = tuple(sorted(str(k) for k in data if k not in _KNOWN))
    return JobConfig(
        job_name=job,
        framework=framework,
        node_rank=rank,
        nodes=nodes,
        peer_ranks=tuple(peers),
        peers_per_node=ppn,
        data_parallelism=dp,
        workers_per_node=workers,
        backup_interval=interval,
        continue_from=continue_from,
        unknown_keys=unknown,
        assumed=(*assumed, *(unknown_key_note(k) for k in unknown)),
    )


def _framework(data: Mapping[str, Any]) -> tuple[Framework, list[str]]:
    """The framework, and what was assumed to find it."""
    assumed: list[str] = []
    fw_raw = data.get("framework")
    if fw_raw is None:
        # MaxText's first multi-tier release (late 2024) writes no framework; it saves
        # Orbax step directories, the only framework that ever omitted the key.
        fw_raw = Framework.ORBAX.value
        assumed.append(NO_FRAMEWORK_ASSUMED)
    if not isinstance(fw_raw, str) or fw_raw not in {f.value for f in Framework}:
        allowed = ", ".join(f.value for f in Framework)
        raise ConfigError("framework", fw_raw, f"must be one of: {allowed}")
    return Framework(fw_raw), assumed


def _peer_ranks(data: Mapping[str, Any], nodes: int, rank: int) -> list[int]:
    peers = _int_list("peer-ranks", data.get("peer-ranks"))
    for p in peers:
        if not 0 <= p < nodes:
            raise ConfigError("peer-ranks", peers, f"every rank must be in [0, {nodes})")
    if rank in peers:
        raise ConfigError("peer-ranks", peers, f"must not contain this node's rank {rank}")
    if len(set(peers)) != len(peers):
        raise ConfigError("peer-ranks", peers, "ranks must be unique")
    return peers


def _backup_interval(data: Mapping[str, Any]) -> BackupInterval:
    """At most one of minutes and steps, each > 0; neither: every 30 minutes."""
    minutes = _opt_int(data, "backup-interval-minutes")
    steps = _opt_int(data, "backup-interval-steps")
    if minutes is not None and steps is not None:
        raise ConfigError(
            "backup-interval-steps",
            steps,
            "give at most one of backup-interval-minutes and backup-interval-steps",
        )
    if minutes is not None and minutes <= 0:
        raise ConfigError("backup-interval-minutes", minutes, "must be > 0")
    if steps is not None and steps <= 0:
        raise ConfigError("backup-interval-steps", steps, "must be > 0")
    return BackupInterval(minutes=minutes, steps=steps)


def _continue_from(data: Mapping[str, Any], job: str) -> ContinueFrom | None:
    """Both keys or neither; another job's valid name, a step >= 0."""
    donor, step = data.get("continue-from-job"), _opt_int(data, "continue-from-step")
    if donor in (None, "") and step is None:
        return None
    if donor in (None, "") or step is None:
        missing = "continue-from-job" if step is not None else "continue-from-step"
        raise ConfigError(missing, None, "give continue-from-job and continue-from-step together")
    if not isinstance(donor, str) or not is_job_name(donor):
        raise ConfigError("continue-from-job", donor, JOB_NAME_RULE)
    if donor == job:
        raise ConfigError("continue-from-job", donor, "must name another job than job-name")
    if step < 0:
        raise ConfigError("continue-from-step", step, "must be >= 0")
    return ContinueFrom(donor, step)


def unknown_key_note(key: str) -> str:
    """What the job is told about a key the replicator ignores: a hand-written typo
    (``backup-interval-minute``) otherwise silently leaves the default in force."""
    near = difflib.get_close_matches(key, sorted(_KNOWN), n=1, cutoff=0.6)
    hint = f": did you mean {near[0]!r}?" if near else f" (known keys: {', '.join(sorted(_KNOWN))})"
    return f"{CONFIG_FILE} key {key[:80]!r} is not one the replicator knows and was ignored{hint}"


def render_config(config: JobConfig) -> str:
    """The ``replicator.yaml`` text for ``config`` (what our client writes)."""
    data: dict[str, Any] = {
        "job-name": config.job_name,
        "framework": config.framework.value,
        "node-rank": config.node_rank,
        "nodes": config.nodes,
        "peer-ranks": list(config.peer_ranks),
        "peers-per-node": config.peers_per_node,
        "workers-per-node": config.workers_per_node,
    }
    if config.data_parallelism is not None:
        data["assume-data-parallelism"] = config.data_parallelism
    if config.backup_interval.steps is not None:
        data["backup-interval-steps"] = config.backup_interval.steps
    else:
        data["backup-interval-minutes"] = config.backup_interval.minutes
    if config.continue_from is not None:
        data["continue-from-job"] = config.continue_from.job
        data["continue-from-step"] = config.continue_from.step
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


# --- Names -----------------------------------------------------------------------------------


def marker_name(job: str, step: int, rank: int, worker: int) -> str:
    """The restore marker for one worker: ``<job>-s<N>-n<rank>-w<worker>.restore``."""
    return f"{job}-s{step}-n{rank}-w{worker}.restore"


def save_file_name(job: str, step: int, rank: int, worker: int) -> str:
    """The finished checkpoint file of one worker (framework ``pytorch``)."""
    return f"{job}-s{step}-n{rank}-w{worker}.save"


@dataclass(frozen=True)
class NameParts:
    """The fields of a marker or ``.save`` name."""

    job: str
    step: int
    rank: int
    worker: int


def parse_save_name(name: str) -> NameParts | None:
    """Fields of a ``.save`` file name, or None when ``name`` is not one."""
    return _parse(SAVE_FILE_RE, name)


def parse_marker_name(name: str) -> NameParts | None:
    """Fields of a ``.restore`` marker name, or None when ``name`` is not one."""
    return _parse(RESTORE_MARKER_RE, name)


def _parse(pattern: re.Pattern[str], name: str) -> NameParts | None:
    m = pattern.fullmatch(name)
    if m is None:
        return None
    return NameParts(m["job"], int(m["step"]), int(m["rank"]), int(m["worker"]))


CLIENT_STEP_TMP_RE = re.compile(
    re.escape(STEP_TMP_PREFIX) + r"(?:0|[1-9][0-9]*)" + re.escape(STEP_TMP_SUFFIX)
)
"""The temp directory of a step our client is writing (``client_step_tmp_name``)."""


def client_step_tmp_name(step: int) -> str:
    """``step=<N>-unfinished``: where our client writes step ``step`` before its rename."""
    return f"{STEP_TMP_PREFIX}{step}{STEP_TMP_SUFFIX}"


def is_client_temp_name(name: str, *, is_dir: bool) -> bool:
    """Whether ``name`` is a temporary our client (``mtc_replicator.client``) writes a step
    under: ``step=<N>-unfinished/`` or ``<job>-s<N>-n<rank>-w<worker>.save.tmp``. Found at a
    handshake, it is what a trainer killed mid-save left: never a step, removed. The
    PyTorch reference client's ``step=<N>`` and Orbax's temps are not ours to remove."""
    if is_dir:
        return CLIENT_STEP_TMP_RE.fullmatch(name) is not None
    base = name.removesuffix(SAVE_TMP_SUFFIX)
    return base != name and parse_save_name(base) is not None


def parse_step_dir(name: str) -> int | None:
    """The step of a ``<N>`` directory name (decimal digits only), or None."""
    return int(name) if STEP_DIR_RE.fullmatch(name) else None
