"""What a daemon restart must find of each job directory's incarnation: its accepted config
and how far the handshake got, one JSON file in the store per directory. I/O.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from enum import StrEnum

from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore

log = logging.getLogger(__name__)

STATE_FILE = "incarnation.json"
"""CHECKPOINT_DIR's root's."""


class IncarnationPhase(StrEnum):
    RESTORING = "restoring"
    """The workload waits for markers: a restarted daemon must (re)do the restore."""
    STEADY = "steady"
    """Markers were published: a restarted daemon resumes ingesting."""


@dataclass(frozen=True)
class SavedIncarnation:
    """What survives a daemon restart: the accepted config and how far the handshake got."""

    config_text: str
    incarnation_id: str
    phase: IncarnationPhase


def state_file(job_dir: str | None) -> str:
    """The store's record of the incarnation of CHECKPOINT_DIR's root (None), or of the job
    directory ``jobs/<job_dir>/``."""
    return STATE_FILE if job_dir is None else f"incarnation-{job_dir}.json"


def save_state(store: LocalStore, state: SavedIncarnation | None, name: str = STATE_FILE) -> None:
    path = store.root / name
    if state is None:
        path.unlink(missing_ok=True)
        return
    body = {"config": state.config_text, "id": state.incarnation_id, "phase": state.phase.value}
    fsutil.atomic_write_bytes(path, json.dumps(body).encode())


def forget_every_state(store: LocalStore) -> None:
    """Remove every directory's record (a node handoff): no incarnation of the previous
    owner's is resumed, whichever directory its next owner's pods use."""
    for path in store.root.glob("incarnation*.json"):
        if path.name == STATE_FILE or path.name.startswith("incarnation-"):
            path.unlink(missing_ok=True)


def load_state(store: LocalStore, name: str = STATE_FILE) -> SavedIncarnation | None:
    try:
        body = json.loads((store.root / name).read_bytes())
        return SavedIncarnation(
            str(body["config"]), str(body["id"]), IncarnationPhase(body["phase"])
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable %s: %s", name, exc)
        return None


def new_incarnation_id() -> str:
    """A fresh incarnation id: 16 hex digits, unique per accepted handshake."""
    return uuid.uuid4().hex[:16]
