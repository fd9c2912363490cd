"""Every ``mtc`` subcommand's help is plain, complete and runnable; every bad value of a typed
option is a usage error that names the option and says what was expected."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core import argtypes
from mtc_replicator.tools import cli

FREE = (None, str, Path, argtypes.path)
"""Types that take any value (a path is checked only against the OS's length limits)."""

MARKUP = re.compile(r"``|:\w+:`|`[^`]+`_")
"""reST that leaks from docstrings: ``literal``, :role:`x`, `link`_."""


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _all() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return list(_parsers(cli.build_parser()))


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield action


def _name(path: tuple[str, ...], action: argparse.Action) -> str:
    return " ".join(
        ("mtc", *path, action.option_strings[0] if action.option_strings else action.dest)
    )


def test_every_command_is_walked() -> None:
    paths = {" ".join(p) for p, _ in _all()}
    expected = {"backups list", "backups verify", "backups download", "status", "certs init"}
    assert expected <= paths


def test_every_option_has_plain_help_and_shows_its_default() -> None:
    problems = []
    for path, parser in _all():
        for text in (parser.description or "", parser.epilog or ""):
            if MARKUP.search(text):
                problems.append(f"{' '.join(('mtc', *path))}: markup in {text!r}")
        for action in _options(parser):
            name = _name(path, action)
            text = action.help or ""
            if not text.strip() or text is argparse.SUPPRESS:
                problems.append(f"{name}: no help")
                continue
            if MARKUP.search(text):
                problems.append(f"{name}: markup in help {text!r}")
            flag = action.nargs == 0
            if (
                action.option_strings
                and not flag
                and action.default not in (None, argparse.SUPPRESS)
                and "default" not in text
            ):
                problems.append(f"{name}: default {action.default!r} not shown")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", [p for p, _ in _all()], ids=lambda p: " ".join(p) or "mtc")
def test_help_exits_0(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*path, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mtc")
    assert not MARKUP.search(out), out


def _typed() -> list[tuple[tuple[str, ...], argparse.Action]]:
    found = []
    for path, parser in _all():
        for action in _options(parser):
            if action.option_strings and action.type not in FREE and action.nargs != 0:
                found.append((path, action))
    return found


@pytest.mark.parametrize(
    ("path", "action"), _typed(), ids=lambda x: " ".join(x) if isinstance(x, tuple) else ""
)
def test_a_bad_value_is_a_clear_usage_error(
    path: tuple[str, ...], action: argparse.Action, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not argparse's "invalid _count value": the option's own words."""
    parser = dict(_all())[path]
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([action.option_strings[0], "abc!"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert action.option_strings[0] in message or (action.metavar or "") in message
    assert not re.search(r"invalid \S+ value", message), message


def test_status_escapes_what_a_peer_says() -> None:
    from mtc_replicator.tools.status_cli import _printable

    assert _printable("refused\x1b[2J\x07 ok é") == "refused\\x1b[2J\\x07 ok é"


def test_help_names_only_options_the_command_has() -> None:
    """A help text that says "--json" (or another option) belongs to a command that has it:
    ``mtc backups pin``'s once told of a ``--json`` it lacks."""
    every = {s for _, parser in _all() for a in parser._actions for s in a.option_strings}
    problems = []
    for path, parser in _all():
        have = {s for a in parser._actions for s in a.option_strings}
        for action in _options(parser):
            for named in re.findall(r"(?<![\w-])--[a-z][a-z-]*", action.help or ""):
                # Another command's option (not the daemon's, which helps may cite).
                if named in every and named not in have:
                    problems.append(f"{_name(path, action)} names {named}")
    assert not problems, problems
