"""Which certificates are nodes (``core.identity``): pure rules on a certificate's names."""

from __future__ import annotations

import pytest

from mtc_replicator.core.identity import (
    DEFAULT_NODE_NAME_PATTERN,
    LEGACY,
    IdentityRule,
    NotANode,
    certificate_node,
    named_nodes,
    node_uri,
)

SHARED = "mtc-replicator"


def test_a_node_uri_names_its_node() -> None:
    assert certificate_node([node_uri("gke-pool-1-abcd")], [SHARED], IdentityRule()) == (
        "gke-pool-1-abcd"
    )


@pytest.mark.parametrize(
    ("uris", "dns", "reason"),
    [
        ([], [SHARED], "no URI subjectAltName"),
        (["spiffe://other/node/a"], [SHARED], "no URI subjectAltName"),
        ([node_uri("Evil_Node")], [SHARED], "does not match --tls-node-name-pattern"),
        ([node_uri("")], [SHARED], "does not match"),
        ([node_uri("a"), node_uri("b")], [SHARED], "names 2 nodes"),
        ([node_uri("a/../b")], [SHARED], "does not match"),
    ],
)
def test_a_certificate_that_names_no_node_is_not_a_node(
    uris: list[str], dns: list[str], reason: str
) -> None:
    with pytest.raises(NotANode, match=reason):
        certificate_node(uris, dns, IdentityRule())


def test_the_pattern_must_match_the_whole_name() -> None:
    rule = IdentityRule(pattern="gpu-[0-9]+")
    assert certificate_node([node_uri("gpu-12")], [], rule) == "gpu-12"
    for name in ("cpu-1", "gpu-1x", "xgpu-1"):
        with pytest.raises(NotANode):
            certificate_node([node_uri(name)], [], rule)


def test_a_shared_certificate_is_a_node_only_under_the_legacy_rule() -> None:
    legacy = IdentityRule(shared_name=SHARED)
    assert certificate_node([], [SHARED], legacy) == LEGACY
    # A named node is still its name under the legacy rule.
    assert certificate_node([node_uri("n1")], [SHARED], legacy) == "n1"
    with pytest.raises(NotANode, match="nor the shared DNS name"):
        certificate_node([], ["other-service"], legacy)
    with pytest.raises(NotANode):
        certificate_node([], [SHARED], IdentityRule())


def test_a_node_uri_without_the_shared_dns_name_is_not_a_node() -> None:
    """A certificate the CA issued for another service, with a node's URI in it: not that
    node (clients check the shared name on servers; servers check it on callers)."""
    rule = IdentityRule(server_name=SHARED)
    assert certificate_node([node_uri("n1")], ["x.example", SHARED], rule) == "n1"
    with pytest.raises(NotANode, match="lacks the DNS name 'mtc-replicator'"):
        certificate_node([node_uri("n1")], ["other-service.example"], rule)
    with pytest.raises(NotANode, match="lacks the DNS name"):
        certificate_node([node_uri("n1")], [], rule)


def test_named_nodes_ignores_other_uris() -> None:
    assert named_nodes(["https://x", node_uri("a"), "spiffe://mtc-replicator/other/b"]) == ["a"]


def test_the_default_pattern_takes_kubernetes_node_names() -> None:
    rule = IdentityRule(pattern=DEFAULT_NODE_NAME_PATTERN)
    for name in ("node0", "ip-10-0-0-7.ec2.internal", "gke-a-b-1234", "mtc-node-default-x7k2p"):
        assert rule.matches(name), name
    for name in ("", "-a", "a-", "A", "a_b", "a b", "a" * 254):
        assert not rule.matches(name), name
