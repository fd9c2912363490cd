"""The bucket permissions of docs/permissions.md, against a real daemon and ``mtc`` on moto's
S3 server with authorization enforced: the documented policies (read from that page) are
enough for the daemon's start-up probe (which creates ``_mtc-probe/writable``), a backup, a
pinned restore from it and the pin's removal, and each statement is needed: without it the
matching feature fails, and says so (without ``s3:PutObject`` the daemon is not ready and
refuses jobs at once).

moto checks actions and resource ARNs; it does not evaluate condition keys (``s3:prefix``),
so those parts of the policies are present but unchecked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest

from mtc_replicator.storage.backup import LEFTOVER_SKEW
from mtc_replicator.storage.probe import PROBE_KEY
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster, assert_restored, running
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAILED,
    FAST_ARGS,
    config_text,
    make_step,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    wait_ingested,
    wait_markers,
    wait_until,
    write_big_step_tmp,
    write_yaml_atomic,
)
from tests.integration.test_bucket_check import wait_ready_says
from tests.integration.test_metrics import METRICS, sample, scrape_until
from tests.storage_servers import (
    S3_UNSET,
    ServerProcess,
    enable_moto_auth,
    s3_env,
    start_moto,
    unique_bucket_name,
)

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "permissions.md"
PREFIX = "backups"
PIN_DENIED = "cannot remove the used restore pin"


def documented_policy(name: str, bucket: str) -> dict[str, Any]:
    """The policy docs/permissions.md shows under ``<!-- policy: name -->``, for ``bucket``
    and ``PREFIX`` (the page writes bucket ``B`` and prefix ``P/``)."""
    text = DOC.read_text()
    found = re.search(rf"<!-- policy: {re.escape(name)} -->\s*```json\n(.*?)```", text, re.S)
    assert found is not None, f"docs/permissions.md shows no policy {name!r}"
    raw = (
        found.group(1)
        .replace(":::B/P/", f":::{bucket}/{PREFIX}/")
        .replace(':::B"', f':::{bucket}"')
        .replace('"P/', f'"{PREFIX}/')
    )
    policy: dict[str, Any] = json.loads(raw)
    return policy


def without(policy: dict[str, Any], sid: str, action: str | None = None) -> dict[str, Any]:
    """``policy`` less statement ``sid`` (or only its ``action``)."""
    statements = []
    for st in policy["Statement"]:
        if st["Sid"] != sid:
            statements.append(st)
        elif action is not None:
            assert action in st["Action"], (sid, action)
            statements.append({**st, "Action": [a for a in st["Action"] if a != action]})
    assert statements != policy["Statement"], f"no statement {sid} to remove"
    return {**policy, "Statement": statements}


@dataclass
class AuthS3:
    """moto with authorization on, and an admin allowed everything, to set tests up."""

    server: ServerProcess
    admin: dict[str, str]
    users: int = 0

    def client(self, service: str, creds: dict[str, str]) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.server.url,
            region_name="us-east-1",
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        )

    def user(self, policy: dict[str, Any]) -> dict[str, str]:
        """A new IAM user with exactly ``policy``; its credentials as environment."""
        iam = self.client("iam", self.admin)
        self.users += 1
        name = f"u{self.users}-{unique_bucket_name()}"
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }

    def env(self, creds: dict[str, str]) -> dict[str, str]:
        return {**s3_env(self.server.url), **creds}


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthS3]:
    """A moto server of this module's own (authorization is server-wide)."""
    server = start_moto(tmp_path_factory.mktemp("moto-auth"))
    try:
        root = boto3.client(
            "iam",
            endpoint_url=server.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",  # noqa: S106 - moto's, before auth is on
        )
        root.create_user(UserName="admin")
        everything = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        root.put_user_policy(
            UserName="admin", PolicyName="all", PolicyDocument=json.dumps(everything)
        )
        key = root.create_access_key(UserName="admin")["AccessKey"]
        enable_moto_auth(server.url)
        admin = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
        yield AuthS3(server, admin)
    finally:
        server.stop()


@pytest.fixture
def bucket(auth_s3: AuthS3, monkeypatch: pytest.MonkeyPatch) -> str:
    for key in S3_UNSET:
        monkeypatch.delenv(key, raising=False)
    name = unique_bucket_name()
    auth_s3.client("s3", auth_s3.admin).create_bucket(Bucket=name)
    return name


StartDaemon = Callable[..., DaemonProcess]


