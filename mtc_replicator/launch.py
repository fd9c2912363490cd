"""The console scripts' entry points: `mtc-replicator`, `mtc` and `mtc-csi`.

The package's base install is the training job's client (PyYAML only); the daemons, the CSI
plugin and the CLI need the ``daemon`` extra. Installed without it, a script would die with a
traceback from deep inside gRPC's import; this says instead which module is missing and what
to install, and exits 2. Each target is imported by name, at call time, so that importing
this module costs nothing and it sits outside the layers (it only dispatches).
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

# Our own top-level packages: a missing module among these is a broken install, not a
# missing extra, and keeps its traceback.
_OWN = frozenset({"mtc_replicator"})
EXTRA_HINT = "pip install 'mtc-replicator[daemon]'"


def missing_dependency_message(command: str, missing: str, hint: str = EXTRA_HINT) -> str:
    """The one line a script prints when its extra (``daemon``, ``controller``) is missing."""
    return (
        f"{command}: this command needs the daemon's dependencies, which are not installed "
        f"(no module named {missing!r}); the base package is the training client only. "
        f"Install them with: {hint}"
    )


def _run(command: str, target: str, hint: str = EXTRA_HINT) -> NoReturn:
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or missing.partition(".")[0] in _OWN:
            raise
        print(missing_dependency_message(command, missing, hint), file=sys.stderr)
        raise SystemExit(2) from None
    sys.exit(getattr(module, func)())


def daemon() -> NoReturn:
    """`mtc-replicator`: the per-node daemon."""
    _run("mtc-replicator", "mtc_replicator.node.daemon:main")


def cli() -> NoReturn:
    """`mtc`: the operator's CLI."""
    _run("mtc", "mtc_replicator.tools.cli:main")


def controller() -> NoReturn:
    """`mtc-controller`: the CheckpointConfiguration controller (the `controller` extra)."""
    _run(
        "mtc-controller",
        "mtc_replicator.controller.main:main",
        "pip install 'mtc-replicator[controller]'",
    )


def csi() -> NoReturn:
    """`mtc-csi`: the CSI node plugin."""
    _run("mtc-csi", "mtc_replicator.csi.plugin:main")
