"""Parsing /proc/self/mountinfo: fields, octal escapes, stacked mounts, tmpfs sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.csi.mountinfo import (
    MountInfoError,
    mount_at,
    mounts_below,
    parse_line,
    parse_mountinfo,
    tmpfs_size,
    unescape,
)

SAMPLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=24684092k
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1024k
41 22 0:39 / /var/lib/mtc/ram rw,relatime shared:20 master:3 - tmpfs mtc-ramdisk rw,size=65536k
52 22 0:39 / /var/lib/kubelet/pods/u1/ckpt/mount ro,relatime shared:20 - tmpfs mtc-ramdisk rw
53 22 0:39 /sub /mnt/with\\040space\\011tab\\134slash rw - tmpfs mtc-ramdisk rw,size=67108864k
"""


def test_parse_fields_with_optional_fields() -> None:
    mounts = parse_mountinfo(SAMPLE)
    assert len(mounts) == 6
    ram = mounts[3]
    assert ram.mount_id == 41
    assert ram.parent_id == 22
    assert ram.device == "0:39"
    assert ram.root == "/"
    assert ram.mount_point == "/var/lib/mtc/ram"
    assert ram.options == frozenset({"rw", "relatime"})
    assert ram.fs_type == "tmpfs"
    assert ram.source == "mtc-ramdisk"
    assert ram.super_options == ("rw", "size=65536k")
    assert not ram.readonly


def test_readonly_comes_from_the_per_mount_options() -> None:
    # The bind is read-only while its filesystem (super options) stays rw.
    bind = parse_mountinfo(SAMPLE)[4]
    assert bind.readonly
    assert "rw" in bind.super_options


def test_octal_escapes_in_paths() -> None:
    entry = parse_mountinfo(SAMPLE)[5]
    assert entry.mount_point == "/mnt/with space\ttab\\slash"
    assert entry.root == "/sub"
    assert unescape(r"a\040b\012c") == "a b\nc"
    assert unescape(r"no\escape\0") == r"no\escape\0"


def test_the_visible_mount_of_a_stack_is_the_one_on_top() -> None:
    mounts = parse_mountinfo(SAMPLE)
    top = mount_at(mounts, "/dev/shm")
    assert top is not None
    assert top.mount_id == 30
    # Listing order does not decide: the mount no other sits on does.
    top_reversed = mount_at(list(reversed(mounts)), "/dev/shm")
    assert top_reversed is not None
    assert top_reversed.mount_id == 30
    assert mount_at(mounts, "/dev") is None
    assert mount_at(mounts, "/var/lib/mtc") is None


def test_mounts_below_lists_deepest_first() -> None:
    mounts = parse_mountinfo(SAMPLE)
    below = [m.mount_point for m in mounts_below(mounts, "/var/lib")]
    assert below == [
        "/var/lib/kubelet/pods/u1/ckpt/mount",
        "/var/lib/mtc/ram",
    ]
    assert mounts_below(mounts, "/var/li") == []


def test_tmpfs_size() -> None:
    mounts = parse_mountinfo(SAMPLE)
    assert tmpfs_size(mounts[3]) == 64 * 2**20
    assert tmpfs_size(mounts[2]) == 2**20
    assert tmpfs_size(mounts[0]) is None
    bare = parse_line("9 1 0:9 / /x rw - tmpfs t rw,size=4096")
    assert tmpfs_size(bare) == 4096


@pytest.mark.parametrize(
    "line",
    [
        "22 1 8:1 / / rw,relatime shared:1 ext4 /dev/sda1 rw",  # no separator
        "22 1 8:1 / / rw - ext4",  # too few after the separator
        "x 1 8:1 / / rw - ext4 /dev/sda1 rw",
    ],
)
def test_malformed_lines_are_refused(line: str) -> None:
    with pytest.raises(MountInfoError):
        parse_line(line)


def test_this_machines_mountinfo_parses() -> None:
    text = Path("/proc/self/mountinfo").read_text(errors="surrogateescape")
    mounts = parse_mountinfo(text)
    assert mount_at(mounts, "/") is not None
