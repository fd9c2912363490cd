"""Tests for ``mtc_replicator.core.contract``: the ``replicator.yaml`` handshake and the file names.

Pure and fast: no files, no sockets. The texts below are what real clients write (see
docs/protocol.md); a test that changes one of them must say which client
changed.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mtc_replicator.core import contract
from mtc_replicator.core.contract import (
    DEFAULT_PEERS_PER_NODE,
    NO_FRAMEWORK_ASSUMED,
    NO_PEERS_ASSUMED,
    BackupInterval,
    ConfigError,
    ContinueFrom,
    Framework,
    IncompleteConfigError,
    JobConfig,
    ascii_digits,
    expand_vars,
    marker_name,
    parse_config,
    parse_marker_name,
    parse_save_name,
    parse_step_dir,
    render_config,
    save_file_name,
)
from mtc_replicator.core.jobname import JOB_NAME_PATTERN, is_job_name

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- What clients write, byte for byte ---------------------------------------------------------

# Orbax / MaxText: lines stripped and joined with "\n", no trailing newline, peer-ranks is the
# repr of a Python list.
ORBAX_MINUTES = (
    "job-name: run1\n"
    "framework: orbax\n"
    "assume-data-parallelism: 2\n"
    "node-rank: 1\n"
    "nodes: 4\n"
    "peer-ranks: [3]\n"
    "backup-interval-minutes: 30"
)
ORBAX_STEPS = ORBAX_MINUTES.replace("backup-interval-minutes: 30", "backup-interval-steps: 100")
ORBAX_NO_PEERS = (
    "job-name: run1\n"
    "framework: orbax\n"
    "assume-data-parallelism: 1\n"
    "node-rank: 0\n"
    "nodes: 2\n"
    "peer-ranks: []\n"
    "backup-interval-minutes: 10"
)
# Older MaxText adds workers-per-node.
MAXTEXT_OLD = (
    "job-name: maxtext-llama\n"
    "framework: orbax\n"
    "assume-data-parallelism: 4\n"
    "node-rank: 5\n"
    "nodes: 8\n"
    "workers-per-node: 1\n"
    "peer-ranks: [1, 3, 7]\n"
    "backup-interval-minutes: 5"
)
# PyTorch reference client: block lists, peers-per-node, workers-per-node, written directly.
PYTORCH_REQUIRED_FIRST = (
    "job-name: llama-70b\n"
    "framework: pytorch\n"
    "node-rank: 1\n"
    "nodes: 4\n"
    "peer-ranks:\n"
    "- 2\n"
    "- 3\n"
    "peers-per-node: 2\n"
    "workers-per-node: 8\n"
    "backup-interval-minutes: 30\n"
)
PYTORCH_REQUIRED_LAST = (
    "peer-ranks:\n"
    "- 0\n"
    "- 2\n"
    "peers-per-node: 2\n"
    "workers-per-node: 8\n"
    "backup-interval-steps: 50\n"
    "framework: pytorch.distributed\n"
    "job-name: nemo-gpt\n"
    "node-rank: 3\n"
    "nodes: 4\n"
)

BASE = {"job-name": "run1", "framework": "orbax", "node-rank": "1", "nodes": "4"}


def doc(**overrides: str | None) -> str:
    """A replicator.yaml text: BASE with ``key_name=value`` overrides (None drops the key)."""
    fields: dict[str, str | None] = dict(BASE)
    fields.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return "\n".join(f"{k}: {v}" for k, v in fields.items() if v is not None)


def check_invariants(cfg: JobConfig) -> None:
    """What every accepted config guarantees to the rest of the daemon."""
    assert isinstance(cfg.job_name, str)
    assert re.fullmatch(JOB_NAME_PATTERN, cfg.job_name)
    assert ".." not in cfg.job_name
    assert is_job_name(cfg.job_name)
    assert isinstance(cfg.framework, Framework)
    assert cfg.nodes >= 1
    assert 0 <= cfg.node_rank < cfg.nodes
    assert all(0 <= p < cfg.nodes for p in cfg.peer_ranks)
    assert cfg.node_rank not in cfg.peer_ranks
    assert len(set(cfg.peer_ranks)) == len(cfg.peer_ranks)
    assert cfg.peers_per_node >= 0
    if not cfg.peer_ranks:
        assert cfg.peers_per_node <= cfg.nodes - 1
    if cfg.data_parallelism is not None:
        assert cfg.data_parallelism >= 1
        assert cfg.nodes % cfg.data_parallelism == 0
    assert cfg.workers_per_node >= 1
    minutes, steps = cfg.backup_interval.minutes, cfg.backup_interval.steps
    assert (minutes is None) != (steps is None)
    assert (minutes or steps or 0) > 0
    for n in (
        cfg.nodes,
        cfg.node_rank,
        cfg.peers_per_node,
        cfg.workers_per_node,
        *cfg.peer_ranks,
    ):
        assert type(n) is int


def parse_or_error(text: str, env: dict[str, str] | None = None) -> JobConfig | ConfigError:
    """parse_config's result or its ConfigError; any other exception fails the test."""
    try:
        cfg = parse_config(text, env)
    except ConfigError as exc:
        err = exc
    else:
        check_invariants(cfg)
        return cfg
    # The message is what ends up in replicator.failed: one short line naming the key.
    assert err.key in str(err)
    assert err.rule in str(err)
    assert len(str(err)) < 1000
    return err


# --- Dialects ----------------------------------------------------------------------------------


def test_orbax_minutes_text_without_trailing_newline() -> None:
    assert not ORBAX_MINUTES.endswith("\n")
    assert parse_config(ORBAX_MINUTES) == JobConfig(
        job_name="run1",
        framework=Framework.ORBAX,
        node_rank=1,
        nodes=4,
        peer_ranks=(3,),
        peers_per_node=1,
        data_parallelism=2,
        workers_per_node=1,
        backup_interval=BackupInterval(minutes=30, steps=None),
        unknown_keys=(),
    )


def test_orbax_steps_variant() -> None:
    cfg = parse_config(ORBAX_STEPS)
    assert cfg.backup_interval == BackupInterval(minutes=None, steps=100)
    assert cfg.backup_interval.minutes is None
    assert cfg.peer_ranks == (3,)


