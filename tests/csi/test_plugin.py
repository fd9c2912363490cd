"""``csi.plugin``, the ``mtc-csi`` process: its options (flags, the environment, the 0.1
names) and its lifecycle in this process over ``MemoryMounter`` (no root)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.csi_servicer import DEFAULT_DRIVER_NAME
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.plugin import (
    DEFAULT_FS_GROUP,
    EXIT_STARTUP_FAILED,
    PluginOptions,
    deprecated_variables,
    parse_args,
    run,
)
from tests.csi.conftest import CsiClient, stale_socket

TIMEOUT = 10.0


ENV = {
    "MTC_CSI_ENDPOINT": "unix:///csi/csi.sock",
    "MTC_CSI_NODE_ID": "node-a",
    "MTC_RAM_DIR": "/var/lib/mtc/ram/",
    "MTC_RAM_SIZE": "64Gi",
}


def test_options_from_the_environment() -> None:
    opts = parse_args([], ENV)
    assert opts == PluginOptions(
        socket_path=Path("/csi/csi.sock"),
        node_id="node-a",
        ram_dir=Path("/var/lib/mtc/ram"),
        ram_size=64 * 2**30,
        driver_name=DEFAULT_DRIVER_NAME,
        fs_group=DEFAULT_FS_GROUP,
    )
    named = parse_args([], {**ENV, "MTC_CSI_DRIVER_NAME": "ckpt.example.com"})
    assert named.driver_name == "ckpt.example.com"


def test_the_0_1_names_are_still_read_and_named_as_deprecated() -> None:
    old = {"CSI_ENDPOINT": "unix:///old/csi.sock", "NODE_NAME": "node-old"}
    rest = {k: v for k, v in ENV.items() if not k.startswith("MTC_CSI_")}
    opts = parse_args([], {**rest, **old})
    assert (opts.socket_path, opts.node_id) == (Path("/old/csi.sock"), "node-old")
    assert deprecated_variables({**rest, **old}) == [
        ("CSI_ENDPOINT", "MTC_CSI_ENDPOINT"),
        ("NODE_NAME", "MTC_CSI_NODE_ID"),
    ]
    both = {**ENV, **old}
    assert parse_args([], both).node_id == "node-a", "the new name wins"
    assert deprecated_variables(both) == []


def test_flags_win_over_the_environment() -> None:
    opts = parse_args(
        ["--node-id", "node-b", "--ram-size", "512Mi", "--driver-name", "x.example.com"], ENV
    )
    assert (opts.node_id, opts.ram_size, opts.driver_name) == (
        "node-b",
        512 * 2**20,
        "x.example.com",
    )


@pytest.mark.parametrize(
    ("drop", "extra", "message"),
    [
        ("MTC_CSI_NODE_ID", [], "--node-id (or MTC_CSI_NODE_ID) is required"),
        ("MTC_RAM_SIZE", [], "--ram-size (or MTC_RAM_SIZE) is required"),
        (None, ["--ram-size", "256m"], "unknown suffix"),
        (None, ["--ram-dir", "ram"], "absolute"),
        (None, ["--endpoint", "tcp://0:1"], "only unix sockets"),
    ],
)
def test_bad_options_exit_2(
    drop: str | None, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {k: v for k, v in ENV.items() if k != drop}
    with pytest.raises(SystemExit) as info:
        parse_args(extra, env)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_run_serves_until_stopped_then_removes_its_socket(
    tmp_path: Path, connect: Callable[[Path], CsiClient]
) -> None:
    socket_path = tmp_path / "plugin" / "csi.sock"
    socket_path.parent.mkdir()
    stale_socket(socket_path)
    opts = PluginOptions(socket_path, "node-a", tmp_path / "ram", 2**20)
    mounter, stop = MemoryMounter(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, opts, mounter, stop)
        try:
            client = connect(socket_path)
            grpc.channel_ready_future(client.channel).result(TIMEOUT)
            info = client.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=TIMEOUT)
            assert info.node_id == "node-a"
        finally:
            stop.set()
        assert running.result(TIMEOUT) == 0
    assert not socket_path.exists()
    assert mount_at(mounter.mounts(), str(tmp_path / "ram")) is not None, "RAM disk kept"


def test_run_fails_when_the_ram_dir_holds_another_filesystem(tmp_path: Path) -> None:
    mounter = MemoryMounter()
    (tmp_path / "ram").mkdir()
    mounter.bind(tmp_path, tmp_path / "ram")
    opts = PluginOptions(tmp_path / "csi.sock", "node-a", tmp_path / "ram", 2**20)
    assert run(opts, mounter, threading.Event()) == EXIT_STARTUP_FAILED
    assert not (tmp_path / "csi.sock").exists()
