"""``node.handshake_file``: ``replicator.yaml`` read only as a regular file, its reads
recorded, and removed only while it still holds the text judged."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.core.contract import CONFIG_FILE
from mtc_replicator.local.fsutil import NotRegularFile
from mtc_replicator.node.handshake_file import HandshakeFile


def test_a_missing_file_or_a_directory_reads_as_none(tmp_path: Path) -> None:
    handshake = HandshakeFile(tmp_path)
    assert handshake.read() is None
    (tmp_path / CONFIG_FILE).mkdir()
    assert handshake.read() is None


def test_a_symlink_is_never_followed_and_is_removed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("job_name: not-yours\n")
    (tmp_path / CONFIG_FILE).symlink_to(secret)
    handshake = HandshakeFile(tmp_path)
    handshake.event(finished=True, renamed=True)
    with pytest.raises(NotRegularFile) as raised:
        handshake.read()
    assert raised.value.kind == "a symlink"
    handshake.remove_not_regular()
    assert not (tmp_path / CONFIG_FILE).is_symlink()
    assert secret.read_text() == "job_name: not-yours\n"
    assert (handshake.finished, handshake.renamed, handshake.reads) == (False, False, None)


def test_reads_are_recorded_until_the_file_goes(tmp_path: Path) -> None:
    handshake = HandshakeFile(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("a")
    first = handshake.observe(handshake.read(), 1.0)
    assert first is not None
    assert (first.first_seen, first.changed_at) == (1.0, 1.0)
    (tmp_path / CONFIG_FILE).write_text("ab")
    again = handshake.observe(handshake.read(), 2.0)
    assert again is not None
    assert (again.text, again.first_seen, again.changed_at) == ("ab", 1.0, 2.0)
    (tmp_path / CONFIG_FILE).unlink()
    assert handshake.observe(handshake.read(), 3.0) is None


def test_only_the_text_judged_is_deleted(tmp_path: Path) -> None:
    path = tmp_path / CONFIG_FILE
    handshake = HandshakeFile(tmp_path)
    path.write_text("newer")
    handshake.event(finished=True, renamed=False)
    handshake.observe("older", 1.0)
    handshake.delete("older")  # a newer handshake was written meanwhile: it stays
    assert path.read_text() == "newer"
    assert handshake.reads is None
    assert handshake.finished  # its close was seen, and stands for the newer text
    handshake.delete("newer")
    assert not path.exists()
    assert (handshake.finished, handshake.renamed) == (False, False)


def test_a_yaml_left_from_before_a_restart_counts_as_finished(tmp_path: Path) -> None:
    handshake = HandshakeFile(tmp_path)
    handshake.trust_existing()
    assert not handshake.finished
    (tmp_path / CONFIG_FILE).write_text("job_name: a\n")
    handshake.trust_existing()
    assert handshake.finished