def test_orbax_empty_peer_list() -> None:
    cfg = parse_config(ORBAX_NO_PEERS)
    assert cfg.peer_ranks == ()
    assert cfg.peers_per_node == 0
    assert cfg.data_parallelism == 1
    assert cfg.nodes == 2
    assert cfg.backup_interval.minutes == 10


def test_old_maxtext_with_workers_per_node() -> None:
    cfg = parse_config(MAXTEXT_OLD)
    assert cfg.peer_ranks == (1, 3, 7)
    assert cfg.peers_per_node == 3
    assert cfg.workers_per_node == 1
    assert cfg.backup_interval.minutes == 5


def test_orbax_peers_are_the_data_parallel_equivalents() -> None:
    for text in (ORBAX_MINUTES, MAXTEXT_OLD):
        cfg = parse_config(text)
        assert set(cfg.equivalent_ranks(cfg.node_rank)) == set(cfg.peer_ranks)


def test_pytorch_reference_block_lists() -> None:
    cfg = parse_config(PYTORCH_REQUIRED_FIRST)
    assert cfg.framework is Framework.PYTORCH
    assert cfg.framework.item_is_file
    assert cfg.job_name == "llama-70b"
    assert (cfg.node_rank, cfg.nodes) == (1, 4)
    assert cfg.peer_ranks == (2, 3)
    assert cfg.peers_per_node == 2
    assert cfg.workers_per_node == 8
    assert cfg.data_parallelism is None
    assert cfg.backup_interval == BackupInterval(minutes=30)


def test_pytorch_distributed_and_key_order_does_not_matter() -> None:
    cfg = parse_config(PYTORCH_REQUIRED_LAST)
    assert cfg.framework is Framework.PYTORCH_DISTRIBUTED
    assert not cfg.framework.item_is_file
    assert cfg.job_name == "nemo-gpt"
    assert cfg.peer_ranks == (0, 2)
    assert cfg.backup_interval == BackupInterval(steps=50)


@pytest.mark.parametrize(
    ("framework", "expected"),
    [
        ("orbax", Framework.ORBAX),
        ("pytorch", Framework.PYTORCH),
        ("pytorch.distributed", Framework.PYTORCH_DISTRIBUTED),
        ("'pytorch.distributed'", Framework.PYTORCH_DISTRIBUTED),
    ],
)
def test_frameworks(framework: str, expected: Framework) -> None:
    assert parse_config(doc(framework=framework)).framework is expected


def test_only_pytorch_hands_over_files() -> None:
    assert [f for f in Framework if f.item_is_file] == [Framework.PYTORCH]


@pytest.mark.parametrize(
    "text",
    [
        doc(nodes='"4"', node_rank="'1'", peer_ranks='["3"]', workers_per_node='"2"'),
        doc(nodes="+4", node_rank="01", peer_ranks="'3'", workers_per_node="2"),
        doc(peer_ranks='"3"', workers_per_node="2"),
        doc(peer_ranks="[ 3 ]", workers_per_node="'2'"),
    ],
)
def test_ints_written_as_strings(text: str) -> None:
    cfg = parse_config(text)
    assert (cfg.node_rank, cfg.nodes, cfg.peer_ranks, cfg.workers_per_node) == (1, 4, (3,), 2)


def test_leading_zero_is_decimal_not_yaml_octal() -> None:
    # YAML 1.1 reads 010 as 8; no client means that.
    assert parse_config(doc(nodes="010", node_rank="9")).nodes == 10


def test_flow_and_block_lists_are_the_same() -> None:
    flow = parse_config(doc(nodes="8", peer_ranks="[2, 5, 7]"))
    block = parse_config(doc(nodes="8", peer_ranks="\n- 2\n- 5\n- 7"))
    indented = parse_config(doc(nodes="8", peer_ranks="\n  - 2\n  - 5\n  - 7"))
    assert flow == block == indented
    assert flow.peer_ranks == (2, 5, 7)


def test_peer_ranks_as_a_comma_separated_string() -> None:
    assert parse_config(doc(nodes="8", peer_ranks="'2, 5,7'")).peer_ranks == (2, 5, 7)
    assert parse_config(doc(nodes="8", peer_ranks="5")).peer_ranks == (5,)


@pytest.mark.parametrize("empty", ["[]", "", "~", "null", "''"])
def test_empty_peer_ranks(empty: str) -> None:
    cfg = parse_config(doc(peer_ranks=empty, peers_per_node="2"))
    assert cfg.peer_ranks == ()
    assert cfg.peers_per_node == 2


def test_crlf_line_endings_and_comments() -> None:
    text = ORBAX_MINUTES.replace("\n", "\r\n") + "  # written by hand\r\n"
    assert parse_config(text) == parse_config(ORBAX_MINUTES)


@pytest.mark.parametrize(
    "name",
    # Names that YAML 1.1 would type as int, octal, float, bool, date or null-ish strings.
    ["0123", "123", "1_000", "0x1F", "1e3", "1.5", "yes", "on", "No", "OFF", "2024-01-01", "y"],
)
def test_job_name_is_taken_as_written(name: str) -> None:
    # The daemon builds marker names from job-name; if it typed `0123` as 83 the client
    # would never find its `0123-s...restore` marker.
    cfg = parse_config(doc(job_name=name))
    assert cfg.job_name == name
    assert marker_name(cfg.job_name, 7, 1, 0) == f"{name}-s7-n1-w0.restore"


def test_job_name_quoted_or_tagged_as_str() -> None:
    assert parse_config(doc(job_name="'0123'")).job_name == "0123"
    assert parse_config(doc(job_name='"run1"')).job_name == "run1"
    assert parse_config(doc(job_name="!!str 0123")).job_name == "0123"


def test_env_expansion_in_values() -> None:
    env = {"JOB": "train", "NODES": "16", "RANK": "3", "P1": "1", "PEERS": "5, 7", "W": "4"}
    cfg = parse_config(
        "job-name: ${JOB}-v2\n"
        "framework: pytorch\n"
        "node-rank: $RANK\n"
        'nodes: "${NODES}"\n'
        "peer-ranks: [$P1, '${P1}0']\n"
        "workers-per-node: $W\n",
        env,
    )
    assert cfg.job_name == "train-v2"
    assert (cfg.node_rank, cfg.nodes) == (3, 16)
    assert cfg.peer_ranks == (1, 10)
    assert cfg.workers_per_node == 4
    listed = parse_config(doc(nodes="$NODES", peer_ranks="$PEERS"), env)
    assert listed.peer_ranks == (5, 7)


