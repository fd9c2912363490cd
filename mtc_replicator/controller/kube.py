"""The controller's Kubernetes I/O: server-side apply of the node stack, reads of what it
depends on, deletes of what it owns, the status subresource. Synchronous (the official
client); kopf runs the handlers that call it in its thread pool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from mtc_replicator.controller.plan import (
    FIXED_ANNOTATION,
    INSTANCE_LABEL,
    OWNED_KINDS,
    RELEASE_ANNOTATION,
    Peer,
)
from mtc_replicator.tools.render_config import GROUP, Manifest

FIELD_MANAGER = "mtc-controller"
PLURAL = "checkpointconfigurations"


class MissingKind(RuntimeError):
    """The API server does not serve a kind the node stack needs (cert-manager's, say)."""


def load_config() -> None:
    """In a pod: its service account; elsewhere: ``$KUBECONFIG`` or ``~/.kube/config``."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    """One API client for the process; the dynamic client's discovery is made once."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()
        self._dynamic: DynamicClient | None = None

    @property
    def dynamic(self) -> DynamicClient:
        if self._dynamic is None:
            self._dynamic = DynamicClient(self.api)
        return self._dynamic

    def _resource(self, api_version: str, kind: str) -> Any:
        try:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            # A CRD installed after discovery (cert-manager's): look again once.
            self.dynamic.resources.invalidate_cache()
            try:
                return self.dynamic.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                raise MissingKind(
                    f"the API server does not serve {kind} ({api_version}): "
                    "is its CRD installed (cert-manager for spec.tls.certManager)?"
                ) from None

    def apply(self, obj: Manifest) -> Manifest:
        """Server-side apply as the controller: fields it no longer sets are removed."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        out = self.dynamic.server_side_apply(
            resource,
            body=obj,
            namespace=obj["metadata"].get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        result: Manifest = out.to_dict()
        return result

    def ensure(self, obj: Manifest) -> None:
        """Create a shared object where it is missing; one that exists is left as it is (a
        Helm release or another configuration made it)."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        try:
            resource_get(self, resource, obj)
        except NotFoundError:
            self.dynamic.create(resource, body=obj, namespace=obj["metadata"].get("namespace"))

    def daemonset(self, namespace: str, name: str) -> Manifest | None:
        try:
            ds = client.AppsV1Api(self.api).read_namespaced_daemon_set(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        out: Manifest = self.api.sanitize_for_serialization(ds)
        return out

    def configuration(self, namespace: str, name: str) -> Manifest | None:
        try:
            out: Manifest = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, "v1", namespace, PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return out

    def peers(self) -> list[Peer]:
        """Every configuration of the cluster, with the node selector its pods get."""
        from mtc_replicator.tools.render_config import DEFAULT_NODE_SELECTOR

        items = client.CustomObjectsApi(self.api).list_cluster_custom_object(GROUP, "v1", PLURAL)
        stacks = client.AppsV1Api(self.api).list_daemon_set_for_all_namespaces(
            label_selector="app.kubernetes.io/part-of=mtc"
        )
        holders = {ref.uid for ds in stacks.items for ref in ds.metadata.owner_references or []}
        out = []
        for cr in items.get("items", []):
            meta = cr["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            spec = cr.get("spec") or {}
            selector = spec.get("nodeSelector")
            if not isinstance(selector, dict):
                selector = dict(DEFAULT_NODE_SELECTOR)
            out.append(
                Peer(
                    namespace=meta["namespace"],
                    name=meta["name"],
                    created=meta.get("creationTimestamp", ""),
                    selector={"kubernetes.io/os": "linux", **selector},
                    holding=meta.get("uid") in holders,
                )
            )
        return out

    def nodes(self) -> list[tuple[str, dict[str, str]]]:
        items = client.CoreV1Api(self.api).list_node().items
        return [(n.metadata.name, dict(n.metadata.labels or {})) for n in items]

    def delete_owned(self, namespace: str, name: str, uid: str, keep: Sequence[str] = ()) -> int:
        """Delete this configuration's objects (its instance label and its ownerReference),
        all but those named in ``keep``; the number deleted."""
        deleted = 0
        for kind in OWNED_KINDS:
            api_version = {"DaemonSet": "apps/v1", "NetworkPolicy": "networking.k8s.io/v1"}
            resource = self._resource(api_version.get(kind, "v1"), kind)
            items = self.dynamic.get(
                resource, namespace=namespace, label_selector=f"{INSTANCE_LABEL}={name}"
            ).items
            for item in items:
                owners = item.metadata.get("ownerReferences") or []
                if not any(o.get("uid") == uid for o in owners) or item.metadata.name in keep:
                    continue
                try:
                    # Background: the DaemonSet's pods go after it (foreground would wait for
                    # a garbage collector).
                    self.dynamic.delete(
                        resource,
                        name=item.metadata.name,
                        namespace=namespace,
                        body={"propagationPolicy": "Background"},
                    )
                    deleted += 1
                except NotFoundError:
                    pass
        return deleted

    def pods(self, namespace: str, name: str) -> list[Manifest]:
        """The node-stack pods of configuration ``name`` (its DaemonSet's selector)."""
        items = (
            client.CoreV1Api(self.api)
            .list_namespaced_pod(
                namespace,
                label_selector=f"app.kubernetes.io/name=mtc-node,{INSTANCE_LABEL}={name}",
            )
            .items
        )
        return [self.api.sanitize_for_serialization(p) for p in items]

    def node_stack_pods(self) -> list[Manifest]:
        """Every node-stack pod, in every namespace: where each node's replicator listens."""
        items = (
            client.CoreV1Api(self.api)
            .list_pod_for_all_namespaces(label_selector="app.kubernetes.io/name=mtc-node")
            .items
        )
        return [self.api.sanitize_for_serialization(p) for p in items]

    def job_pods(self, namespace: str) -> list[Manifest]:
        """The pods of ``namespace`` that opt in to sticky ranks, as they are now."""
        from mtc_replicator.controller.jobpods import NODES_LABEL

        items = (
            client.CoreV1Api(self.api)
            .list_namespaced_pod(namespace, label_selector=NODES_LABEL)
            .items
        )
        return [self.api.sanitize_for_serialization(p) for p in items]

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        client.CoreV1Api(self.api).patch_namespaced_pod(
            name, namespace, {"metadata": {"annotations": dict(annotations)}}
        )

    def mark_release(self, namespace: str, name: str) -> int:
        """Annotate configuration ``name``'s pods so that their plugins free the RAM disk as
        they stop; the number of pods marked."""
        core = client.CoreV1Api(self.api)
        marked = 0
        for pod in self.pods(namespace, name):
            body = {"metadata": {"annotations": {RELEASE_ANNOTATION: "true"}}}
            try:
                core.patch_namespaced_pod(pod["metadata"]["name"], namespace, body)
                marked += 1
            except ApiException as exc:
                if exc.status != 404:  # a pod gone meanwhile has nothing to free
                    raise
        return marked

    def patch_status(self, namespace: str, name: str, st: Mapping[str, Any]) -> None:
        client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status(
            GROUP, "v1", namespace, PLURAL, name, {"status": dict(st)}
        )


def resource_get(kube: Kube, resource: Any, obj: Manifest) -> Any:
    return kube.dynamic.get(
        resource, name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace")
    )


def fixed_of(ds: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The fixed fields a DaemonSet was made with (``FIXED_ANNOTATION``), or None."""
    if ds is None:
        return None
    text = ((ds.get("metadata") or {}).get("annotations") or {}).get(FIXED_ANNOTATION)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def owned_by(obj: Mapping[str, Any] | None, uid: str) -> bool:
    owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == uid for o in owners)
