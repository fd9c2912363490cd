"""``mtc``'s command table: built-in commands plus the ``mtc.commands`` entry points."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint

import pytest

from mtc_replicator.tools import cli


def test_demo_plugs_in_through_its_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--nodes", "0"])
    assert exited.value.code == 2
    assert "--nodes must be at least 1" in capsys.readouterr().err
    assert "mtc_replicator.demo" in sys.modules  # loaded by the entry point, not imported by cli


def test_a_plugin_that_cannot_be_imported_is_left_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = EntryPoint("ghost", "replicator.no_such_module", cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "{backups,certs,drop,registry,render,status,upload}" in out
    assert "ghost" not in out