def test_env_value_that_looks_like_yaml_is_not_reparsed() -> None:
    cfg = parse_config(doc(job_name="$J"), {"J": "0123"})
    assert cfg.job_name == "0123"


def test_unknown_variable_is_left_as_written_and_then_validated() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc(nodes="${NODES}"), {"OTHER": "1"})
    assert info.value.key == "nodes"
    assert info.value.value == "${NODES}"
    assert not isinstance(info.value, IncompleteConfigError)
    with pytest.raises(ConfigError) as info:
        parse_config(doc(job_name="$JOB"))
    assert info.value.key == "job-name"
    assert info.value.value == "$JOB"


def test_env_defaults_to_empty_not_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTC_TEST_NODES", "4")
    with pytest.raises(ConfigError) as info:
        parse_config(doc(nodes="$MTC_TEST_NODES"))
    assert info.value.value == "$MTC_TEST_NODES"


def test_unknown_keys_are_ignored_and_listed_sorted() -> None:
    cfg = parse_config(doc(zeta="1", alpha="[x, {y: z}]", Nodes="12", node_rank="1"))
    assert cfg.unknown_keys == ("Nodes", "alpha", "zeta")
    assert cfg.nodes == 4
    assert parse_config(ORBAX_MINUTES).unknown_keys == ()


def test_unknown_key_with_an_odd_value_does_not_fail_the_file() -> None:
    cfg = parse_config(doc(future_option="2024-01-01T00:00:00Z", other="!!str x"))
    assert cfg.unknown_keys == ("future-option", "other")


# --- Validation: one ConfigError per rule of the docs/protocol.md table --------------------------

LONG_NAME = "a" * 128

INVALID = [
    # (text, key, value, text of the rule that must appear in the message)
    (doc(job_name="a/b"), "job-name", "a/b", "no '/'"),
    (doc(job_name="a..b"), "job-name", "a..b", "no '..'"),
    (doc(job_name=".."), "job-name", "..", "no '..'"),
    (doc(job_name=".hidden"), "job-name", ".hidden", "must match"),
    (doc(job_name="-x"), "job-name", "-x", "must match"),
    (doc(job_name="a b"), "job-name", "a b", "must match"),
    (doc(job_name="naïve"), "job-name", "naïve", "must match"),
    (doc(job_name=LONG_NAME), "job-name", LONG_NAME, "must match"),
    (doc(job_name='""'), "job-name", "", "must match"),
    (doc(job_name="[a]"), "job-name", ["a"], "must be a string"),
    (doc(job_name="{a: b}"), "job-name", {"a": "b"}, "must be a string"),
    (doc(framework="jax"), "framework", "jax", "must be one of: orbax, pytorch"),
    (doc(framework="Orbax"), "framework", "Orbax", "must be one of"),
    (doc(framework="[orbax]"), "framework", ["orbax"], "must be one of"),
    (doc(node_rank="4"), "node-rank", 4, "0 <= node-rank < nodes (4)"),
    (doc(node_rank="-1"), "node-rank", -1, "0 <= node-rank < nodes"),
    (doc(nodes="0", node_rank="0"), "nodes", 0, ">= 1"),
    (doc(nodes="-2", node_rank="0"), "nodes", -2, ">= 1"),
    (doc(peer_ranks="[4]"), "peer-ranks", [4], "in [0, 4)"),
    (doc(peer_ranks="[-1]"), "peer-ranks", [-1], "in [0, 4)"),
    (doc(peer_ranks="[0, 1]"), "peer-ranks", [0, 1], "must not contain this node's rank 1"),
    (doc(peer_ranks="\n- 2\n- 2"), "peer-ranks", [2, 2], "unique"),
    (doc(peer_ranks="{2: 3}"), "peer-ranks", {"2": "3"}, "must be a list"),
    (doc(peer_ranks="[[2]]"), "peer-ranks", ["2"], "must be an integer"),
    (doc(peer_ranks="two"), "peer-ranks", "two", "must be an integer"),
    (doc(peers_per_node="-1"), "peers-per-node", -1, ">= 0"),
    (doc(peers_per_node="4"), "peers-per-node", 4, "<= nodes - 1 (3)"),
    (doc(peers_per_node="1", nodes="1", node_rank="0"), "peers-per-node", 1, "<= nodes - 1 (0)"),
    (doc(assume_data_parallelism="3"), "assume-data-parallelism", 3, "divide nodes (4)"),
    (doc(assume_data_parallelism="8"), "assume-data-parallelism", 8, "divide nodes"),
    (doc(assume_data_parallelism="0"), "assume-data-parallelism", 0, ">= 1"),
    (doc(assume_data_parallelism="-2"), "assume-data-parallelism", -2, ">= 1"),
    (doc(workers_per_node="0"), "workers-per-node", 0, ">= 1"),
    (doc(workers_per_node="-3"), "workers-per-node", -3, ">= 1"),
    (
        doc(backup_interval_minutes="30", backup_interval_steps="100"),
        "backup-interval-steps",
        100,
        "at most one of backup-interval-minutes and backup-interval-steps",
    ),
    (doc(backup_interval_minutes="0"), "backup-interval-minutes", 0, "> 0"),
    (doc(backup_interval_minutes="-5"), "backup-interval-minutes", -5, "> 0"),
    (doc(backup_interval_steps="0"), "backup-interval-steps", 0, "> 0"),
    (doc(backup_interval_steps="-1"), "backup-interval-steps", -1, "> 0"),
    # bool is not an int, in any spelling.
    (doc(nodes="true"), "nodes", "true", "must be an integer"),
    (doc(node_rank="false"), "node-rank", "false", "must be an integer"),
    (doc(workers_per_node="yes"), "workers-per-node", "yes", "must be an integer"),
    (doc(peer_ranks="[true]"), "peer-ranks", "true", "must be an integer"),
    # Floats, even whole ones, and other YAML 1.1 number spellings.
    (doc(nodes="4.0"), "nodes", "4.0", "must be an integer"),
    (doc(node_rank="1.5"), "node-rank", "1.5", "must be an integer"),
    (doc(nodes="1e3"), "nodes", "1e3", "must be an integer"),
    (doc(nodes=".inf"), "nodes", ".inf", "must be an integer"),
    (doc(backup_interval_minutes="0.5"), "backup-interval-minutes", "0.5", "must be an integer"),
    (doc(peer_ranks="[2.0]"), "peer-ranks", "2.0", "must be an integer"),
    (doc(nodes="0x4"), "nodes", "0x4", "must be an integer"),
    (doc(nodes="1_0"), "nodes", "1_0", "must be an integer"),
    (doc(nodes="4 nodes"), "nodes", "4 nodes", "must be an integer"),
    (doc(nodes="[4]"), "nodes", ["4"], "must be an integer"),
    # Too large to be a count; int() itself would raise a plain ValueError past 4300 digits.
    (doc(nodes="9" * 20), "nodes", "9" * 20, "must be an integer from"),
    (doc(node_rank="9" * 5000), "node-rank", "9" * 5000, "must be an integer from"),
    (doc(workers_per_node="-" + "9" * 30), "workers-per-node", "-" + "9" * 30, "integer from"),
]


