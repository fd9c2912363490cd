"""File events in CHECKPOINT_DIR and its job directories, handed to whom they concern. No
I/O.

The watch (``local.watcher``) reports top-level names; events are hints (every supervisor
rescans on its own timer), so one here only wakes: the handshake's reader for
``replicator.yaml``, the incarnation's set of ``.save`` files closed after writing, the
incarnation and the daemon's loop. Our own writes (an error line, a marker) wake nothing:
an error written at every wake-up would otherwise be a busy loop.
"""

from __future__ import annotations

import asyncio
import functools

from mtc_replicator.core.contract import CONFIG_FILE, parse_save_name
from mtc_replicator.local.watcher import OnEvent
from mtc_replicator.node.checkpoint_dir import is_own_output
from mtc_replicator.node.supervisor import Supervisor


class FileEvents:
    """Routes each directory's events to its supervisor and wakes the daemon's loop."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        """The daemon's loop waits on it between two checks of every directory."""

    def of(self, supervisor: Supervisor) -> OnEvent:
        """What the watch of ``supervisor``'s directory calls."""
        return functools.partial(self.event, supervisor)

    def event(
        self, supervisor: Supervisor, name: str | None, finished: bool, renamed: bool = False
    ) -> None:
        """``name`` in ``supervisor``'s directory was written (``finished`` False) or its
        writer is done (True; ``renamed``: by a rename into place)."""
        if name is not None and is_own_output(name):
            return
        if name == CONFIG_FILE:
            supervisor.handshake.event(finished, renamed)
        elif name and parse_save_name(name) is not None:
            # Only `.save` files need "closed after writing"; other names (our unique temp
            # files among them) would make the set grow for the daemon's whole life.
            if finished:
                supervisor.ctx.closed_files.add(name)
            else:
                supervisor.ctx.closed_files.discard(name)  # written again after its close
        self.wake.set()
        if supervisor.incarnation is not None:
            supervisor.incarnation.wake()
