"""Who is calling: the node a peer's certificate names, on every RPC and data connection.

The rule (``core.identity``) says which certificates are nodes; this module reads the
names out of certificates (``cryptography``) and applies the rule at the two doors:

- ``NodeIdentityInterceptor`` on the gRPC server: before any handler runs, the caller's
  certificate (gRPC's ``auth_context``) must name a node, else PERMISSION_DENIED. The
  handler then finds the caller's node in ``caller()`` (a context variable set for the call).
- ``peer_node`` for the data channel's accept side, on the TLS object's peer certificate.

Only the health service is exempt: it says nothing about checkpoints, and kubelet's probes
read it in plaintext on ``--health-listen`` anyway. ``CONTROLLER_METHODS`` (``AssignRank``)
take the controller's certificate instead, and refuse every node's; ``CONTROLLER_READS``
(``Node/Status``) take either.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from cryptography import x509

from mtc_replicator.core.identity import (
    CONTROLLER_URI,
    IdentityRule,
    NotANode,
    certificate_node,
    is_controller,
)
from mtc_replicator.transport.signing import check_identity
from mtc_replicator.transport.tls import TlsError, TlsMaterial

log = logging.getLogger(__name__)

EXEMPT_PREFIX = "/grpc.health.v1.Health/"
CONTROLLER_METHODS = frozenset({"/mtc.v1.Node/AssignRank"})
"""What only mtc-controller's certificate may call: a node's is refused (``where="assign"``)."""
CONTROLLER_READS = frozenset({"/mtc.v1.Node/Status"})
"""What mtc-controller's certificate may call besides a node's: what a node holds (read-only),
for the rank assignment. Everything else (pulls, joins, drops) stays the nodes'."""

_caller: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtc_caller", default=None)


def caller() -> str | None:
    """The node the current RPC's caller is (``core.identity.LEGACY`` for a shared
    certificate); None without TLS or outside an RPC."""
    return _caller.get()


def node_of(cert: x509.Certificate, rule: IdentityRule) -> str:
    """The node ``cert`` names under ``rule``; ``NotANode`` otherwise."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise NotANode("it has no subjectAltName") from None
    except ValueError as exc:  # a malformed extension
        raise NotANode(f"its subjectAltName cannot be read: {exc}") from None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    dns = san.get_values_for_type(x509.DNSName)
    return certificate_node(uris, dns, rule)


@functools.lru_cache(maxsize=256)
def _node_of_pem(pem: bytes, rule: IdentityRule) -> str:
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise NotANode("its certificate is not readable") from None
    return node_of(cert, rule)


def node_of_pem(pem: bytes, rule: IdentityRule) -> str:
    """The node the first certificate of a PEM chain names (this node's own at start)."""
    start = pem.find(b"-----BEGIN CERTIFICATE-----")
    end = pem.find(b"-----END CERTIFICATE-----", start)
    if start < 0 or end < 0:
        raise NotANode("it holds no PEM certificate")
    return _node_of_pem(pem[start : end + len(b"-----END CERTIFICATE-----")], rule)


def peer_node(der: bytes | None, rule: IdentityRule) -> str:
    """The node a data-channel peer's certificate (DER, from the TLS object) names."""
    if der is None:
        raise NotANode("it presented no certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        raise NotANode("its certificate is not readable") from None
    return node_of(cert, rule)


def _context_node(context: grpc.aio.ServicerContext[Any, Any], rule: IdentityRule) -> str:
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    if not pems:
        raise NotANode("it presented no certificate")
    return _node_of_pem(bytes(pems[0]), rule)


@functools.lru_cache(maxsize=64)
def _controller_pem(pem: bytes) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    return is_controller(san.get_values_for_type(x509.UniformResourceIdentifier))


def _context_controller(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    return bool(pems) and _controller_pem(bytes(pems[0]))


Behavior = Callable[..., Any]


class NodeIdentityInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before the handler, every call whose certificate names no node."""

    def __init__(
        self, rule: IdentityRule, on_refused: Callable[[str], None] = lambda where: None
    ) -> None:
        self.rule = rule
        self.on_refused = on_refused
        """Counts a refusal (``Metrics.identity_refused``): ``rpc`` names no node, ``assign``
        is not the controller on a ``CONTROLLER_METHODS`` call."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIX):
            return handler
        return _guarded(handler, method, self.rule, self.on_refused)


async def _admit(
    context: grpc.aio.ServicerContext[Any, Any],
    method: str,
    rule: IdentityRule,
    on_refused: Callable[[str], None],
) -> None:
    if method in CONTROLLER_METHODS:
        await _admit_controller(context, method, on_refused)
        return
    if method in CONTROLLER_READS and _context_controller(context):
        _caller.set(None)
        return
    try:
        node = _context_node(context, rule)
    except NotANode as exc:
        on_refused("rpc")
        log.warning(
            "refused %s from %s: its certificate is not a node's: %s", method, context.peer(), exc
        )
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"this certificate is not a node's: {exc}"
        )
    _caller.set(node)


async def _admit_controller(
    context: grpc.aio.ServicerContext[Any, Any], method: str, on_refused: Callable[[str], None]
) -> None:
    """Only a certificate carrying ``CONTROLLER_URI`` and no node name: a node must not
    hand ranks out (it could send another node's pod its own rank's bytes)."""
    if not _context_controller(context):
        on_refused("assign")
        log.warning(
            "refused %s from %s: its certificate is not the controller's (%s)",
            method,
            context.peer(),
            CONTROLLER_URI,
        )
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"only the controller's certificate ({CONTROLLER_URI}) may call {method}",
        )
    _caller.set(None)


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any],
    method: str,
    rule: IdentityRule,
    on_refused: Callable[[str], None],
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with the identity check in front of its behavior."""

    def unary(behavior: Behavior) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await _admit(context, method, rule, on_refused)
            return await behavior(request, context)

        return run

    def streaming(behavior: Behavior) -> Behavior:
        if not inspect.isasyncgenfunction(behavior):
            return unary(behavior)  # writes with context.write and returns

        async def run(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await _admit(context, method, rule, on_refused)
            async for response in behavior(request, context):
                yield response

        return run

    de, ser = handler.request_deserializer, handler.response_serializer
    h: Any = handler  # the stubs type behaviors as synchronous; the aio server awaits them
    if h.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(h.unary_unary), de, ser)
    if h.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(h.unary_stream), de, ser)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(h.stream_unary), de, ser)
    return grpc.stream_stream_rpc_method_handler(streaming(h.stream_stream), de, ser)


def own_node(tls: TlsMaterial) -> str:
    """The node this daemon's own certificate names; ``TlsError`` (one line, with the
    remedy) when it names none: peers would refuse every call it makes."""
    chain, _ = tls.identity()
    try:
        return node_of_pem(chain, tls.rule)
    except NotANode as exc:
        raise TlsError(
            f"the TLS certificate {tls.files.cert} names no node ({exc}): issue one per node "
            "with `mtc certs node NAME DIR` or cert-manager (docs/deploy.md), or pass "
            "--tls-shared-certificate while every node still shares one"
        ) from None


def keeps_node(node: str) -> Callable[[TlsMaterial], None]:
    """A rotation check (``TlsMaterial.vet``): what peers check, and the same node name, so
    a rotated Secret cannot turn this daemon into another node mid-run."""

    def vet(tls: TlsMaterial) -> None:
        check_identity(tls)
        rotated = own_node(tls)
        if rotated != node:
            raise TlsError(
                f"the rotated certificate {tls.files.cert} names node {rotated!r}, not this "
                f"daemon's {node!r}: restart the daemon to change its node"
            )

    return vet
