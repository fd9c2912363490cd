"""The job-name rule: the one check for every place a job name arrives. Pure.

A job name becomes a path segment everywhere: a directory of the store and of the views in
CHECKPOINT_DIR, the first segment of every backup key, a registry and a pin key, the start of
marker and ``.save`` names. So it is one segment that cannot climb (no ``/``, no ``..``), it
starts with a letter or digit (never ``.``, never hidden, never ``_registry`` or ``_control``),
and it is short enough for a marker name built from it to fit in a file name (255 bytes).
docs/protocol.md states the rule for users; every check of a name goes through here, so a
site cannot keep half of it.
"""

from __future__ import annotations

import re
from typing import TypeGuard

MAX_JOB_NAME_LEN = 127
"""Characters; with ``-s<step>-n<rank>-w<worker>.restore`` a marker name stays a file name."""
JOB_NAME_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_JOB_NAME_LEN - 1}}}"
"""The characters of a name, without its "no ``..``" half: to build patterns of names that
contain a job name (markers), never to check a name alone."""
JOB_NAME_RULE = f"must match {JOB_NAME_PATTERN} (no '/', no '..')"
"""The rule as errors tell it."""
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)


class BadJobName(ValueError):
    """A job name breaks the rule; the message quotes it (cut short) and says the rule."""

    def __init__(self, name: object) -> None:
        super().__init__(f"not a job name: {name!r:.80}: it {JOB_NAME_RULE}")
        self.name = name


def is_job_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a job name (anything not a ``str`` is not)."""
    return isinstance(name, str) and _JOB_NAME_RE.fullmatch(name) is not None and ".." not in name


def check_job_name(name: object) -> str:
    """``name`` when it is a job name; ``BadJobName`` otherwise."""
    if not is_job_name(name):
        raise BadJobName(name)
    return name
