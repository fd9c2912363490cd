"""Leader election on a ``coordination.k8s.io/v1`` Lease: of the Deployment's replicas, the
holder reconciles and the others wait.

The rule client-go's leader election uses: a replica takes the Lease when it is free or
when its record (holder and renew time) has not changed for ``duration`` seconds of the
replica's own clock (so clocks of different nodes never have to agree); the holder renews it
every ``retry`` seconds and gives up, stopping the process, when it could not renew for
``renew_deadline`` seconds. Writes carry the resourceVersion read, so two replicas never
both win one round. A holder that stops cleanly frees the Lease at once.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Timing:
    duration: float = 15.0
    """How long a record may stay unchanged before another replica takes the Lease."""
    renew_deadline: float = 10.0
    """How long the holder keeps trying to renew before it stops."""
    retry: float = 2.0
    """How often replicas try to take or renew the Lease."""


class LeaseElector:
    """One replica's side of the election on Lease ``namespace/name``."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing = Timing(),
    ) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing
        self._seen: tuple[str | None, object] | None = None
        self._seen_at = 0.0
        self.leading = threading.Event()

    def _spec(self, transitions: int, acquired: datetime.datetime | None) -> client.V1LeaseSpec:
        now = _now()
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, round(self.timing.duration)),
            acquire_time=acquired or now,
            renew_time=now,
            lease_transitions=transitions,
        )

    def try_acquire(self) -> bool:
        """Take or renew the Lease; True while this replica holds it."""
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(0, None),
            )
            try:
                self.coord.create_namespaced_lease(self.namespace, body)
            except ApiException as create_exc:
                if create_exc.status == 409:  # another replica created it first
                    return False
                raise
            return True
        spec = lease.spec or client.V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time)
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        mine = spec.holder_identity == self.identity
        free = not spec.holder_identity
        expired = time.monotonic() - self._seen_at >= self.timing.duration
        if not (mine or free or expired):
            return False
        transitions = int(spec.lease_transitions or 0) + (0 if mine else 1)
        lease.spec = self._spec(transitions, spec.acquire_time if mine else None)
        try:
            self.coord.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            if exc.status == 409:  # someone else wrote it since we read it
                return False
            raise
        if not mine:
            log.info(
                "took the Lease %s/%s from %s",
                self.namespace,
                self.name,
                spec.holder_identity or "nobody",
            )
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Wait until this replica leads (True), or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    self.leading.set()
                    return True
            except ApiException as exc:
                log.warning("leader election: %s %s", exc.status, exc.reason)
            except Exception as exc:
                log.warning("leader election: %s", exc)
            stop.wait(self.timing.retry)
        return False

    def _renew(self, timeout: float) -> bool | None:
        """One renewal, given at most ``timeout`` seconds whatever the client does (a
        connection that is never answered blocks it for good); None: it did not end."""
        result: list[bool] = []

        def attempt() -> None:
            try:
                result.append(self.try_acquire())
            except ApiException as exc:
                log.warning("renewing the Lease: %s %s", exc.status, exc.reason)
                result.append(False)
            except Exception as exc:
                log.warning("renewing the Lease: %s", exc)
                result.append(False)

        t = threading.Thread(target=attempt, name="lease-renew", daemon=True)
        t.start()
        t.join(max(0.0, timeout))
        return result[0] if result else None

    def keep(self, stop: threading.Event, lost: threading.Event) -> None:
        """Renew until ``stop``; set ``lost`` when renewing failed for ``renew_deadline``."""
        last_ok = time.monotonic()
        while not stop.wait(self.timing.retry):
            left = last_ok + self.timing.renew_deadline - time.monotonic()
            done = self._renew(left)
            ok = bool(done)
            if done is None:  # still hanging at the deadline: stop leading now
                log.error("renewing the Lease %s/%s hung: stopping", self.namespace, self.name)
                self.leading.clear()
                lost.set()
                return
            if ok:
                last_ok = time.monotonic()
            elif not self._held_by_me() or time.monotonic() - last_ok > self.timing.renew_deadline:
                log.error("lost the Lease %s/%s: stopping", self.namespace, self.name)
                self.leading.clear()
                lost.set()
                return

    def _held_by_me(self) -> bool:
        return self._seen is not None and self._seen[0] == self.identity

    def release(self) -> None:
        """Free the Lease (a clean stop): the next replica need not wait for it to expire."""
        if not self.leading.is_set():
            return
        self.leading.clear()
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            self.coord.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            log.warning("releasing the Lease: %s %s", exc.status, exc.reason)
