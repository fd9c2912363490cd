"""Whose bytes an item is: the producing node's signed word on its manifest. Pure.

At ingest the node that produced a step signs, with its TLS key, a statement naming the
item (job, step, rank, worker), its manifest's digest (every file's BLAKE3 digest in it),
the job's owner and itself (``Attestation``, beside the manifest's content). Every path
that brings an item into a restore or takes a push checks it (``ManifestTrust.check``):

- the signature holds, by a node certificate of the CA at the attestation's own time, and
  that certificate names the producer the attestation names: a certificate holder can
  attest only as itself;
- the owner is the restoring job's owner: a pod of another namespace that names the job
  restores nothing of it, from any tier (one-node jobs included, which have no registry);
- the producer held the item's rank, as the coordinator's record of rank holders says
  (``core.rank_holders``): a certificate holder's own items of a rank it never held,
  pushed to the rank's holders or claimed at a join, are never restored.

What the statement covers is ``payload(MANIFEST_KIND, ...)`` of ``core.signed``, so an
attestation cannot pass for a COMMIT or a registry entry, nor the other way round.
Without a verifier (TLS off) signatures are neither made nor checked, the owner still is.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from mtc_replicator.core.manifest import Attestation, CorruptItem, Manifest
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.signed import RecordRefused, Signature, Signer, payload

MANIFEST_KIND = "item-manifest"
UNSIGNED_REMEDY = (
    "written by a version before signed manifests, or forged by someone who can write the "
    "store, a peer or the bucket (--accept-unsigned-records accepts them while migrating)"
)


class Unattested(CorruptItem):
    """An item's manifest carries no attestation this node believes: treated as a bad copy
    (never used, another source is tried), and never deleted where it was already held."""


class Attested(StrEnum):
    """What a reader knows about an item it accepted."""

    VERIFIED = "verified"
    """Signed by the producing node's certificate of the CA."""
    UNSIGNED = "unsigned"
    """No signature, accepted by the migration flag."""
    UNCHECKED = "unchecked"
    """This node has no CA (TLS off): the owner is checked, the signature cannot be."""


class NodeVerifier(Protocol):
    def verify_node(self, payload: bytes, signature: Signature, at: float) -> str:
        """The node the signer's certificate names (``core.identity.LEGACY`` for a shared
        one); ``RecordRefused`` unless the signature holds for ``payload`` by a node
        certificate of the CA at wall-clock time ``at``."""
        ...


def statement(manifest: Manifest, owner: str, producer: str, created: float) -> bytes:
    """The bytes a producer signs for ``manifest``."""
    item = manifest.item
    body: dict[str, Any] = {
        "job": item.job,
        "step": item.step,
        "rank": item.rank,
        "worker": item.worker,
        "digest": manifest.digest,
        "owner": owner,
        "producer": producer,
        "created": created,
    }
    return payload(MANIFEST_KIND, body)


def attest(
    manifest: Manifest, owner: str, producer: str, created: float, signer: Signer | None
) -> Manifest:
    """``manifest`` with its producer's attestation (signed when ``signer`` is given)."""
    att = Attestation(owner, producer, created)
    if signer is not None:
        sig = signer.sign(statement(manifest, owner, producer, created))
        att = Attestation(owner, producer, created, sig.certificates, sig.value)
    return Manifest(
        manifest.item, manifest.kind, manifest.files, manifest.dirs, manifest.version, att
    )


@dataclass(frozen=True)
class ManifestTrust:
    """How this node attests the items it produces and which items it believes."""

    signer: Signer | None = None
    verifier: NodeVerifier | None = None
    producer: str = ""
    """This node's name (``core.identity``); "" without TLS or under a shared certificate."""
    accept_unsigned: bool = False
    """``--accept-unsigned-records``: take items with no signature (written before signed
    manifests) while migrating; a signature that fails is refused regardless."""

    def attest(self, manifest: Manifest, owner: str, now: float) -> Manifest:
        return attest(manifest, owner, self.producer, now, self.signer)

    def check(
        self, manifest: Manifest, owner: str, producers: Collection[str] | None = None
    ) -> Attested:
        """Whether to take ``manifest``'s item for a job owned by ``owner``. ``producers``:
        the nodes that have held the item's rank, as the coordinator knows them (None: not
        known); a signed copy counts only if one of them produced it. ``Unattested`` with
        the reason and the remedy when not."""
        att = manifest.attestation
        item = manifest.item
        if att is None or not att.signature:
            if self.verifier is not None and not self.accept_unsigned:
                raise Unattested(
                    f"{item}: its manifest is not signed by its producer: {UNSIGNED_REMEDY}"
                )
            if att is not None:
                self._check_owner(manifest, att, owner)
            return Attested.UNCHECKED if self.verifier is None else Attested.UNSIGNED
        self._check_owner(manifest, att, owner)
        if self.verifier is None:
            return Attested.UNCHECKED
        signed = statement(manifest, att.owner, att.producer, att.created)
        try:
            node = self.verifier.verify_node(
                signed, Signature(att.certificates, att.signature), att.created
            )
        except RecordRefused as exc:
            raise Unattested(f"{item}: its manifest's signature is refused: {exc}") from None
        if node != att.producer:
            raise Unattested(
                f"{item}: its manifest says node {att.producer[:100]!r} produced it, but "
                f"node {node[:100]!r} signed it"
            )
        if producers is not None and att.producer not in producers:
            held = ", ".join(sorted(p or "(shared certificate)" for p in producers)[:8])
            raise Unattested(
                f"{item}: produced by node {att.producer[:100]!r}, which never held rank "
                f"{item.rank} by step {item.step} (held by: {held[:300] or 'none known'})"
            )
        return Attested.VERIFIED

    @staticmethod
    def _check_owner(manifest: Manifest, att: Attestation, owner: str) -> None:
        if owner not in (UNOWNED, att.owner):
            raise Unattested(
                f"{manifest.item}: it belongs to owner {att.owner[:100]!r}, not to this job's "
                f"owner {owner[:100]!r}: another namespace's checkpoint is never restored"
            )


OPEN_MANIFESTS = ManifestTrust()
"""Neither signs nor checks signatures: processes without TLS, tests of other things."""