@pytest.fixture
def start_s3_daemon(ckpt: Path, bucket: str, auth_s3: AuthS3) -> Iterator[StartDaemon]:
    """A real daemon backing up to ``s3://bucket/backups`` with the given credentials."""
    started: list[DaemonProcess] = []

    def start(creds: dict[str, str], extra: tuple[str, ...] = ()) -> DaemonProcess:
        daemon = DaemonProcess(
            ckpt,
            backup=f"s3://{bucket}/{PREFIX}",
            extra_args=(*FAST_ARGS, *METRICS, *extra),
            env=auth_s3.env(creds),
        )
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        if daemon.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.stop(timeout=10)
    if started:
        print(f"--- daemon log ---\n{started[-1].log()[-20000:]}")


def exists(auth_s3: AuthS3, bucket: str, key: str) -> bool:
    try:
        auth_s3.client("s3", auth_s3.admin).head_object(Bucket=bucket, Key=f"{PREFIX}/{key}")
    except botocore.exceptions.ClientError:
        return False
    return True


def pin_key(job: str) -> str:
    return f"_control/{job}/restore-pin.json"


def save_backed_up(
    ckpt: Path, job: str, daemon: DaemonProcess, auth_s3: AuthS3, bucket: str, steps: range
) -> None:
    for step in steps:
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
        wait_until(
            lambda s=step: exists(auth_s3, bucket, f"{job}/{s}/COMMIT"),
            f"COMMIT of step {step}",
            daemon=daemon,
            timeout=60,
        )


def mtc_restore(auth_s3: AuthS3, bucket: str, creds: dict[str, str], job: str, step: int) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtc_replicator.tools.cli",
            "backups",
            "restore",
            f"s3://{bucket}/{PREFIX}",
            "--job",
            job,
            "--step",
            str(step),
            "--yes",
        ],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **auth_s3.env(creds)},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_documented_policies_back_up_restore_and_consume_a_pin(
    ckpt: Path, job: str, bucket: str, auth_s3: AuthS3, start_s3_daemon: StartDaemon
) -> None:
    node = auth_s3.user(documented_policy("s3-daemon", bucket))
    operator = auth_s3.user(documented_policy("s3-operator", bucket))
    daemon = start_s3_daemon(node)
    wait_ready_says(daemon, "ok", status=200)  # the probe listed, read and wrote
    assert exists(auth_s3, bucket, PROBE_KEY)
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    save_backed_up(ckpt, job, daemon, auth_s3, bucket, range(1, 3))

    mtc_restore(auth_s3, bucket, operator, job, 1)
    write_yaml_atomic(ckpt, yaml_text)  # the job restarts: the pin rolls it back to step 1
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 1, "restore-source": "backup"}
    assert read_tree(marker) == payload(1, seed=job)
    wait_until(lambda: not exists(auth_s3, bucket, pin_key(job)), "the pin deleted", daemon=daemon)
    assert not (ckpt / ERRORS).exists(), read_text(ckpt / ERRORS)
    assert "AccessDenied" not in daemon.log()


def test_a_pin_the_daemon_may_not_delete_is_honoured_once(
    ckpt: Path, job: str, bucket: str, auth_s3: AuthS3, start_s3_daemon: StartDaemon
) -> None:
    """Before: the pin stayed and every restart rolled the job back to it again."""
    node = auth_s3.user(without(documented_policy("s3-daemon", bucket), "UsedPins"))
    operator = auth_s3.user(documented_policy("s3-operator", bucket))
    daemon = start_s3_daemon(node)
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    save_backed_up(ckpt, job, daemon, auth_s3, bucket, range(1, 3))

    mtc_restore(auth_s3, bucket, operator, job, 1)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_tree(marker) == payload(1, seed=job)
    errors = wait_until(
        lambda: PIN_DENIED in read_text(ckpt / ERRORS) and read_text(ckpt / ERRORS),
        f"{ERRORS} says the pin could not be deleted",
        daemon=daemon,
    )
    assert "AccessDenied" in errors, errors
    assert pin_key(job) in errors, errors
    scrape_until(
        daemon,
        "mtc_pin_delete_failures_total",
        lambda s: sample(s, "mtc_pin_delete_failures_total", mtc_job=job) == 1.0,
    )
    assert exists(auth_s3, bucket, pin_key(job)), "the policy must have kept the pin"

    # The job goes on from step 1, then restarts: the newest step, not the pin's, again.
    save_backed_up(ckpt, job, daemon, auth_s3, bucket, range(3, 4))
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 3, daemon)
    assert read_tree(marker) == payload(3, seed=job)

    # A pin an operator writes later is a new pin, and honoured.
    mtc_restore(auth_s3, bucket, operator, job, 2)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 2, daemon)
    assert read_tree(marker) == payload(2, seed=job)