@pytest.mark.parametrize(("text", "key", "value", "rule"), INVALID)
def test_invalid_value_names_key_value_and_rule(
    text: str, key: str, value: object, rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    err = info.value
    assert not isinstance(err, IncompleteConfigError)
    assert err.key == key
    assert err.value == value
    message = str(err)
    assert repr(key) in message
    assert rule in message
    assert err.rule in message
    assert len(message) < 300


def test_error_message_quotes_the_value() -> None:
    with pytest.raises(ConfigError, match=r"'framework' = 'jax' is invalid: must be one of"):
        parse_config(doc(framework="jax"))


def test_longest_job_name_is_accepted() -> None:
    name = "A" + "z9._-" * 25 + "x"
    assert len(name) == 127
    assert parse_config(doc(job_name=name)).job_name == name


def test_single_node_job() -> None:
    cfg = parse_config(doc(nodes="1", node_rank="0", peer_ranks="[]", peers_per_node="0"))
    assert (cfg.nodes, cfg.node_rank, cfg.peers_per_node) == (1, 0, 0)


def test_upper_bounds_that_hold() -> None:
    cfg = parse_config(doc(node_rank="3", peers_per_node="3", assume_data_parallelism="4"))
    assert (cfg.node_rank, cfg.peers_per_node, cfg.data_parallelism) == (3, 3, 4)


def test_config_error_is_a_value_error_and_incomplete_is_a_config_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(IncompleteConfigError, ConfigError)


def test_error_with_an_unprintable_huge_int_still_formats() -> None:
    err = ConfigError("nodes", 10**5000, "must be small")
    assert "'nodes'" in str(err)
    assert "must be small" in str(err)
    assert len(str(err)) < 300


def test_oversized_file_is_invalid_not_incomplete() -> None:
    text = doc() + "\n" + "x: " + "y" * contract.MAX_CONFIG_BYTES
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert not isinstance(info.value, IncompleteConfigError)
    assert info.value.key == "<file>"
    assert str(contract.MAX_CONFIG_BYTES) in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        doc(peer_ranks="&p [2]", peers_per_node="*p"),
        "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\n" + doc(),
        doc(peer_ranks="&a [*a]"),
    ],
)
def test_yaml_aliases_are_refused(text: str) -> None:
    # Aliases let a few hundred bytes expand exponentially (or recursively) once we walk them.
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert not isinstance(info.value, IncompleteConfigError)
    assert "alias" in str(info.value)


def test_billion_laughs_is_refused_quickly() -> None:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(ConfigError):
        parse_config("\n".join([*lines, doc(peer_ranks="*l9")]))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "{" * 5000,
        "[" * 5000 + "]" * 5000,
        "- " * 3000 + "x",
        "\n".join(" " * i + f"k{i}:" for i in range(2000)),
        doc(peer_ranks="[" * 100 + "1" + "]" * 100),
    ],
)
def test_deep_nesting_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(text)


@pytest.mark.parametrize(
    "tagged",
    [
        "!!bool maybe",
        "!!timestamp not-a-date",
        "!!int 12",
        "!!int 0x" + "f" * 5000,
        "!!float x",
        "!!binary '!!!'",
        "!!set {a, b}",
        "!!omap [a]",
        "!!python/object/apply:os.system ['true']",
        "!<tag:example.com,2000:x> 1",
        '"\\U0011ffff"',
    ],
)
def test_exotic_yaml_is_a_config_error(tagged: str) -> None:
    # PyYAML's own constructors raise KeyError/AttributeError/ValueError on some of these.
    with pytest.raises(ConfigError):
        parse_config(doc(nodes=tagged))
    with pytest.raises(ConfigError):
        parse_config(doc(extra=tagged))


# --- Incomplete: the daemon re-reads these ------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "\n\n\t \n",
        "# only a comment\n",
        "---\n",
        "job-name: [unclosed",
        "job-name: 'unclosed",
        "job-name: run1\nframework",
        "job-name: run1\n  framework: orbax\n nodes: 4",
        "a: b\n---\nc: d",
        "just a scalar",
        "42",
        "- job-name: run1\n- nodes: 4",
        "[1, 2]",
        '"job-name: run1"',
        "\ufeff",
        "\x00",
    ],
)
def test_not_a_mapping_is_incomplete(text: str) -> None:
    with pytest.raises(IncompleteConfigError) as info:
        parse_config(text)
    assert info.value.key == "<file>"
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("key", ["job-name", "node-rank", "nodes"])
def test_missing_required_key_is_incomplete(key: str) -> None:
    with pytest.raises(IncompleteConfigError) as info:
        parse_config(doc(**{key.replace("-", "_"): None}))
    assert info.value.key == key
    assert key in str(info.value)
    assert "required" in str(info.value)


@pytest.mark.parametrize("empty", ["", "~", "null"])
@pytest.mark.parametrize("key", ["job-name", "node-rank", "nodes"])
def test_required_key_without_a_value_is_incomplete(key: str, empty: str) -> None:
    # `nodes: ` is exactly what a writer leaves between the key and the value.
    with pytest.raises(IncompleteConfigError) as info:
        parse_config(doc(**{key.replace("-", "_"): empty}))
    assert info.value.key == key


