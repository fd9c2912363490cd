"""The registry: where job J's coordinator listens. I/O module (through an ObjectStore).

One small JSON object per job, ``_registry/<job>.json``, on any ``ObjectStore``: a
``file://`` directory for local runs and tests, the backup bucket (``gs://``, ``s3://``) in
production. ``_registry`` can never be a job's backup prefix: job names start with a letter
or digit. An entry only says where to look. It is never trusted: the coordinator answers
every call with its job and id, and an agent that reaches one that does not serve its job
looks the registry up again (docs/architecture.md, "Rounds and incarnations").

An entry also records the job's owner (``core.ownership``): ``claim`` creates it
create-only, and replaces it only for a rank 0 of the same owner, so a pod of another
namespace cannot move a job's coordinator to its own node. Within one owner the newest
registration wins, because the newest coordinator is the one to find and object stores
offer no portable compare-and-swap; a stale entry costs an agent one failed call and a
re-lookup, never a wrong join. Entries are never deleted by the daemon: an entry whose
coordinator is gone keeps the job name its owner's. Readers never see half an entry: every
backend publishes a whole object at once (temp + rename for files).

Entries are signed by the registering node (``core.signed``, the whole entry, so every
field, the owner included, is covered): with TLS on, an unsigned or forged entry is refused
(``RefusedEntry``) and never dialled. An entry that is malformed or refused names no owner
anyone can check, so it is nobody's to *take*: a rank 0 refuses to claim over it
(``BlockedName``), whoever it is, until an operator looks at it and releases the name
(``mtc registry release``, which calls ``inspect`` and ``release``). Only bucket writers
can plant such an entry, and they could delete the job's backups anyway; what they can no
longer do is hand the name, and with it the job's ranks, to another namespace.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import uuid
from dataclasses import dataclass

from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.jsonobj import NotAnObject, load_object
from mtc_replicator.core.ownership import UNOWNED, BadOwner, check_owner, may_claim
from mtc_replicator.core.retry import DEFAULT_STORAGE_TIMEOUT
from mtc_replicator.core.signed import OPEN, REGISTRY_KIND, RecordRefused, RecordTrust
from mtc_replicator.storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed
from mtc_replicator.storage.stores import open_object_store

log = logging.getLogger(__name__)

PREFIX = "_registry/"
FORMAT_VERSION = 1
MAX_ENTRY_BYTES = 32 * 1024
"""An entry is about 150 bytes, 1-3 KiB signed; a larger object is not one of ours."""
COORDINATOR_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HOSTNAME_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_FIELDS = ("job", "address", "coordinator_id", "registered_at")


class MalformedEntry(ValueError):
    """A registry entry (or one being registered) breaks a rule; the message names it."""


class RefusedEntry(MalformedEntry):
    """A registry entry is well formed but not signed by a node of the stack."""


class OwnedByAnother(Exception):
    """The job's registry entry belongs to another owner: this rank 0 may not take it."""

    remedy = "Choose another job name"
    """What the job's owner does about it (``replicator.failed`` says it)."""


class BlockedName(OwnedByAnother):
    """The job's registry entry is malformed or not signed by a node: it names nobody who
    can be checked, so no rank 0 takes the name until an operator releases it."""

    remedy = (
        "An operator checks the entry and releases the name (mtc registry release URL "
        "--job JOB, docs/cli.md), then restarts the job"
    )


def check_job(job: str) -> str:
    if not is_job_name(job):
        raise MalformedEntry(f"bad job name {job!r:.80}")
    return job


