"""Both translations between our exceptions and gRPC status codes (pure: no sockets)."""

from __future__ import annotations

import errno

import grpc
import grpc.aio
import pytest

from mtc_replicator.core.manifest import Cancelled, CorruptItem, ManifestError
from mtc_replicator.local.store import StoreError
from mtc_replicator.transport.peer_client import (
    ItemBusy,
    ItemNotFound,
    PeerError,
    PeerUnavailable,
    _rpc_error,
)
from mtc_replicator.transport.peer_servicer import Busy, NotHeld, Refused, TooLarge, status_for
from mtc_replicator.transport.receiving import ItemInFlight
from mtc_replicator.transport.transfer import TransferError

Code = grpc.StatusCode


def store_error(err: int) -> StoreError:
    try:
        raise StoreError("cannot commit") from OSError(err, "boom")
    except StoreError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ManifestError("unsafe path '/etc'"), Code.INVALID_ARGUMENT),
        (TransferError("chunk at offset 9, expected 0"), Code.INVALID_ARGUMENT),
        (CorruptItem("crc32c mismatch"), Code.DATA_LOSS),
        (Refused("job x"), Code.FAILED_PRECONDITION),
        (NotHeld("gone"), Code.NOT_FOUND),
        (TooLarge("1 TiB"), Code.RESOURCE_EXHAUSTED),
        (Busy("being obtained"), Code.ABORTED),
        (ItemInFlight("in flight"), Code.ABORTED),
        (Cancelled("stopping"), Code.UNAVAILABLE),
        (store_error(errno.ENOSPC), Code.RESOURCE_EXHAUSTED),
        (store_error(errno.EIO), Code.INTERNAL),
        (FileExistsError(errno.EEXIST, "planted"), Code.INTERNAL),
        (RuntimeError("bug"), Code.INTERNAL),
    ],
)
def test_each_servicer_error_has_one_status(exc: Exception, code: Code) -> None:
    got, message = status_for(exc)
    assert got is code
    assert message


def rpc_error(code: Code, details: str = "details") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "kind", "retryable"),
    [
        (Code.DATA_LOSS, CorruptItem, None),
        (Code.NOT_FOUND, ItemNotFound, False),
        (Code.UNAVAILABLE, PeerUnavailable, True),
        (Code.DEADLINE_EXCEEDED, PeerUnavailable, True),
        (Code.ABORTED, ItemBusy, True),  # a PeerUnavailable: in flight there, try again
        (Code.RESOURCE_EXHAUSTED, PeerUnavailable, True),
        (Code.FAILED_PRECONDITION, PeerError, False),
        (Code.INVALID_ARGUMENT, PeerError, False),
        (Code.INTERNAL, PeerError, False),
    ],
)
def test_each_peer_status_becomes_one_of_our_errors(
    code: Code, kind: type[Exception], retryable: bool | None
) -> None:
    exc = _rpc_error(rpc_error(code, "why"), "10.0.0.7:7070", "push of j/s1/n0-w0")
    assert type(exc) is kind
    assert "10.0.0.7:7070" in str(exc)
    assert "why" in str(exc)
    if retryable is not None:
        assert isinstance(exc, PeerError)
        assert exc.retryable is retryable
        assert exc.code is code