# MaxText's first multi-tier release (late 2024), byte for byte: no framework, a flow list,
# no trailing newline.
MAXTEXT_FIRST = (
    "job-name: j\nnode-rank: 0\nnodes: 1\nworkers-per-node: 1\npeer-ranks: []\n"
    "backup-interval-minutes: 30"
)


@pytest.mark.parametrize("empty", [None, "", "~"])
def test_a_file_without_framework_is_orbax_with_the_assumption_said(empty: str | None) -> None:
    text = MAXTEXT_FIRST if empty is None else f"framework: {empty}\n{MAXTEXT_FIRST}"
    cfg = parse_config(text)
    assert cfg.framework is Framework.ORBAX
    assert cfg.assumed == (NO_FRAMEWORK_ASSUMED,)
    assert "framework" in NO_FRAMEWORK_ASSUMED
    assert "orbax" in NO_FRAMEWORK_ASSUMED
    assert cfg.unknown_keys == ()
    assert (cfg.job_name, cfg.node_rank, cfg.nodes, cfg.peer_ranks) == ("j", 0, 1, ())
    assert cfg.backup_interval == BackupInterval(minutes=30, steps=None)
    # Written, it is taken as written and nothing is assumed.
    assert parse_config(f"framework: orbax\n{MAXTEXT_FIRST}").assumed == ()
    assert parse_config(doc(peers_per_node="1")).assumed == ()


def test_a_file_without_framework_is_still_validated() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(MAXTEXT_FIRST.replace("nodes: 1", "nodes: 0"))
    assert info.value.key == "nodes"
    with pytest.raises(IncompleteConfigError) as missing:
        parse_config(MAXTEXT_FIRST.replace("nodes: 1\n", ""))
    assert missing.value.key == "nodes"


def test_missing_key_wins_over_invalid_values() -> None:
    # A partial file may end in a half-written value; it must not be judged yet.
    with pytest.raises(IncompleteConfigError):
        parse_config("job-name: a/b\nframework: jax\nnode-rank: -1\n")


def required_value_starts(text: str) -> list[int]:
    """Offsets at which the value of each required key begins in ``text``."""
    starts = []
    for key in ("job-name", "node-rank", "nodes"):
        match = re.search(rf"^{re.escape(key)}: ", text, re.MULTILINE)
        assert match is not None
        starts.append(match.end())
    return starts


@pytest.mark.parametrize(
    "text", [PYTORCH_REQUIRED_FIRST, PYTORCH_REQUIRED_LAST, ORBAX_MINUTES, MAXTEXT_OLD]
)
def test_every_prefix_lacking_a_required_key_is_incomplete(text: str) -> None:
    parse_config(text)  # the whole file is valid
    last_value_start = max(required_value_starts(text))
    checked = 0
    for cut in range(len(text)):
        prefix = text[:cut]
        if cut <= last_value_start:
            # At least one required key has no value character yet.
            with pytest.raises(IncompleteConfigError):
                parse_config(prefix)
            checked += 1
        else:
            parse_or_error(prefix)
    assert checked > len(text) // 3


def test_prefix_with_all_required_keys_already_parses() -> None:
    # Once all required keys are there the protocol accepts the file; this documents it.
    cut = PYTORCH_REQUIRED_FIRST.index("peer-ranks")
    cfg = parse_config(PYTORCH_REQUIRED_FIRST[:cut])
    assert cfg.peer_ranks == ()
    assert cfg.workers_per_node == 1


# --- Defaults ----------------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = parse_config(doc())
    assert cfg.backup_interval == BackupInterval(minutes=30, steps=None)
    assert cfg.workers_per_node == 1
    assert cfg.peer_ranks == ()
    assert cfg.peers_per_node == DEFAULT_PEERS_PER_NODE == 1
    assert cfg.data_parallelism is None
    assert cfg.unknown_keys == ()
    assert cfg.assumed == (NO_PEERS_ASSUMED,)


def test_a_multi_node_job_naming_no_peers_gets_one_and_is_told() -> None:
    """The GKE contract's default (len(peer-ranks), 0) leaves a job that names neither key
    with no copy off its node; ours is one peer, said in the job's replicator.errors."""
    cfg = parse_config(doc(nodes="2", node_rank="0"))
    assert cfg.peers_per_node == 1
    assert "peers-per-node: 0" in NO_PEERS_ASSUMED
    assert cfg.assumed == (NO_PEERS_ASSUMED,)


def test_a_written_peer_key_is_taken_as_written() -> None:
    """Orbax always writes peer-ranks (often []); the reference client writes peers-per-node:
    neither gets the default, so what they wrote keeps its contract meaning."""
    for written in (doc(peer_ranks="[]"), doc(peers_per_node="0"), doc(peer_ranks="[0]")):
        cfg = parse_config(written)
        assert NO_PEERS_ASSUMED not in cfg.assumed
    assert parse_config(doc(peer_ranks="[]")).peers_per_node == 0
    assert parse_config(doc(peers_per_node="0")).peers_per_node == 0


def test_a_one_node_job_gets_no_peer_and_no_note() -> None:
    cfg = parse_config(doc(nodes="1", node_rank="0"))
    assert (cfg.peers_per_node, cfg.assumed) == (0, ())


def test_peers_per_node_defaults_to_number_of_peer_ranks() -> None:
    assert parse_config(doc(nodes="8", peer_ranks="[0, 2, 5]")).peers_per_node == 3
    explicit = parse_config(doc(nodes="8", peer_ranks="[0, 2, 5]", peers_per_node="1"))
    assert explicit.peers_per_node == 1
    assert explicit.peer_ranks == (0, 2, 5)


@pytest.mark.parametrize("empty", ["", "~", "''"])
def test_optional_keys_without_value_take_defaults(empty: str) -> None:
    cfg = parse_config(
        doc(
            peers_per_node=empty,
            workers_per_node=empty,
            assume_data_parallelism=empty,
            backup_interval_minutes=empty,
            backup_interval_steps=empty,
        )
    )
    assert cfg == parse_config(doc())


def test_backup_interval_value_object() -> None:
    assert BackupInterval() == BackupInterval(minutes=30, steps=None)
    assert BackupInterval(steps=100).minutes is None
    assert BackupInterval(steps=100).steps == 100
    assert BackupInterval(minutes=5).steps is None
    with pytest.raises(ValueError, match="exactly one"):
        BackupInterval(minutes=5, steps=100)


