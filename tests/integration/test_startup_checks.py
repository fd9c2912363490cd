"""Fail fast on misconfiguration, against the real daemon process: a certificate its peers
would refuse, a store it cannot write, a value the OS would refuse later, each stops it at
start with exit 2 and one line (the reason and the remedy); a typo in a hand-written
``replicator.yaml`` reaches the job's ``replicator.errors``.

Before these checks each of these daemons started (a certificate: said ``tls=on`` and
ready, and every registry entry it signed was then refused by the others, so the job hung),
or died with a traceback and exit 1.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from mtc_replicator.tools import certs
from mtc_replicator.transport.signing import check_identity
from mtc_replicator.transport.tls import TlsMaterial
from tests.daemon_process import DaemonProcess
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    ERRORS,
    config_text,
    mount_tmpfs,
    read_text,
    unmount,
    wait_markers,
    write_yaml_atomic,
)
from tests.integration.test_metrics import sample, scrape_daemon
from tests.tls import TEST_NODE, hand_made_node, openssl_style_ca

pytestmark = pytest.mark.integration

Case = Callable[[], tuple[certs.Pair, certs.Pair]]
"""(the CA the daemon trusts, its node certificate)."""


def _ca_without_key_usage() -> tuple[certs.Pair, certs.Pair]:
    ca = openssl_style_ca(key_usage=False)
    return ca, hand_made_node(ca)


def _no_san() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca()
    return ca, hand_made_node(ca, dns_names=())


def _other_name() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca()
    return ca, hand_made_node(ca, dns_names=("node-7.example",))


def _server_only() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca()
    return ca, hand_made_node(ca, usages=(ExtendedKeyUsageOID.SERVER_AUTH,))


def _expired() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca(not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=10))
    return ca, hand_made_node(ca, valid_from=dt.timedelta(days=-3), valid_for=dt.timedelta(days=1))


def _not_yet_valid() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca()
    return ca, hand_made_node(ca, valid_from=dt.timedelta(days=2))


def _other_ca() -> tuple[certs.Pair, certs.Pair]:
    return certs.new_ca(), certs.issue(certs.new_ca())


def _key_mismatch() -> tuple[certs.Pair, certs.Pair]:
    ca = certs.new_ca()
    return ca, certs.Pair(certs.issue(ca).cert, certs.issue(ca).key)


BAD: dict[str, tuple[Case, str]] = {
    "ca-without-keyUsage": (_ca_without_key_usage, "missing required extension"),
    "no-subjectAltName": (_no_san, "subjectAltName"),
    "another-dns-name": (_other_name, "subjectAltName"),
    "no-clientAuth": (_server_only, "refused by peers"),
    "expired": (_expired, "refused by peers"),
    "not-yet-valid": (_not_yet_valid, "refused by peers"),
    "signed-by-another-ca": (_other_ca, "refused by peers"),
    "key-does-not-fit": (_key_mismatch, "does not fit"),
}


def _write(root: Path, case: Case) -> tuple[str, ...]:
    ca, node = case()
    certs.write_node_files(root, ca, node)
    return certs.daemon_flags(certs.node_files(root))


def _start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the daemon; one that is still up after 20 s started (the defect): fail."""
    try:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "mtc_replicator.node.daemon",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                "--listen",
                "127.0.0.1:0",
                *args,
            ],
            capture_output=True,
            check=False,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the daemon started instead of exiting 2: {exc.stderr!r:.600}")


@pytest.mark.parametrize("name", list(BAD))
def test_a_certificate_peers_refuse_stops_the_daemon_at_start(tmp_path: Path, name: str) -> None:
    case, reason = BAD[name]
    done = _start(tmp_path, *_write(tmp_path / "tls", case))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert reason in lines[0]
    if name != "key-does-not-fit":
        assert "mtc certs init" in lines[0]
    assert "daemon started" not in done.stderr


def test_a_certificate_peers_accept_starts(tmp_path: Path) -> None:
    tls = _write(tmp_path / "tls", lambda: (ca := certs.new_ca(), certs.issue(ca, node=TEST_NODE)))
    with DaemonProcess(tmp_path / "ckpt", extra_args=tls) as daemon:
        assert "tls=on" in daemon.log()


