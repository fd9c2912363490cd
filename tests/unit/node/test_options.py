"""Both daemons' command lines (``node.options``, ``mtc_replicator.csi.plugin``): every flag says
what it does, and a bad value, as a flag or in its environment variable, is a usage error (exit 2, a
message), never a traceback."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.core import argtypes
from mtc_replicator.csi import plugin as csi_plugin
from mtc_replicator.node import options

# The least each parser needs to get past its required options.
DAEMON_ENV = {"MTC_CHECKPOINT_DIR": "/tmp/mtc-flags-test"}
CSI_ENV = {
    "MTC_CSI_ENDPOINT": "unix:///tmp/mtc-flags-test/csi.sock",
    "MTC_CSI_NODE_ID": "node-a",
    "MTC_RAM_DIR": "/tmp/mtc-flags-test/ram",
    "MTC_RAM_SIZE": "1Gi",
}
PARSERS: dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, str]]] = {
    "mtc-replicator": (options.make_parser, options.parse_args, DAEMON_ENV),
    "mtc-csi": (csi_plugin.make_parser, csi_plugin.parse_args, CSI_ENV),
}
MARKUP = re.compile(r"``|:[a-z]+:`")
"""Sphinx markup leaking from docstrings: ``code`` and :role:`target`."""
ENV_VAR = re.compile(r"\[([A-Z][A-Z0-9_]*)\]$")
BAD = "x!"
"""Neither a number, a duration, a rate, an address, a port nor a choice."""


def _options(make: Callable[..., argparse.ArgumentParser]) -> list[argparse.Action]:
    return [a for a in make({})._actions if a.option_strings]


def _typed(make: Callable[..., argparse.ArgumentParser]) -> list[argparse.Action]:
    """Options whose value is checked: anything but a free string or path."""
    return [
        a for a in _options(make) if a.type not in (None, str, Path, argtypes.path) and a.nargs != 0
    ]


@pytest.mark.parametrize("prog", PARSERS)
def test_every_flag_has_help_without_markup(prog: str) -> None:
    make = PARSERS[prog][0]
    parser = make({})
    assert parser.description
    assert not MARKUP.search(parser.description)
    for action in _options(make):
        name = action.option_strings[-1]
        assert action.help, f"{prog} {name} has no help"
        assert action.help.strip(), f"{prog} {name} has no help"
        assert not MARKUP.search(action.help), f"{prog} {name}: {action.help!r}"
        # Options that take a value tell where else it comes from, or what it defaults to.
        if action.nargs != 0 and name not in ("--help", "--version"):
            assert ENV_VAR.search(action.help) or "default" in action.help, name


@pytest.mark.parametrize("prog", PARSERS)
def test_a_bad_value_is_a_usage_error(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    make, parse, env = PARSERS[prog]
    typed = _typed(make)
    assert len(typed) >= 2  # at least --log-level and --log-format
    for action in typed:
        name = action.option_strings[-1]
        with pytest.raises(SystemExit) as exited:
            parse([name, BAD], env)
        assert exited.value.code == 2, name
        err = capsys.readouterr().err
        assert f"argument {name}" in err, err
        assert repr(BAD) in err, err
        # argparse's own message names the converter: "invalid _count value".
        assert not re.search(r"invalid _?\w+ value", err), err


@pytest.mark.parametrize("prog", PARSERS)
def test_a_bad_environment_variable_is_a_usage_error(
    prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make, parse, env = PARSERS[prog]
    for action in _typed(make):
        found = ENV_VAR.search(action.help or "")
        if found is None:
            continue
        with pytest.raises(SystemExit) as exited:
            parse([], {**env, found[1]: BAD})
        assert exited.value.code == 2, found[1]
        assert repr(BAD) in capsys.readouterr().err, found[1]


@pytest.mark.parametrize(
    ("prog", "flags"),
    [
        ("mtc-replicator", {"--log-level": "verbose", "--threads": "0", "--rescan-seconds": "-1"}),
        ("mtc-replicator", {"--settle-seconds": "nan", "--log-format": "xml"}),
        ("mtc-csi", {"--log-level": "verbose", "--log-format": "xml"}),
    ],
)
def test_bad_values_name_the_flag_and_the_choices(
    prog: str, flags: Mapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, parse, env = PARSERS[prog]
    for flag, value in flags.items():
        with pytest.raises(SystemExit) as exited:
            parse([flag, value], env)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: " in err, err
        assert repr(value) in err, err
        if flag == "--log-level":
            assert "debug, info, warning, error, critical" in err
        if flag == "--log-format":
            assert "text, json" in err


@pytest.mark.parametrize("module", ["mtc_replicator.node.daemon", "mtc_replicator.csi.plugin"])
def test_the_process_exits_2_without_a_traceback(module: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", module, "--log-level", "verbose"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**DAEMON_ENV, **CSI_ENV, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert "invalid log level 'verbose'" in run.stderr


def test_levels_and_formats_are_normalised() -> None:
    opts = options.parse_args(["--log-level", "debug", "--log-format", "JSON"], DAEMON_ENV)
    assert (opts.log_level, opts.log_format) == ("DEBUG", "json")
    assert options.parse_args([], {**DAEMON_ENV, "MTC_LOG_FORMAT": "json"}).log_format == "json"
    defaults = csi_plugin.parse_args([], CSI_ENV)
    assert (defaults.log_level, defaults.log_format) == ("INFO", "text")


def test_the_transfer_floor_defaults_under_the_rate_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--min-transfer-rate: 256 KiB/s, a sixteenth of a lower --max-transfer-rate, 'off';
    one at or over --max-transfer-rate would drop peers paced as this node is."""
    assert options.parse_args([], DAEMON_ENV).min_transfer_rate == 256 << 10
    limited = options.parse_args(["--max-transfer-rate", "1MiB"], DAEMON_ENV)
    assert limited.min_transfer_rate == (1 << 20) / 16
    off = options.parse_args(["--min-transfer-rate", "off"], DAEMON_ENV)
    assert off.min_transfer_rate is None
    env = {**DAEMON_ENV, "MTC_MIN_TRANSFER_RATE": "2MiB"}
    assert options.parse_args([], env).min_transfer_rate == 2 << 20
    with pytest.raises(SystemExit) as exited:
        options.parse_args(["--max-transfer-rate", "1MiB", "--min-transfer-rate", "1MiB"], env)
    assert exited.value.code == 2
    assert "--min-transfer-rate must be below --max-transfer-rate" in capsys.readouterr().err
    assert options.parse_args([], DAEMON_ENV).max_item_files == 100_000
    assert options.parse_args(["--max-item-files", "7"], DAEMON_ENV).max_item_files == 7