def test_job_config_is_frozen() -> None:
    cfg = parse_config(doc())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nodes = 5  # type: ignore[misc]


# --- Data parallelism --------------------------------------------------------------------------


def test_equivalent_ranks_with_data_parallelism() -> None:
    cfg = parse_config(doc(assume_data_parallelism="2"))
    assert cfg.nodes_per_replica == 2
    assert cfg.equivalent_ranks(0) == (2,)
    assert cfg.equivalent_ranks(1) == (3,)
    assert cfg.equivalent_ranks(2) == (0,)
    assert cfg.equivalent_ranks(3) == (1,)


def test_equivalent_ranks_every_rank_a_replica() -> None:
    cfg = parse_config(doc(assume_data_parallelism="4"))
    assert cfg.nodes_per_replica == 1
    assert cfg.equivalent_ranks(2) == (0, 1, 3)


def test_equivalent_ranks_three_replicas() -> None:
    cfg = parse_config(doc(nodes="6", assume_data_parallelism="3"))
    assert cfg.equivalent_ranks(1) == (3, 5)
    assert cfg.equivalent_ranks(4) == (0, 2)


@pytest.mark.parametrize("dp", [None, "1"])
def test_no_data_parallelism_means_no_equivalents(dp: str | None) -> None:
    cfg = parse_config(doc(assume_data_parallelism=dp))
    assert cfg.nodes_per_replica == 4
    assert all(cfg.equivalent_ranks(r) == () for r in range(4))


def test_cluster_view_is_what_ranks_must_agree_on() -> None:
    rank1 = parse_config(ORBAX_MINUTES)
    rank3 = parse_config(
        ORBAX_MINUTES.replace("node-rank: 1", "node-rank: 3").replace("[3]", "[1]")
    )
    assert rank1.cluster_view() == rank3.cluster_view()
    assert rank1.cluster_view()["nodes"] == 4
    assert rank1.cluster_view() != parse_config(ORBAX_STEPS).cluster_view()


# --- render_config -----------------------------------------------------------------------------


ROUND_TRIP = [
    JobConfig("run1", Framework.ORBAX, 0, 1),
    JobConfig(
        "llama-70b",
        Framework.PYTORCH,
        node_rank=3,
        nodes=16,
        peer_ranks=(7, 11),
        peers_per_node=2,
        workers_per_node=8,
        backup_interval=BackupInterval(steps=500),
    ),
    JobConfig(
        "gpt.v2_x",
        Framework.PYTORCH_DISTRIBUTED,
        node_rank=1,
        nodes=4,
        peers_per_node=3,
        data_parallelism=2,
        backup_interval=BackupInterval(minutes=1),
    ),
    # Names a YAML 1.1 writer must quote and our reader must keep as text.
    JobConfig("0123", Framework.ORBAX, 0, 2, peer_ranks=(1,), peers_per_node=1),
    JobConfig("yes", Framework.ORBAX, 1, 2),
    JobConfig("null", Framework.ORBAX, 1, 2),
    JobConfig("2024-01-01", Framework.ORBAX, 1, 2),
    JobConfig("1e3", Framework.ORBAX, 1, 2),
    JobConfig("9" * 127, Framework.ORBAX, 1, 2),
]


@pytest.mark.parametrize("cfg", ROUND_TRIP, ids=lambda c: c.job_name[:20])
def test_render_config_round_trips(cfg: JobConfig) -> None:
    text = render_config(cfg)
    assert parse_config(text) == cfg
    assert parse_config(text).unknown_keys == ()


def test_render_config_writes_one_interval() -> None:
    text = render_config(
        JobConfig("j", Framework.ORBAX, 0, 1, backup_interval=BackupInterval(steps=9))
    )
    assert "backup-interval-steps: 9" in text
    assert "backup-interval-minutes" not in text
    default = render_config(JobConfig("j", Framework.ORBAX, 0, 1))
    assert "backup-interval-minutes: 30" in default
    assert "assume-data-parallelism" not in default


# --- Names -------------------------------------------------------------------------------------


def test_marker_and_save_names() -> None:
    assert marker_name("run1", 1200, 3, 0) == "run1-s1200-n3-w0.restore"
    assert save_file_name("run1", 1200, 3, 7) == "run1-s1200-n3-w7.save"
    parts = contract.NameParts("run1", 1200, 3, 7)
    assert parse_marker_name("run1-s1200-n3-w7.restore") == parts
    assert parse_save_name("run1-s1200-n3-w7.save") == parts


@pytest.mark.parametrize(
    "job",
    ["a-s1-n2", "a-s1-n2-w3", "x-s9-n9-w9.restore", "job-s", "s1-n2-w3", "a--s1-n2-w3", "7"],
)
def test_names_with_marker_like_job_names(job: str) -> None:
    marker = marker_name(job, 42, 5, 2)
    save = save_file_name(job, 42, 5, 2)
    assert parse_marker_name(marker) == contract.NameParts(job, 42, 5, 2)
    assert parse_save_name(save) == contract.NameParts(job, 42, 5, 2)


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".restore",
        "run1.restore",
        "run1-s1-n2.restore",
        "run1-s1-n2-w.restore",
        "run1-s-1-n2-w0.restore",
        "run1-s1-n-2-w0.restore",
        "run1-sx-n2-w0.restore",
        "run1-s1-n2-w0.restore.tmp",
        "run1-s1-n2-w0.save",
        ".mtc-s1-n2-w0.restore",
        "-s1-n2-w0.restore",
        "a/b-s1-n2-w0.restore",
        "run1-s1-n2-w0.RESTORE",
        "run1-s1-n2-w0.restore\n",
        "run1-s\u0661-n2-w0.restore",
        "a" * 128 + "-s1-n2-w0.restore",
    ],
)
def test_not_a_marker(name: str) -> None:
    assert parse_marker_name(name) is None


@pytest.mark.parametrize(
    "name",
    ["run1-s1-n2-w0.restore", "run1-s1-n2-w0", "run1-s1-n2-w0.save.tmp", "x-s1-n2-w0.saved"],
)
def test_not_a_save_file(name: str) -> None:
    assert parse_save_name(name) is None


@pytest.mark.parametrize(("name", "step"), [("12", 12), ("0", 0), ("1200000", 1200000)])
def test_step_dir(name: str, step: int) -> None:
    assert parse_step_dir(name) == step