def test_without_put_object_the_daemon_is_not_ready_and_refuses_a_job_at_once(
    ckpt: Path, job: str, bucket: str, auth_s3: AuthS3, start_s3_daemon: StartDaemon
) -> None:
    """Before: the daemon said ready, accepted the job, and its first backup failed with
    AccessDenied in replicator.errors; the probe wrote nothing. Now its create-only write
    of the probe object is refused, and so is every job, at once."""
    node = auth_s3.user(without(documented_policy("s3-daemon", bucket), "Objects", "s3:PutObject"))
    daemon = start_s3_daemon(node)
    body = wait_ready_says(daemon, "refused")
    assert f"backup s3://{bucket}/{PREFIX} refused" in body, body
    assert "AccessDenied" in body, body
    assert "may not write under the prefix: it needs s3:PutObject" in body, body
    assert "docs/permissions.md" in body, body
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    wait_until((ckpt / FAILED).exists, FAILED, daemon=daemon, timeout=10)
    failed = read_text(ckpt / FAILED)
    assert "it needs s3:PutObject" in failed, failed
    assert not (ckpt / CONFIG).exists()
    assert not exists(auth_s3, bucket, PROBE_KEY)
    assert daemon.log().count("refused: ") == 1, "one line per change, not per probe"


def incomplete_uploads(auth_s3: AuthS3, bucket: str, job: str) -> list[str]:
    listing = auth_s3.client("s3", auth_s3.admin).list_multipart_uploads(
        Bucket=bucket, Prefix=f"{PREFIX}/{job}/"
    )
    return [u["Key"] for u in listing.get("Uploads", [])]


def test_a_multipart_upload_a_killed_daemon_left_is_aborted_at_the_next_backup(
    ckpt: Path, job: str, bucket: str, auth_s3: AuthS3, start_s3_daemon: StartDaemon
) -> None:
    """Under the documented daemon policy. Before: the parts stayed, billed, for ever."""
    node = auth_s3.user(documented_policy("s3-daemon", bucket))
    # Paced so that the kill lands mid-upload: 40 MiB is 3 parts of 16 MiB at 8 MiB/s.
    daemon = start_s3_daemon(node, ("--max-transfer-rate", "8MiB"))
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    tmp, _ = write_big_step_tmp(ckpt, 1, files=1, mib_each=40)
    tmp.rename(ckpt / "1")
    left = wait_until(
        lambda: incomplete_uploads(auth_s3, bucket, job),
        "a multipart upload under way",
        daemon=daemon,
        timeout=60,
        interval=0.2,
    )
    daemon.kill()
    assert incomplete_uploads(auth_s3, bucket, job) == left
    assert not exists(auth_s3, bucket, f"{job}/1/COMMIT")
    # Only an upload begun LEFTOVER_SKEW before a daemon starts is a leftover to it (a
    # younger one may be another daemon's, live): start the next one that much later
    # (no wait on moto, which dates every upload 2010; the unit tests cover the cutoff).
    listing = auth_s3.client("s3", auth_s3.admin).list_multipart_uploads(
        Bucket=bucket, Prefix=f"{PREFIX}/{job}/"
    )
    newest = max(u["Initiated"].timestamp() for u in listing["Uploads"])
    time.sleep(max(newest + LEFTOVER_SKEW + 1 - time.time(), 0.0))

    daemon = start_s3_daemon(node)
    write_yaml_atomic(ckpt, yaml_text)  # the job restarts from its local step 1
    wait_markers(ckpt, job, 1, daemon)
    save_backed_up(ckpt, job, daemon, auth_s3, bucket, range(2, 3))
    wait_until(
        lambda: not incomplete_uploads(auth_s3, bucket, job),
        "the leftover upload aborted",
        daemon=daemon,
        timeout=60,
        interval=0.2,
    )
    assert "aborted an incomplete upload" in daemon.log()


def test_a_cluster_job_registers_backs_up_and_restores_on_the_daemon_policy(
    tmp_path: Path,
    job: str,
    bucket: str,
    auth_s3: AuthS3,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four daemons: the registry (created, then replaced at each restart by its owner),
    commits by the coordinator, its listings, and every node restoring from the bucket."""
    for key, value in auth_s3.env(auth_s3.admin).items():
        monkeypatch.setenv(key, value)  # the test's own reads
    cluster = Cluster(tmp_path, job)
    cluster.backup_url = f"s3://{bucket}/{PREFIX}"
    cluster.env = auth_s3.env(auth_s3.user(documented_policy("s3-daemon", bucket)))
    with running(cluster):
        cluster.keys["backup_interval_steps"] = 1
        cluster.fresh_start()
        files = cluster.save(3)
        cluster.wait_backup(3)
        assert exists(auth_s3, bucket, f"_registry/{job}.json")
        cluster.wipe_all()
        cluster.handshake(list(range(NODES)))
        cluster.wait_markers(3)
        assert_restored(cluster, 3, files)
        assert [cluster.source(r) for r in range(NODES)] == ["backup"] * NODES
        for r in range(NODES):
            assert "AccessDenied" not in cluster.daemon(r).log(), f"node {r}"
