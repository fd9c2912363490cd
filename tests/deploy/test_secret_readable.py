"""Secret volume files are root's (uid 0); kubelet gives them the pod's fsGroup as group when
there is one, else group 0. A non-root container reads a mounted Secret only through the
group bits with an fsGroup, or the world bits. The controller runs as 65532 and mounts
mtc-controller-tls (its key for sticky ranks' AssignRank): it must be able to read it."""

from __future__ import annotations

import pytest

from tests.deploy import helm_chart
from tests.deploy.k8s import DEPLOY, Obj, kustomize

BUILDS = {
    "kustomize:controller": lambda: kustomize(DEPLOY / "overlays" / "controller"),
    "kustomize:base": lambda: kustomize(DEPLOY / "base"),
    "helm:controller": lambda: helm_chart.render_files("controller.yaml"),
    "helm:default": lambda: helm_chart.render({}),
}


def _readable(pod: Obj, container: Obj, secret: Obj) -> bool:
    psc = pod.get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    if uid == 0:
        return True
    mode = secret.get("defaultMode", 0o644)
    if mode & 0o004:
        return True
    gids = {csc.get("runAsGroup", psc.get("runAsGroup"))} | set(psc.get("supplementalGroups") or [])
    file_gid = psc.get("fsGroup", 0)
    if "fsGroup" in psc:
        gids.add(psc["fsGroup"])
    return bool(mode & 0o040) and file_gid in gids


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_mounted_secret_is_readable_by_its_container(build: str) -> None:
    checked = 0
    for obj in BUILDS[build]():
        if obj["kind"] not in {"Deployment", "DaemonSet"}:
            continue
        pod = obj["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            for m in c.get("volumeMounts", []):
                if m["name"] in secrets:
                    checked += 1
                    assert _readable(pod, c, secrets[m["name"]]), (
                        f"{obj['metadata']['name']}/{c['name']} cannot read Secret volume "
                        f"{m['name']} (mode {secrets[m['name']].get('defaultMode', 0o644):o})"
                    )
    assert checked