@pytest.mark.parametrize(
    "name",
    [
        "12.orbax-checkpoint-tmp-3",
        "12.orbax-checkpoint-tmp",
        "step=12",
        "step=12-unfinished",
        "-1",
        "+1",
        "1a",
        "",
        " 12",
        "12\n",
        "1.0",
        "1_000",
        "\u0661\u0662",
        "12.tmp",
        "run1-s12-n0-w0.restore",
    ],
)
def test_not_a_step_dir(name: str) -> None:
    assert parse_step_dir(name) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", True),
        ("1234", True),
        ("", False),
        ("²", False),
        ("\u0661\u0662", False),
        ("1²", False),
        ("-1", False),
        (" 1", False),
    ],
)
def test_ascii_digits(text: str, expected: bool) -> None:
    assert ascii_digits(text) is expected
    if expected:
        assert int(text) >= 0


# --- expand_vars -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$A", "1"),
        ("${A}", "1"),
        ("x${A}y", "x1y"),
        ("$A$B", "12"),
        ("$AB", "$AB"),
        ("${A}B", "1B"),
        ("$A-$B", "1-2"),
        ("$UNKNOWN", "$UNKNOWN"),
        ("${UNKNOWN}", "${UNKNOWN}"),
        ("${A", "${A"),
        ("$", "$"),
        ("$1", "$1"),
        ("$$A", "$1"),
        ("$C", "$A"),  # one pass: a value is not expanded again
        ("$_x", "u"),
        ("no vars", "no vars"),
    ],
)
def test_expand_vars(value: str, expected: str) -> None:
    assert expand_vars(value, {"A": "1", "B": "2", "C": "$A", "_x": "u"}) == expected


# --- Property-based ----------------------------------------------------------------------------

JOB_NAMES = st.from_regex(JOB_NAME_PATTERN, fullmatch=True).filter(lambda s: ".." not in s)


@st.composite
def valid_configs(draw: st.DrawFn) -> JobConfig:
    nodes = draw(st.integers(1, 64))
    rank = draw(st.integers(0, nodes - 1))
    others = [r for r in range(nodes) if r != rank]
    peers = draw(st.lists(st.sampled_from(others), unique=True) if others else st.just([]))
    peers_per_node = draw(st.integers(0, nodes - 1))
    divisors = [d for d in range(1, nodes + 1) if nodes % d == 0]
    dp = draw(st.none() | st.sampled_from(divisors))
    interval = draw(
        st.builds(BackupInterval, minutes=st.integers(1, 10**6))
        | st.builds(BackupInterval, steps=st.integers(1, 10**9), minutes=st.none())
    )
    return JobConfig(
        job_name=draw(JOB_NAMES),
        framework=draw(st.sampled_from(Framework)),
        node_rank=rank,
        nodes=nodes,
        peer_ranks=tuple(peers),
        peers_per_node=peers_per_node,
        data_parallelism=dp,
        workers_per_node=draw(st.integers(1, 64)),
        backup_interval=interval,
    )


@FUZZ
@given(valid_configs())
def test_property_render_then_parse_is_identity(cfg: JobConfig) -> None:
    check_invariants(cfg)
    assert parse_config(render_config(cfg)) == cfg


@FUZZ
@given(valid_configs())
def test_property_orbax_style_text_parses(cfg: JobConfig) -> None:
    assume(cfg.job_name not in {"null", "Null", "NULL"})  # plain YAML null: a missing key
    minutes, steps = cfg.backup_interval.minutes, cfg.backup_interval.steps
    interval = (
        f"backup-interval-minutes: {minutes}"
        if steps is None
        else f"backup-interval-steps: {steps}"
    )
    text = "\n".join(
        [
            f"job-name: {cfg.job_name}",
            f"framework: {cfg.framework.value}",
            *([f"assume-data-parallelism: {cfg.data_parallelism}"] if cfg.data_parallelism else []),
            f"node-rank: {cfg.node_rank}",
            f"nodes: {cfg.nodes}",
            f"workers-per-node: {cfg.workers_per_node}",
            f"peer-ranks: {list(cfg.peer_ranks)}",
            f"peers-per-node: {cfg.peers_per_node}",
            interval,
        ]
    )
    assert parse_config(text) == cfg


@FUZZ
@given(st.text())
def test_property_any_text_parses_or_raises_config_error(text: str) -> None:
    parse_or_error(text)


YAML_ALPHABET = "[]{}:-,'\"!&*#|>?%@`$~\\\n\t ._0123456789abenorstuxy"


@FUZZ
@given(st.text(alphabet=YAML_ALPHABET, max_size=200))
def test_property_yaml_punctuation_parses_or_raises_config_error(text: str) -> None:
    parse_or_error(text)


KEYS = [*BASE, *sorted(contract._KNOWN - set(BASE)), "extra", "Nodes", "<<", "?", ""]

SCALARS = st.one_of(
    st.integers(-3, 12).map(str),
    st.integers(-3, 12).map(lambda i: f'"{i}"'),
    st.integers().map(str),
    st.sampled_from(
        [
            "orbax",
            "pytorch",
            "pytorch.distributed",
            "run1",
            "0123",
            "a..b",
            "true",
            "no",
            "~",
            "null",
            "",
            "''",
            "4.0",
            ".inf",
            ".nan",
            "0x10",
            "1_0",
            "2024-01-01",
            "$N",
            "${N}",
            "$UNSET",
            "[]",
            "[1, 2]",
            "[0, 0]",
            "[$N]",
            "{}",
            "{a: 1}",
            "[" * 50,
            "[" * 5000,
            "!!bool foo",
            "!!timestamp x",
            "!!int 3",
            "&a [1]",
            "*a",
            "9" * 5000,
            "-" + "9" * 25,
            "\n- 1\n- 2",
            "\n- 0\n-",
            "\n  nested: [1, {x: [2]}]",
            "|\n  4",
            ">-\n  4",
        ]
    ),
    st.lists(st.integers(-2, 10), max_size=5).map(str),
    st.text(max_size=12),
)


