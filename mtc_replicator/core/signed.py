"""Signed records in the bucket (COMMITs, registry entries, restore pins and their used
records): their bytes and who is believed. Pure.

Whoever can write the bucket could otherwise choose what a job restores (a ``COMMIT``) or
where its ranks go (a registry entry). So a node signs each record it writes with its TLS
key and embeds its certificate; a reader believes a record only if the signature fits and
the certificate chains to the node stack's CA, with the node name, at the record's own time.

A signed record is the JSON object it always was plus one key, ``signature``::

    {"certificates": "<PEM chain, the signer's certificate first>", "value": "<base64>"}

What is signed is ``payload(kind, body)``: a tag naming the kind of record, then the
canonical JSON (sorted keys, no spaces, ASCII only) of every key but ``signature``, as the
reader parsed it. So every field is covered, fields added later included, nothing depends
on how the writer spaced or ordered its JSON, and a record of one kind cannot pass for
another. The cryptography lives in ``transport.signing``, behind ``Signer``/``Verifier``;
this module decides what is accepted (``RecordTrust``).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from mtc_replicator.core.jsonobj import NotAnObject, load_object
from mtc_replicator.core.manifest import ManifestError

SIGNATURE_KEY = "signature"
MAX_CERTIFICATES_BYTES = 16 * 1024
"""A node's chain is one or two certificates, about 1 KiB each."""
MAX_SIGNATURE_BYTES = 1024
"""ECDSA P-256 signatures are about 72 bytes, RSA-4096 512."""
_TAG = b"mtc-signed-record/1\n"

COMMIT_KIND = "commit"
REGISTRY_KIND = "registry-entry"
PIN_KIND = "restore-pin"
"""Signed by an operator, not a node (``transport.operator_signing``)."""
POOL_KIND = "pool-member"
"""A node's entry in the pool (``cluster.pool``), signed by that node."""
USED_PIN_KIND = "used-restore-pin"
"""A coordinator's record that it honoured a pin (``core.pin_use``), signed by its node."""


class RecordRefused(ManifestError):
    """A record is unsigned where a signature is required, or its signature does not hold."""


class Seal(StrEnum):
    """What a reader knows about a record it accepted."""

    VERIFIED = "verified"
    """Signed by a node certificate of the CA, valid at the record's time."""
    UNSIGNED = "unsigned"
    """No signature, accepted because the migration flag says so."""
    UNCHECKED = "unchecked"
    """The reader has no CA (TLS off): signatures are neither required nor checked."""


@dataclass(frozen=True)
class Signature:
    certificates: bytes
    """The signer's PEM chain, its own certificate first."""
    value: bytes


class Signer(Protocol):
    def sign(self, payload: bytes) -> Signature: ...


class Verifier(Protocol):
    def verify(self, payload: bytes, signature: Signature, at: float) -> None:
        """Raise ``RecordRefused`` unless ``signature`` holds for ``payload`` and its chain
        holds at wall-clock time ``at``."""
        ...


def payload(kind: str, body: Mapping[str, Any]) -> bytes:
    """The bytes signed for a record of ``kind`` whose keys (but the signature) are ``body``."""
    try:
        text = json.dumps(
            body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise RecordRefused(f"the {kind} has no canonical form: {exc}") from None
    return _TAG + kind.encode("ascii") + b"\n" + text.encode("ascii")


def split(kind: str, raw: bytes) -> tuple[dict[str, Any], Signature | None]:
    """A record's keys but the signature, and its signature if it has one."""
    try:
        data = load_object(raw)
    except NotAnObject as exc:
        raise RecordRefused(f"the {kind} is {exc}") from None
    block = data.pop(SIGNATURE_KEY, None)
    if block is None:
        return data, None
    if not isinstance(block, dict) or set(block) != {"certificates", "value"}:
        raise RecordRefused(f"the {kind}'s signature is malformed")
    certs, value = block["certificates"], block["value"]
    if not isinstance(certs, str) or not isinstance(value, str):
        raise RecordRefused(f"the {kind}'s signature is malformed")
    if len(certs) > MAX_CERTIFICATES_BYTES or len(value) > 2 * MAX_SIGNATURE_BYTES:
        raise RecordRefused(f"the {kind}'s signature is too large")
    try:
        decoded = base64.b64decode(value, validate=True)
        pem = certs.encode("ascii")
    except (binascii.Error, ValueError):
        raise RecordRefused(f"the {kind}'s signature is malformed") from None
    return data, Signature(pem, decoded)


def attach(body: Mapping[str, Any], signature: Signature | None) -> bytes:
    """The record's JSON: ``body``, with ``signature`` when there is one."""
    if SIGNATURE_KEY in body:
        raise ValueError(f"a record's own fields may not be named {SIGNATURE_KEY!r}")
    data = dict(body)
    if signature is not None:
        data[SIGNATURE_KEY] = {
            "certificates": signature.certificates.decode("ascii"),
            "value": base64.b64encode(signature.value).decode("ascii"),
        }
    return json.dumps(data, sort_keys=True).encode()


@dataclass(frozen=True)
class RecordTrust:
    """How this process writes and reads signed records.

    With a ``verifier`` (TLS on), a record without a signature is refused unless
    ``accept_unsigned`` (the migration flag), and one whose signature fails is always
    refused: no version ever wrote a bad signature. Without one (TLS off), nothing is
    required or checked. With a ``signer``, every record written is signed.
    """

    signer: Signer | None = None
    verifier: Verifier | None = None
    accept_unsigned: bool = False

    def seal(self, kind: str, body: Mapping[str, Any]) -> bytes:
        """The bytes to store for a record of ``kind``: signed when this process can sign."""
        signature = None if self.signer is None else self.signer.sign(payload(kind, body))
        return attach(body, signature)

    def check(self, kind: str, raw: bytes, at: float) -> Seal:
        """Whether to believe the stored record ``raw``, whose own timestamp is ``at``.

        Raises ``RecordRefused`` (with what to do) when it is not to be believed.
        """
        body, signature = split(kind, raw)
        if self.verifier is None:
            return Seal.UNCHECKED
        if signature is None:
            if self.accept_unsigned:
                return Seal.UNSIGNED
            raise RecordRefused(
                f"the {kind} is not signed: written by a version before signed records, or "
                "forged by someone with write access to the bucket (--accept-unsigned-records "
                "accepts unsigned records while migrating)"
            )
        self.verifier.verify(payload(kind, body), signature, at)
        return Seal.VERIFIED


OPEN = RecordTrust()
"""Neither signs nor checks: processes without TLS material, and tests of other things."""
