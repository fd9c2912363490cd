"""Parse ``/proc/self/mountinfo`` and answer "what is mounted at this path". Pure.

One line per mount (proc(5)): ``ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] -
FSTYPE SOURCE SUPER_OPTIONS``. The kernel escapes space, tab, newline and backslash in paths
as three-digit octal (``\\040``), so a path with a space still splits into the right fields.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_OCTAL = re.compile(r"\\([0-7]{3})")


class MountInfoError(ValueError):
    """A mountinfo line does not have the documented shape."""


@dataclass(frozen=True)
class MountInfo:
    """One mount as the kernel lists it."""

    mount_id: int
    parent_id: int
    device: str
    """``major:minor`` of the filesystem; a bind mount shares it with its source."""
    root: str
    """The directory of the filesystem that is mounted here (``/`` unless a bind of a subdir)."""
    mount_point: str
    options: frozenset[str]
    """Per-mount options (``ro`` lives here for a read-only bind)."""
    fs_type: str
    source: str
    super_options: tuple[str, ...]
    """Per-filesystem options (a tmpfs's ``size=``)."""

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def unescape(field: str) -> str:
    """Undo the kernel's octal escapes (``\\040`` is a space)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_line(line: str) -> MountInfo:
    fields = line.split(" ")
    try:
        separator = fields.index("-", 6)
    except ValueError:
        raise MountInfoError(f"no ' - ' separator in mountinfo line {line!r}") from None
    if len(fields) < separator + 4:
        raise MountInfoError(f"too few fields in mountinfo line {line!r}")
    try:
        mount_id, parent_id = int(fields[0]), int(fields[1])
    except ValueError:
        raise MountInfoError(f"bad mount ids in mountinfo line {line!r}") from None
    return MountInfo(
        mount_id=mount_id,
        parent_id=parent_id,
        device=fields[2],
        root=unescape(fields[3]),
        mount_point=unescape(fields[4]),
        options=frozenset(fields[5].split(",")),
        fs_type=fields[separator + 1],
        source=unescape(fields[separator + 2]),
        super_options=tuple(fields[separator + 3].split(",")),
    )


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Every mount in ``text``, in the kernel's order (a mount after its parent)."""
    return [parse_line(line) for line in text.splitlines() if line.strip()]


def mount_at(mounts: Sequence[MountInfo], path: str) -> MountInfo | None:
    """The visible mount whose mount point is ``path``, or None when it is not a mount point.

    Mounts can stack on one path; the visible one is the mount no other mount there sits on.
    """
    here = [m for m in mounts if m.mount_point == path]
    covered = {m.parent_id for m in here}
    on_top = [m for m in here if m.mount_id not in covered]
    return on_top[-1] if on_top else (here[-1] if here else None)


def mounts_below(mounts: Iterable[MountInfo], path: str) -> list[MountInfo]:
    """Mounts at ``path`` or anywhere under it, deepest first (the order to unmount them)."""
    prefix = path.rstrip("/") + "/"
    found = [m for m in mounts if m.mount_point == path or m.mount_point.startswith(prefix)]
    return sorted(found, key=lambda m: m.mount_point.count("/"), reverse=True)


def tmpfs_size(mount: MountInfo) -> int | None:
    """A tmpfs's size limit in bytes; None when the kernel shows none (its default size)."""
    for option in mount.super_options:
        if option.startswith("size="):
            value = option.removeprefix("size=")
            # The kernel prints the limit in KiB with a `k`; accept the other suffixes too.
            units = {"k": 2**10, "m": 2**20, "g": 2**30}
            if value and value[-1].lower() in units:
                return int(value[:-1]) * units[value[-1].lower()]
            return int(value)
    return None