@st.composite
def yamlish_documents(draw: st.DrawFn) -> str:
    """Mostly valid handshakes with some keys replaced, dropped, added, indented or cut."""
    fields: dict[str, str] = dict(BASE)
    if draw(st.booleans()):
        fields["nodes"] = draw(st.sampled_from(["4", "8", "12"]))
        fields["node-rank"] = draw(st.sampled_from(["0", "1", "3", "7"]))
    fields.update(draw(st.dictionaries(st.sampled_from(KEYS), SCALARS, max_size=4)))
    for key in draw(st.sets(st.sampled_from(KEYS), max_size=2)):
        fields.pop(key, None)
    items = draw(st.permutations(list(fields.items())))
    indents = draw(st.lists(st.sampled_from(["", "", "", " ", "  "]), min_size=len(items)))
    text = "\n".join(f"{pad}{k}: {v}" for pad, (k, v) in zip(indents, items, strict=False))
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


@FUZZ
@given(
    yamlish_documents(),
    st.dictionaries(st.sampled_from(["N", "J", "UNSET_NOT"]), st.text(max_size=8), max_size=2),
)
def test_property_yamlish_documents_parse_or_raise_config_error(
    text: str, env: dict[str, str]
) -> None:
    parse_or_error(text, env)


@FUZZ
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=30,
    ),
    st.sampled_from(KEYS[:10]),
)
def test_property_any_value_under_a_known_key(value: object, key: str) -> None:
    fields: dict[str, object] = dict(BASE)
    fields[key] = value
    parse_or_error(yaml.safe_dump(fields))


@FUZZ
@given(JOB_NAMES, st.integers(0, 10**12), st.integers(0, 10**5), st.integers(0, 10**3))
def test_property_names_round_trip(job: str, step: int, rank: int, worker: int) -> None:
    parts = contract.NameParts(job, step, rank, worker)
    assert parse_marker_name(marker_name(job, step, rank, worker)) == parts
    assert parse_save_name(save_file_name(job, step, rank, worker)) == parts
    assert parse_save_name(marker_name(job, step, rank, worker)) is None
    assert parse_marker_name(save_file_name(job, step, rank, worker)) is None
    assert parse_step_dir(str(step)) == step


@FUZZ
@given(st.text(max_size=40))
def test_property_name_parsers_never_raise(name: str) -> None:
    for parse in (parse_marker_name, parse_save_name):
        parts = parse(name)
        if parts is not None:
            assert parts.step >= 0
            assert parts.rank >= 0
            assert parts.worker >= 0
    step = parse_step_dir(name)
    assert step is None or (step >= 0 and name.isascii() and name.isdigit())


@FUZZ
@given(valid_configs(), st.integers(0, 63))
def test_property_equivalent_ranks(cfg: JobConfig, raw_rank: int) -> None:
    rank = raw_rank % cfg.nodes
    equivalents = cfg.equivalent_ranks(rank)
    replicas = cfg.data_parallelism or 1
    assert len(equivalents) == replicas - 1
    assert rank not in equivalents
    assert all(0 <= r < cfg.nodes for r in equivalents)
    assert all(r % cfg.nodes_per_replica == rank % cfg.nodes_per_replica for r in equivalents)


@pytest.mark.parametrize(
    ("key", "value"),
    [("workers-per-node", "1025"), ("nodes", str((1 << 20) + 1))],
)
def test_counts_have_a_sane_upper_bound(key: str, value: str) -> None:
    # One marker per worker: a hostile handshake must not make the daemon create millions.
    fields = {"job-name": "j", "framework": "pytorch", "node-rank": "0", "nodes": "2", key: value}
    text = "\n".join(f"{k}: {v}" for k, v in fields.items())
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert err.value.key == key
    assert "<=" in str(err.value)


@pytest.mark.parametrize("name", ["007", "012", "00"])
def test_zero_padded_step_dirs_are_not_steps(name: str) -> None:
    # Markers spell steps without padding; "012/" and "12/" must not both claim step 12.
    assert parse_step_dir(name) is None


def test_an_error_quotes_the_value_as_written_not_as_expanded() -> None:
    """``replicator.failed`` is read by the pod: an expanded value must not reach it."""
    with pytest.raises(ConfigError) as info:
        parse_config(doc(job_name="$TOKEN"), {"TOKEN": "s3cr3t/value"})
    assert info.value.key == "job-name"
    assert info.value.value == "$TOKEN"
    assert "s3cr3t" not in str(info.value)
    assert "after $VAR expansion" in str(info.value)


def test_an_unknown_key_is_told_to_the_job_with_the_nearest_known_key() -> None:
    cfg = parse_config(doc(peers_per_node="1") + "\nbackup-interval-minute: 5\nzzz-unrelated: 1\n")
    assert cfg.unknown_keys == ("backup-interval-minute", "zzz-unrelated")
    assert cfg.assumed == (
        "replicator.yaml key 'backup-interval-minute' is not one the replicator knows and was "
        "ignored: did you mean 'backup-interval-minutes'?",
        "replicator.yaml key 'zzz-unrelated' is not one the replicator knows and was ignored "
        "(known keys: assume-data-parallelism, backup-interval-minutes, backup-interval-steps, "
        "continue-from-job, continue-from-step, framework, job-name, node-rank, nodes, "
        "peer-ranks, peers-per-node, workers-per-node)",
    )
    assert cfg.backup_interval == parse_config(doc()).backup_interval  # still non-fatal


def test_a_job_continues_from_another_jobs_step_only_as_both_keys_say() -> None:
    """Our Ray Tune client's keys for PopulationBasedTraining's exploit (docs/protocol.md)."""
    cfg = parse_config(doc(continue_from_job="tune-b", continue_from_step="6"))
    assert cfg.continue_from == ContinueFrom("tune-b", 6)
    assert cfg.cluster_view()["continue-from-job"] == "tune-b"
    assert parse_config(render_config(cfg)).continue_from == ContinueFrom("tune-b", 6)
    assert parse_config(doc()).continue_from is None
    for job, step, key, rule in [
        ("tune-b", None, "continue-from-step", "together"),
        (None, "6", "continue-from-job", "together"),
        ("../x", "6", "continue-from-job", "job"),
        ("tune-b", "-1", "continue-from-step", ">= 0"),
        (BASE["job-name"], "1", "continue-from-job", "another job"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config(doc(continue_from_job=job, continue_from_step=step))
        assert err.value.key == key, (job, step, err.value)
        assert rule in str(err.value), (job, step, err.value)
