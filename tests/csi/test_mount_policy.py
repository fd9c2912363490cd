"""The allow-list of who may mount (pure) and the plugin's flags and environment for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.csi.checkpoint import CheckpointDir
from mtc_replicator.csi.errors import MountDenied
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.plugin import DEFAULT_FS_GROUP, parse_args
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.tenancy import MountPolicy, parse_namespaces, parse_service_accounts
from mtc_replicator.csi.validation import Publish
from mtc_replicator.csi.volumes import NodeVolumes

ENV = {
    "MTC_CSI_ENDPOINT": "unix:///csi/csi.sock",
    "MTC_CSI_NODE_ID": "node-a",
    "MTC_RAM_DIR": "/var/lib/mtc/ramdisk",
    "MTC_RAM_SIZE": "1Gi",
}


def pod(namespace: str, service_account: str = "default") -> PodInfo:
    return PodInfo(namespace, "trainer-0", "uid-1", service_account)


def test_an_empty_policy_is_open() -> None:
    policy = MountPolicy()
    assert policy.open
    assert policy.allows(pod("anyone"))
    assert policy.describe() == "any"


def test_a_namespace_or_a_service_account_is_enough() -> None:
    policy = MountPolicy(parse_namespaces("ml-team"), parse_service_accounts("shared/trainer"))
    assert not policy.open
    assert policy.allows(pod("ml-team", "whoever"))
    assert policy.allows(pod("shared", "trainer"))
    assert not policy.allows(pod("shared", "builder"))
    assert not policy.allows(pod("trainer", "shared")), "ns/sa is not the other way round"
    with pytest.raises(MountDenied, match=r"namespace 'other' \(service account other/default\)"):
        policy.check(pod("other"))
    assert policy.describe() == "ml-team,shared/trainer"


@pytest.mark.parametrize("text", ["a,b", "a b", " a ,, b ", "a\nb"])
def test_lists_are_split_on_commas_and_spaces(text: str) -> None:
    assert parse_namespaces(text) == {"a", "b"}


@pytest.mark.parametrize("text", ["Team", "a_b", "-a", "a/b", "x" * 64])
def test_bad_namespaces_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="not a namespace name"):
        parse_namespaces(f"ok,{text}")


@pytest.mark.parametrize("text", ["trainer", "/trainer", "ns/", "NS/trainer", "ns/Trainer"])
def test_bad_service_accounts_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="must be NAMESPACE/NAME"):
        parse_service_accounts(text)


def test_the_plugin_reads_the_lists_and_group_from_flags_and_environment() -> None:
    plain = parse_args([], ENV)
    assert plain.policy.open
    assert plain.fs_group == DEFAULT_FS_GROUP
    env = {
        **ENV,
        "MTC_CSI_ALLOWED_NAMESPACES": "a,b",
        "MTC_CSI_ALLOWED_SERVICE_ACCOUNTS": "c/d",
        "MTC_CSI_FS_GROUP": "1000",
    }
    configured = parse_args([], env)
    assert configured.policy == MountPolicy(frozenset({"a", "b"}), frozenset({("c", "d")}))
    assert configured.fs_group == 1000
    flagged = parse_args(["--allowed-namespaces", "x", "--fs-group", "0"], env)
    assert flagged.policy.namespaces == {"x"}
    assert flagged.fs_group == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-namespaces", "A"], "not a namespace name"),
        (["--allowed-service-accounts", "a"], "NAMESPACE/NAME"),
        (["--fs-group", "wheel"], "numeric group id"),
        (["--fs-group", str(2**31)], "numeric group id"),
    ],
)
def test_bad_values_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(flags, ENV)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_refused_pod_gets_nothing_made_or_mounted(tmp_path: Path) -> None:
    """Over the in-memory mounter (any user): the check comes before the target, the
    owner record and the bind."""
    mounter, ram = MemoryMounter(), tmp_path / "ram"
    ensure_ram_disk(mounter, ram, 2**20)
    CheckpointDir(ram).prepare()
    volumes = NodeVolumes(mounter, ram, policy=MountPolicy(parse_namespaces("ml-team")))
    target = tmp_path / "pod" / "mount"
    target.parent.mkdir()
    with pytest.raises(MountDenied):
        volumes.publish(Publish("v", target, readonly=False, pod=pod("other")))
    assert not target.exists()
    assert mount_at(mounter.mounts(), str(target)) is None
    assert not (ram / "owner.json").exists()
    assert volumes.publish(Publish("v", target, readonly=False, pod=pod("ml-team")))
    assert mount_at(mounter.mounts(), str(target)) is not None
