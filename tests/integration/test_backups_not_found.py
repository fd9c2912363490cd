""" "Not found is an error ... exit 1 with a message on stderr and nothing on
stdout" (docs/cli.md, `mtc backups`), with --json too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_backups_cli import UPLOADING, Backup, mtc

pytestmark = pytest.mark.integration


@pytest.fixture
def backup(tmp_path: Path, job: str) -> Backup:
    return Backup(tmp_path, job)


@pytest.mark.parametrize(
    "which",
    [
        ["--job", "nope"],
        ["--job", "JOB", "--step", str(UPLOADING)],
        ["--job", "JOB", "--step", "999"],
    ],
)
def test_verify_json_not_found_prints_nothing_on_stdout(backup: Backup, which: list[str]) -> None:
    args = [backup.job if a == "JOB" else a for a in which]
    out = mtc("verify", backup.url, *args, "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.strip()
    assert out.stdout == ""
