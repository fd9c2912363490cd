"""``mtc``: the operator CLI. I/O only through the commands it dispatches to.

Built-in commands are ``backups``, ``certs``, ``drop``, ``registry``, ``render``,
``status`` and ``upload``. Other
commands plug in through the ``mtc.commands`` entry-point group: each names a module with
``add_parser(subparsers)`` and ``run(args) -> int``, like the built-in ones. ``mtc demo``
comes that way from ``mtc_replicator.demo``, so that the product never imports the demo (an
import contract holds this) while ``mtc demo`` works wherever the distribution is installed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

from mtc_replicator import __version__
from mtc_replicator.tools import backups as backups_cli
from mtc_replicator.tools import certs, drop, registry_cli, render, status_cli, upload

COMMANDS_GROUP = "mtc.commands"
log = logging.getLogger(__name__)


def _plugins() -> dict[str, ModuleType]:
    """The installed plug-in commands; one whose module is absent (the image ships without
    the demo) is left out rather than breaking every other command."""
    found = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            found[ep.name] = ep.load()
        except ImportError as exc:
            log.debug("mtc %s is not available here: %s", ep.name, exc)
    return found


def _commands() -> dict[str, ModuleType]:
    commands: dict[str, ModuleType] = {
        "backups": backups_cli,
        "certs": certs,
        "drop": drop,
        "registry": registry_cli,
        "render": render,
        "status": status_cli,
        "upload": upload,
    }
    commands.update(_plugins())
    return commands


def build_parser(commands: dict[str, ModuleType] | None = None) -> argparse.ArgumentParser:
    """The whole ``mtc`` parser, every command registered (tests walk it)."""
    p = argparse.ArgumentParser(
        prog="mtc", description="Operate the multi-tier checkpoint replicator."
    )
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    commands = _commands() if commands is None else commands
    for name in sorted(commands):
        commands[name].add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    commands = _commands()
    p = build_parser(commands)
    a = p.parse_args(argv)
    command = commands.get(a.command)
    if command is None:
        p.error(f"unknown command {a.command}")
    result: int = command.run(a)
    return result


if __name__ == "__main__":
    sys.exit(main())
