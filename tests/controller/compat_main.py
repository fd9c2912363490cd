"""``mtc-controller`` for the 1.20 test API server: the only one that can be built here.

The node stack needs Kubernetes 1.29 (a native sidecar: the plugin is an init container with
``restartPolicy: Always``; gRPC probes), fields a 1.20 server does not know: server-side
apply refuses them, and a probe without them has no handler. This runs the real controller
with one change, made after ``mtc render``'s code and before the API call: ``downgrade``
drops those fields (the plugin becomes a plain init container, without probes; gRPC probes
TCP probes on the same port). Nothing else differs; the tests compare what the server holds with
``downgrade(render(...))``. On a 1.29+ cluster the controller sends render's objects as they are.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from mtc_replicator.controller import kube, main


def downgrade(obj: dict[str, Any]) -> dict[str, Any]:
    if obj.get("kind") != "DaemonSet":
        return obj
    out = copy.deepcopy(obj)
    pod = out["spec"]["template"]["spec"]
    for c in pod.get("initContainers", []):
        # A plain init container: 1.20 allows it no probes either.
        for key in ("restartPolicy", "startupProbe", "readinessProbe", "livenessProbe"):
            c.pop(key, None)
    for c in pod["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc = c.get(probe, {}).pop("grpc", None)
            if grpc is not None:
                c[probe]["tcpSocket"] = {"port": grpc["port"]}
    return out


_apply = kube.Kube.apply


def _downgraded_apply(self: kube.Kube, obj: dict[str, Any]) -> dict[str, Any]:
    return _apply(self, downgrade(obj))


if __name__ == "__main__":
    kube.Kube.apply = _downgraded_apply  # type: ignore[method-assign]
    sys.exit(main.main())