def check_address(address: str) -> str:
    """``host:port`` with a DNS name, an IPv4 address or a bracketed IPv6 address."""
    if not isinstance(address, str) or len(address) > 261:
        raise MalformedEntry(f"bad address {address!r:.80}")
    host, sep, port = address.rpartition(":")
    if not sep or not _PORT_RE.fullmatch(port) or int(port) > 65535:
        raise MalformedEntry(f"address {address!r:.80} needs host:port with a port 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise MalformedEntry(f"bad IPv6 address in {address!r:.80}") from None
        return address
    labels = host.split(".")
    if len(host) > 253 or not all(_HOSTNAME_LABEL_RE.fullmatch(label) for label in labels):
        raise MalformedEntry(f"bad host in address {address!r:.80}")
    return address


def new_coordinator_id() -> str:
    """A random id for one coordinator's life (it tells a restarted coordinator apart)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class RegistryEntry:
    """Job ``job``'s coordinator listens at ``address``; validated on construction."""

    job: str
    address: str
    """``host:port`` of the coordinator's gRPC server, as agents must dial it."""
    coordinator_id: str
    """Random per coordinator life; the coordinator returns it with every answer."""
    registered_at: float
    """Wall-clock seconds of the registration, for diagnostics (clocks differ by node)."""
    owner: str = UNOWNED
    """The job's owner (a namespace); absent in entries written before owners: unowned."""

    def __post_init__(self) -> None:
        check_job(self.job)
        try:
            check_owner(self.owner)
        except BadOwner as exc:
            raise MalformedEntry(str(exc)) from None
        check_address(self.address)
        if not isinstance(self.coordinator_id, str) or not COORDINATOR_ID_RE.fullmatch(
            self.coordinator_id
        ):
            raise MalformedEntry(f"bad coordinator id {self.coordinator_id!r:.80}")
        at = self.registered_at
        number = isinstance(at, int | float) and not isinstance(at, bool)
        if not number or not math.isfinite(at) or at < 0:
            raise MalformedEntry(f"bad registration time {at!r:.40}")

    def body(self) -> dict[str, object]:
        """Every field as stored: what a signature covers (``Registry.register``)."""
        return {
            "version": FORMAT_VERSION,
            "job": self.job,
            "address": self.address,
            "coordinator_id": self.coordinator_id,
            "registered_at": self.registered_at,
            "owner": self.owner,
        }

    def to_json(self, trust: RecordTrust = OPEN) -> bytes:
        """The stored bytes, signed when ``trust`` can sign."""
        return trust.seal(REGISTRY_KIND, self.body())

    @classmethod
    def from_json(cls, raw: bytes) -> RegistryEntry:
        """Parse an entry from storage anyone with bucket access may have written."""
        try:
            data = load_object(raw, MAX_ENTRY_BYTES)
        except NotAnObject as exc:
            raise MalformedEntry(str(exc)) from None
        version = data.get("version")
        if type(version) is not int or version != FORMAT_VERSION:  # true == 1 in Python
            raise MalformedEntry(f"unsupported version {version!r:.40}")
        missing = [k for k in _FIELDS if k not in data]
        if missing:
            raise MalformedEntry(f"missing {', '.join(missing)}")
        # Types and values are checked in __post_init__, before anything else looks at them.
        return cls(
            job=data["job"],
            address=data["address"],
            coordinator_id=data["coordinator_id"],
            registered_at=data["registered_at"],
            owner=data.get("owner", UNOWNED),
        )


def entry_key(job: str) -> str:
    return f"{PREFIX}{check_job(job)}.json"


class Registry:
    """Coordinator addresses by job, on one ObjectStore.

    Store errors other than "not found" (``ObjectStoreError``) propagate: the caller retries
    with backoff, and says "registry unreachable" rather than "no coordinator yet".
    """

    def __init__(self, objects: ObjectStore, trust: RecordTrust = OPEN) -> None:
        self.objects = objects
        self.trust = trust
        """Signs what ``register`` writes, and decides which entries ``lookup`` believes."""

    @property
    def url(self) -> str:
        return self.objects.url

    def claim(self, entry: RegistryEntry) -> None:
        """Publish ``entry`` for its job unless the job belongs to another owner.

        The first registration of a job is a create-only write, so of two first claims one
        wins and the other compares owners with it. An existing entry is replaced only when
        ``core.ownership.may_claim`` allows it; raises ``OwnedByAnother`` otherwise, leaving
        the entry as it was. A malformed entry, or one ``trust`` refuses, raises
        ``BlockedName``: it may be the real owner's entry overwritten by a bucket writer, so
        nobody takes the name over it until an operator releases it. Replacing after the read is
        not atomic: an entry deleted and re-created by another owner in between would be
        overwritten, but daemons never delete entries, so only a bucket writer can open
        that gap.
        """
        key = entry_key(entry.job)
        data = entry.to_json(self.trust)
        for _ in range(3):
            try:
                self.objects.put_bytes(key, data, if_absent=True)
                break
            except PreconditionFailed:
                pass
            try:
                raw = self.objects.get_bytes(key)
            except ObjectNotFound:
                continue  # gone since the create failed: try creating it again
            try:
                current = self._parse_strict(key, entry.job, raw)
            except MalformedEntry as exc:
                raise BlockedName(
                    f"job {entry.job}'s registry entry {key} in {self.url} is unusable ({exc}); "
                    "it may be the job's own entry overwritten by someone with write access "
                    "to the bucket, so no rank 0 registers over it"
                ) from None
            if not may_claim(current.owner, entry.owner):
                raise OwnedByAnother(
                    f"job {entry.job} is registered to another owner; a job name belongs to "
                    "the namespace that first ran it"
                )
            self.objects.put_bytes(key, data)
            break
        else:
            raise OwnedByAnother(f"job {entry.job}'s registry entry keeps changing; try again")
        log.info(
            "registered coordinator job=%s address=%s id=%s owner=%s",
            entry.job,
            entry.address,
            entry.coordinator_id,
            entry.owner or "(unowned)",
            extra={"job": entry.job},
        )

    def register(self, entry: RegistryEntry) -> None:
        """Publish ``entry`` whoever owns the job (last writer wins): for tests and tools
        that stand in for a bucket writer; daemons ``claim``."""
        self.objects.put_bytes(entry_key(entry.job), entry.to_json(self.trust))

    def lookup(self, job: str) -> RegistryEntry | None:
        """The registered coordinator of ``job``, or None if none or the entry is malformed.

        A malformed entry is logged and treated as absent: agents keep waiting (and say so
        in ``replicator.errors``) until a coordinator registers over it. An entry ``trust``
        refuses raises ``RefusedEntry``: someone may be redirecting the job's ranks.
        """
        key = entry_key(job)
        try:
            raw = self.objects.get_bytes(key)
        except ObjectNotFound:
            return None
        return self._parse(key, job, raw)

    def _parse(self, key: str, job: str, raw: bytes) -> RegistryEntry | None:
        """The entry in ``raw``; None if malformed (logged); ``RefusedEntry`` if ``trust``
        refuses it."""
        try:
            return self._parse_strict(key, job, raw)
        except RefusedEntry:
            raise
        except MalformedEntry as exc:
            log.warning(
                "ignoring registry entry %s of job=%s: %s", key, job, exc, extra={"job": job}
            )
            return None

    def _parse_strict(self, key: str, job: str, raw: bytes) -> RegistryEntry:
        """The entry in ``raw``; ``MalformedEntry`` if malformed, ``RefusedEntry`` if
        ``trust`` refuses it."""
        entry = RegistryEntry.from_json(raw)
        if entry.job != job:
            raise MalformedEntry(f"it names job {entry.job}")
        try:
            self.trust.check(REGISTRY_KIND, raw, entry.registered_at)
        except RecordRefused as exc:
            raise RefusedEntry(f"refused the registry entry {key} of job {job}: {exc}") from None
        return entry


@dataclass(frozen=True)
class EntryState:
    """What is registered for a job, as an operator is shown it before releasing it."""

    key: str
    raw: bytes | None
    """The stored bytes; None when there is no entry."""
    entry: RegistryEntry | None
    """The entry, when it is well formed and believed."""
    problem: str | None
    """Why it is not believed (malformed, or its signature refused)."""

    @property
    def blocked(self) -> bool:
        """No rank 0 registers over it: only an operator's release frees the name."""
        return self.raw is not None and self.entry is None


def inspect(registry: Registry, job: str) -> EntryState:
    """Read and judge job ``job``'s entry as a rank 0's claim would."""
    key = entry_key(job)
    try:
        raw = registry.objects.get_bytes(key)
    except ObjectNotFound:
        return EntryState(key, None, None, None)
    try:
        return EntryState(key, raw, registry._parse_strict(key, job, raw), None)
    except MalformedEntry as exc:
        return EntryState(key, raw, None, str(exc))


def release(registry: Registry, state: EntryState) -> bool:
    """Delete the entry ``state`` was read from if it is still those very bytes; False if it
    changed meanwhile (read-compare-delete is best effort on object stores)."""
    try:
        now = registry.objects.get_bytes(state.key)
    except ObjectNotFound:
        return state.raw is None
    if now != state.raw:
        return False
    registry.objects.delete(state.key)
    log.warning("released the job name: deleted registry entry %s", state.key)
    return True


def open_registry(
    url: str, trust: RecordTrust = OPEN, *, timeout: float = DEFAULT_STORAGE_TIMEOUT
) -> Registry:
    """The registry at a storage URL (``file:///abs/path``; gs:// and s3:// as the stores);
    ``timeout`` bounds each request with its retries (``--storage-timeout``)."""
    return Registry(open_object_store(url, timeout=timeout), trust)
