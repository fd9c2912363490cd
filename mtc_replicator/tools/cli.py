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
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

from mtc_replicator import __version__

COMMANDS_GROUP = "mtc.commands"
BUILT_IN = {
    "backups": "mtc_replicator.tools.backups",
    "certs": "mtc_replicator.tools.certs",
    "drop": "mtc_replicator.tools.drop",
    "registry": "mtc_replicator.tools.registry_cli",
    "render": "mtc_replicator.tools.render",
    "status": "mtc_replicator.tools.status_cli",
    "upload": "mtc_replicator.tools.upload",
}
"""Imported once ``_quiet_grpc`` imported gRPC: they import it too."""
log = logging.getLogger(__name__)


def _quiet_grpc() -> None:
    """Import gRPC with its core's own log at ERROR, unless the operator set
    ``GRPC_VERBOSITY``: the core reads it once, at import, and otherwise writes a failed TLS
    handshake to stderr as a raw line ("I1128 ... ssl_transport_security.cc ... Handshake
    failed") above the one line ``mtc status`` says. The variable is unset again, so the
    processes ``mtc`` starts (the demo's daemons) log as they would."""
    if "grpc" in sys.modules or "GRPC_VERBOSITY" in os.environ:
        return
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    try:
        importlib.import_module("grpc")
    finally:
        del os.environ["GRPC_VERBOSITY"]


# At import, as a plain import would: without the ``daemon`` extra a missing module is then
# found where ``mtc_replicator.launch`` turns it into "install the daemon extra".
_quiet_grpc()
_BUILT_IN_MODULES = {name: importlib.import_module(module) for name, module in BUILT_IN.items()}


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
    commands = dict(_BUILT_IN_MODULES)
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