def test_requiring_rank_grants_needs_each_nodes_own_certificate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"]
    env = {**DAEMON_ENV, "MTC_REQUIRE_RANK_GRANT": "true"}
    assert options.parse_args(tls, env).require_rank_grant
    assert not options.parse_args(tls, DAEMON_ENV).require_rank_grant
    for argv in ([], [*tls, "--tls-shared-certificate"]):
        with pytest.raises(SystemExit) as exited:
            options.parse_args(argv, env)
        assert exited.value.code == 2
        assert "--require-rank-grant needs each node's own certificate" in capsys.readouterr().err


def test_unsafe_settings_are_named_at_start() -> None:
    """What the daemon warns of when it starts: no owner file, no TLS, unsigned records."""
    plain = options.parse_args([], DAEMON_ENV)
    warned = options.unsafe_settings(plain, tls=False, listen="0.0.0.0:7070")
    assert [w.split(":")[0] for w in warned] == [
        "no --owner-file",
        "TLS is off",
        "without TLS material, COMMITs and registry entries are neither signed nor checked",
    ]
    assert "the gRPC port 0.0.0.0:7070 " in warned[1]
    owned = options.parse_args(
        ["--owner-file", "/run/owner.json", "--accept-unsigned-records"], DAEMON_ENV
    )
    (unsigned,) = options.unsafe_settings(owned, tls=True, listen=None)
    assert unsigned.startswith("--accept-unsigned-records is on")
    strict = options.parse_args(["--owner-file", "/run/owner.json"], DAEMON_ENV)
    assert options.unsafe_settings(strict, tls=True, listen=None) == []


@pytest.mark.parametrize("make", [options.make_parser, csi_plugin.make_parser])
def test_every_daemon_option_with_a_default_shows_it_in_its_help(
    make: Callable[[Mapping[str, str]], argparse.ArgumentParser],
) -> None:
    """``mtc-replicator --help`` once showed no default for --listen or --data-port, and
    ``mtc-csi`` wrote "(default X)" beside "(default: X)"."""
    missing, styled = [], []
    for a in make({})._actions:
        text = a.help or ""
        if re.search(r"\(default [^:]", text):
            styled.append(a.option_strings[0])
        has_default = a.default not in (None, False, "", argparse.SUPPRESS)
        if a.option_strings and has_default and "(default" not in text:
            missing.append(a.option_strings[0])
    assert not missing, missing
    assert not styled, styled
