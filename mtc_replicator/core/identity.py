"""Node identities: which node a certificate names, and whether a caller is a node. Pure.

Every node certificate carries the shared DNS name (``--tls-server-name``), which clients
check instead of the address they dial, and, since per-node certificates, one URI
subjectAltName ``spiffe://mtc-replicator/node/<node>`` naming the node itself. A URI and not
a second DNS name: a DNS name would also pass hostname checks wherever the CA is trusted
(a node certificate would become a server certificate for ``<node>.<suffix>``), while a URI
SAN is an identity only, the SPIFFE form that cert-manager's csi-driver and SPIRE issue, and
it needs no suffix to be agreed on.

A certificate the CA signed but that names no node (a client-only certificate, one for
another service of the same CA), names one outside ``--tls-node-name-pattern``, or names one
without the shared DNS name (a certificate the CA issued for another service, which someone
had a node's URI put in) is not a node: ``certificate_node`` refuses it. Clients check the
shared name on the servers they call; this is the same check on callers. ``LEGACY`` is
the identity of a shared certificate (every node one certificate, no node name), accepted
only under ``--tls-shared-certificate``.

The controller's certificate carries ``CONTROLLER_URI`` and no node name: it is no node (it
serves no peer, joins no job) and may call one method only, ``Node/AssignRank``, which a
node's certificate may not (``is_controller``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

NODE_URI_PREFIX = "spiffe://mtc-replicator/node/"
"""A node certificate's URI subjectAltName is this followed by the node's name."""

CONTROLLER_URI = "spiffe://mtc-replicator/controller"
"""The URI subjectAltName of mtc-controller's certificate (``mtc certs controller``)."""

DEFAULT_NODE_NAME_PATTERN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
"""A Kubernetes node name (a DNS-1123 subdomain): what ``--tls-node-name-pattern`` defaults to."""

LEGACY = ""
"""The caller identity of a shared certificate: a node, but not which one."""


class NotANode(Exception):
    """A certificate the CA signed that names no node; the message says why."""


@dataclass(frozen=True)
class IdentityRule:
    """Which certificates are nodes (``--tls-node-name-pattern``, ``--tls-shared-certificate``)."""

    pattern: str = DEFAULT_NODE_NAME_PATTERN
    """A regular expression the whole node name must match."""
    shared_name: str | None = None
    """Set (to ``--tls-server-name``) under ``--tls-shared-certificate``: a certificate with
    that DNS name and no node URI is a node too, known as ``LEGACY``."""
    server_name: str | None = None
    """``--tls-server-name``: the DNS name every node certificate carries; a certificate
    naming a node without it is not that node's (None: not checked)."""

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


def node_uri(node: str) -> str:
    """The URI subjectAltName naming ``node``."""
    return NODE_URI_PREFIX + node


def named_nodes(uris: Iterable[str]) -> list[str]:
    """The node names among a certificate's URI subjectAltNames."""
    return [u[len(NODE_URI_PREFIX) :] for u in uris if u.startswith(NODE_URI_PREFIX)]


def is_controller(uris: Iterable[str]) -> bool:
    """Whether a certificate with these URI subjectAltNames is the controller's: it carries
    ``CONTROLLER_URI`` and names no node (one naming both could act as either)."""
    names = list(uris)
    return CONTROLLER_URI in names and not named_nodes(names)


def certificate_node(uris: Iterable[str], dns_names: Iterable[str], rule: IdentityRule) -> str:
    """The node a certificate names (``LEGACY`` for a shared one under the legacy rule);
    ``NotANode`` with the reason otherwise. One node name exactly: a certificate naming two
    could act as either."""
    names = named_nodes(uris)
    if len(names) > 1:
        raise NotANode(f"it names {len(names)} nodes ({', '.join(sorted(names))[:200]})")
    if names:
        name = names[0]
        if not rule.matches(name):
            raise NotANode(
                f"its node name {name[:100]!r} does not match --tls-node-name-pattern "
                f"{rule.pattern[:100]!r}"
            )
        if rule.server_name is not None and rule.server_name not in set(dns_names):
            raise NotANode(
                f"it names node {name!r} but lacks the DNS name {rule.server_name!r} every "
                "node certificate carries (--tls-server-name): issue node certificates with "
                "`mtc certs node` or as docs/deploy.md shows"
            )
        return name
    if rule.shared_name is not None and rule.shared_name in set(dns_names):
        return LEGACY
    return_hint = (
        "" if rule.shared_name is None else f" nor the shared DNS name {rule.shared_name!r}"
    )
    raise NotANode(f"it has no URI subjectAltName {NODE_URI_PREFIX}<node>{return_hint}")
