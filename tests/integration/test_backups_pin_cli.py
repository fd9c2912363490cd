"""``mtc backups pin``, the name issue 25 gives the command that signs a restore pin, run as
an operator runs it: the real CLI in a subprocess, an operator certificate from ``mtc certs
operator``, a ``file://`` backup whose ``COMMIT``s a node certificate of the same CA signed.
The pin it writes is read back the way a daemon with TLS reads it (``StorePins`` with the
daemon's pin trust); ``restore``, the command's first name, still does the same.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.storage.restore_pins import StorePins, pin_key
from mtc_replicator.tools import certs
from mtc_replicator.transport.operator_signing import pin_trust
from mtc_replicator.transport.signing import record_trust
from tests.integration.test_backups_cli import mtc
from tests.tls import node_tls, operator_flags

pytestmark = pytest.mark.integration

STEPS = (10, 20)


class SignedBackup:
    """A backup of ``job`` with steps 10 and 20 committed, each COMMIT signed by a node and
    each item attested by it."""

    def __init__(self, root: Path, job: str) -> None:
        self.ca = certs.new_ca()
        node = node_tls(root / "node-tls", self.ca)
        self.tls = node.material()
        self.root = root / "backup"
        self.url = self.root.as_uri()
        self.job = job
        self.objects = FileObjectStore(self.root)
        self.node_trust = record_trust(self.tls)
        store = BackupStore(self.objects, self.node_trust)
        for step in STEPS:
            keys = []
            for rank in range(2):
                src = root / "src" / f"{step}-{rank}"
                (src / "state").mkdir(parents=True)
                (src / "state" / "weights").write_bytes(os.urandom(16 * 1024))
                # As a daemon writes it: attested by the node that produced it.
                manifest = node.attest(build_manifest(ItemId(job, step, rank, 0), src))
                store.upload_item(manifest, src)
                keys.append(manifest.item.key)
            assert store.try_commit(job, step, keys) is not None

    def daemon_reads(self) -> int | None:
        """The step a daemon with this CA's TLS would pin its next round to (None: no pin
        it honours), read as the coordinator reads it."""
        pins = StorePins(self.objects, self.node_trust, pin_trust=pin_trust(self.tls))
        return pins.pinned_step(self.job)

    def ca_flag(self) -> tuple[str, ...]:
        return ("--tls-ca", str(self.tls.files.ca))


@pytest.fixture
def backup(tmp_path: Path, job: str) -> SignedBackup:
    return SignedBackup(tmp_path, job)


def test_pin_signs_a_pin_the_daemons_honour(backup: SignedBackup, tmp_path: Path) -> None:
    operator = operator_flags(tmp_path / "alice", backup.ca)
    pin_file = backup.root / pin_key(backup.job)
    assert backup.daemon_reads() is None

    out = mtc(
        "pin",
        backup.url,
        "--job",
        backup.job,
        "--step",
        "10",
        "--yes",
        *backup.ca_flag(),
        *operator,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"job {backup.job}: the next restore round will use backup step 10" in out.stdout
    assert "(verified, signed by operator alice)" in out.stdout
    assert out.stderr == ""
    assert pin_file.is_file()
    assert json.loads(pin_file.read_bytes())["step"] == 10
    assert backup.daemon_reads() == 10, "a daemon with TLS honours the signed pin"
    listed = mtc("list", backup.url, "--job", backup.job, "--json", *backup.ca_flag())
    assert json.loads(listed.stdout)["jobs"][0]["restore_pin_signature"] == "verified"

    out = mtc("pin", backup.url, "--job", backup.job, "--clear")
    assert out.returncode == 0, out.stderr
    assert not pin_file.exists()
    assert backup.daemon_reads() is None


def test_an_expiry_is_signed_into_the_pin_and_refused_after_it(
    backup: SignedBackup, tmp_path: Path
) -> None:
    operator = operator_flags(tmp_path / "alice", backup.ca)
    pin = ("pin", backup.url, "--job", backup.job, "--step", "10", "--yes", *operator)
    before = time.time()
    out = mtc(*pin, "--expires-in", "3600", *backup.ca_flag())
    assert out.returncode == 0, out.stdout + out.stderr
    assert ", expires 20" in out.stdout, out.stdout
    expires = json.loads((backup.root / pin_key(backup.job)).read_bytes())["expires_at"]
    assert before + 3600 <= expires <= time.time() + 3600
    assert backup.daemon_reads() == 10, "honoured before its expiry"
    out = mtc(*pin, "--expires-in", "0.001")
    assert out.returncode == 0, out.stdout + out.stderr
    time.sleep(0.01)
    assert backup.daemon_reads() is None, "refused after it"
    bad = mtc(*pin, "--expires-in", "0")
    assert bad.returncode == 2
    assert "--expires-in" in bad.stderr, bad.stderr


def test_an_unsigned_pin_is_written_but_not_honoured(backup: SignedBackup) -> None:
    out = mtc("pin", backup.url, "--job", backup.job, "--step", "10", "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(verified, unsigned)" in out.stdout
    assert "the pin is unsigned" in out.stderr
    assert (backup.root / pin_key(backup.job)).is_file()
    assert backup.daemon_reads() is None, "a daemon with TLS refuses an unsigned pin"


def test_restore_is_the_same_command(backup: SignedBackup, tmp_path: Path) -> None:
    operator = operator_flags(tmp_path / "bob", backup.ca, name="bob")
    out = mtc(
        "restore",
        backup.url,
        "--job",
        backup.job,
        "--step",
        "20",
        "--yes",
        *backup.ca_flag(),
        *operator,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(verified, signed by operator bob)" in out.stdout
    assert backup.daemon_reads() == 20
    out = mtc("restore", backup.url, "--job", backup.job, "--clear")
    assert out.returncode == 0, out.stderr
    assert backup.daemon_reads() is None

    helps = [mtc(name, "--help").stdout for name in ("pin", "restore")]
    assert helps[0] == helps[1], "the same command, the same flags"
    assert "'restore' is the same command" in helps[0]
    assert "--operator-cert" in helps[0]
    listing = mtc("--help").stdout
    assert "pin (restore)" in listing