def test_a_rotated_certificate_peers_would_refuse_is_kept_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Secret rotated in place to a certificate without the DNS name: the daemon keeps
    the one it has (peers accept it) and says why, until the files change again."""
    ca = certs.new_ca()
    good = certs.issue(ca, node=TEST_NODE)
    root = tmp_path / "tls"
    certs.write_node_files(root, ca, good)
    material = TlsMaterial(certs.node_files(root), vet=check_identity)
    certs.write_node_files(root, ca, hand_made_node(ca, dns_names=()))
    assert material.refresh() is False
    assert material.identity()[0] == good.cert
    assert "subjectAltName" in caplog.text
    caplog.clear()
    assert material.refresh() is False
    assert caplog.text == "", "refused once per change, not at every call"
    rotated = certs.issue(ca, node=TEST_NODE)
    certs.write_node_files(root, ca, rotated)
    assert material.refresh() is True
    assert material.identity()[0] == rotated.cert


def _one_line_exit_2(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "daemon started" not in done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("which", ["checkpoint-dir", "store-dir"])
def test_a_directory_the_daemon_cannot_write_is_exit_2_and_one_line(
    tmp_path: Path, which: str
) -> None:
    ram = tmp_path / "ram"
    ram.mkdir()
    if not mount_tmpfs(ram, "4m"):
        pytest.skip("needs root to mount a read-only tmpfs (root ignores mode bits)")
    try:
        if which == "store-dir":
            (ram / "ckpt").mkdir()  # CHECKPOINT_DIR is there; its store cannot be made
        subprocess.run(["mount", "-o", "remount,ro", str(ram)], check=True)
        line = _one_line_exit_2(_start(tmp_path, "--checkpoint-dir", str(ram / "ckpt")))
        if which == "checkpoint-dir":  # never created, read-only or not (the test below)
            assert f"CHECKPOINT_DIR {ram / 'ckpt'} does not exist" in line
            return
        assert "Read-only file system" in line
        assert "writable directory" in line
    finally:
        unmount(ram)


def test_a_checkpoint_dir_that_is_not_there_is_refused_not_made(tmp_path: Path) -> None:
    """Before: a mistyped --checkpoint-dir was created with its parents and served, on
    whatever disk held it, without a word."""
    typo = tmp_path / "ramdsik" / "checkpoint"
    line = _one_line_exit_2(_start(tmp_path, "--checkpoint-dir", str(typo)))
    assert f"CHECKPOINT_DIR {typo} does not exist" in line
    assert "the daemon does not create it" in line
    assert "CSI plugin" in line
    assert not typo.parent.exists()
    a_file = tmp_path / "file"
    a_file.write_text("")
    line = _one_line_exit_2(_start(tmp_path, "--checkpoint-dir", str(a_file)))
    assert f"CHECKPOINT_DIR {a_file} is not a directory" in line


def test_a_checkpoint_dir_not_in_ram_is_warned_of_and_measured(tmp_path: Path) -> None:
    """On a disk it is served (a local run may want that) with a warning and
    ``mtc_checkpoint_dir_in_memory 0``; on a real tmpfs, 1 and no warning."""
    on_disk = tmp_path / "disk" / "checkpoint"
    on_disk.mkdir(parents=True)
    fs_type = subprocess.run(
        ["stat", "-f", "-c", "%T", str(on_disk)], capture_output=True, text=True, check=True
    ).stdout.strip()
    if fs_type == "tmpfs":
        pytest.skip("the test directory is on a tmpfs: no disk to try")
    with DaemonProcess(on_disk, extra_args=("--metrics", "127.0.0.1:0")) as daemon:
        assert f"CHECKPOINT_DIR {on_disk} is on a " in daemon.log()
        assert "not a RAM disk (tmpfs)" in daemon.log()
        samples = scrape_daemon(daemon)
        (disk_type,) = [
            dict(labels)["fstype"]
            for name, labels in samples
            if name == "mtc_checkpoint_dir_in_memory"
        ]
        assert disk_type != "tmpfs"
        assert sample(samples, "mtc_checkpoint_dir_in_memory", fstype=disk_type) == 0.0
    ram = tmp_path / "ram"
    ram.mkdir()
    if not mount_tmpfs(ram, "16m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        (ram / "checkpoint").mkdir()
        with DaemonProcess(ram / "checkpoint", extra_args=("--metrics", "127.0.0.1:0")) as d:
            assert "not a RAM disk" not in d.log()
            samples = scrape_daemon(d)
            assert sample(samples, "mtc_checkpoint_dir_in_memory", fstype="tmpfs") == 1.0
    finally:
        unmount(ram)


def test_a_backup_that_is_a_plain_path_is_a_usage_error(tmp_path: Path) -> None:
    plain = tmp_path / "plainpath"
    line = _one_line_exit_2(_start(tmp_path, "--backup", str(plain)))
    assert f"for a directory: {plain.as_uri()}" in line
    assert not plain.exists()


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--store-dir", "--owner-file"])
def test_a_name_too_long_for_the_os_is_a_usage_error(tmp_path: Path, flag: str) -> None:
    line = _one_line_exit_2(_start(tmp_path, flag, str(tmp_path / ("s" * 300))))
    assert f"argument {flag}: a path component must be at most 255 bytes, got 300" in line


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--idle-timeout-seconds", "1e300", "must be at most 1e+09"),
        ("--tls-server-name", "mtc replicator", "must be a DNS name"),
        ("--registry", "s3:/bucket", "must be s3://bucket/prefix"),
    ],
)
def test_a_value_the_os_or_a_store_would_refuse_later_is_a_usage_error(
    tmp_path: Path, flag: str, value: str, words: str
) -> None:
    line = _one_line_exit_2(_start(tmp_path, flag, value))
    assert f"argument {flag}: {words}" in line


def test_a_typo_in_a_hand_written_handshake_reaches_the_job(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job, backup_interval_minute=5))
    wait_markers(ckpt, job, 0, daemon)  # unknown keys stay non-fatal (protocol)
    errors = read_text(ckpt / ERRORS)
    assert (
        "replicator.yaml key 'backup-interval-minute' is not one the replicator knows and was "
        "ignored: did you mean 'backup-interval-minutes'?"
    ) in errors
