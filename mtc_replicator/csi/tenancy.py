"""Who may mount the node's checkpoint directory: an allow-list of namespaces and service
accounts. Pure, no I/O.

kubelet names the pod behind every NodePublishVolume (``podInfoOnMount: true``), so the
namespace and service account come from the node, never from the pod's own say-so. A pod
may mount when its namespace is listed, or its ``namespace/service-account`` is. With
neither list set the policy is open (every namespace), which the plugin warns about at
start: see SECURITY.md, "Who may mount".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from mtc_replicator.csi.errors import MountDenied
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.validation import LABEL_RE, SUBDOMAIN_RE

_SEPARATORS = re.compile(r"[\s,]+")

ALLOW_HINT = (
    "list it in the CheckpointConfiguration's spec.allowedNamespaces or "
    "spec.allowedServiceAccounts (the plugin's --allowed-namespaces, --allowed-service-accounts)"
)


@dataclass(frozen=True)
class MountPolicy:
    """Namespaces and ``(namespace, service account)`` pairs whose pods may mount."""

    namespaces: frozenset[str] = frozenset()
    service_accounts: frozenset[tuple[str, str]] = frozenset()

    @property
    def open(self) -> bool:
        """No list set: every namespace may mount (the behaviour before allow-lists)."""
        return not self.namespaces and not self.service_accounts

    def allows(self, pod: PodInfo) -> bool:
        return (
            self.open
            or pod.namespace in self.namespaces
            or (pod.namespace, pod.service_account) in self.service_accounts
        )

    def check(self, pod: PodInfo) -> None:
        """Raise ``MountDenied`` naming the pod's namespace and service account (its own:
        the message lands in its events) and how to allow them; never the allowed ones."""
        if not self.allows(pod):
            raise MountDenied(
                f"namespace {pod.namespace!r} (service account "
                f"{pod.namespace}/{pod.service_account}) may not mount this node's checkpoint "
                f"volume; to allow it, {ALLOW_HINT}"
            )

    def describe(self) -> str:
        """For the log: ``any`` or the lists."""
        if self.open:
            return "any"
        accounts = sorted(f"{ns}/{sa}" for ns, sa in self.service_accounts)
        return ",".join(sorted(self.namespaces) + accounts)


OPEN_POLICY = MountPolicy()
"""No allow-list: every namespace may mount."""


def _items(text: str | Iterable[str]) -> list[str]:
    parts = _SEPARATORS.split(text) if isinstance(text, str) else list(text)
    return [p for p in (part.strip() for part in parts) if p]


def parse_namespaces(text: str | Iterable[str]) -> frozenset[str]:
    """``a,b`` or ``a b`` (or a list); a ``ValueError`` names the first bad entry."""
    names = _items(text)
    for name in names:
        if not LABEL_RE.fullmatch(name):
            raise ValueError(f"allowed namespace {name!r} is not a namespace name (a DNS label)")
    return frozenset(names)


def parse_service_accounts(text: str | Iterable[str]) -> frozenset[tuple[str, str]]:
    """``ns/name,ns2/name2`` (or a list); a ``ValueError`` names the first bad entry."""
    accounts: set[tuple[str, str]] = set()
    for item in _items(text):
        namespace, slash, name = item.partition("/")
        if not slash or not LABEL_RE.fullmatch(namespace) or not SUBDOMAIN_RE.fullmatch(name):
            raise ValueError(
                f"allowed service account {item!r} must be NAMESPACE/NAME, e.g. ml-team/trainer"
            )
        accounts.add((namespace, name))
    return frozenset(accounts)
