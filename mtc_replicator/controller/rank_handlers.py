"""kopf's handlers for sticky ranks: the index of the pods that opt in, by job, and the
event handler that assigns a job's ranks once all its pods are placed, then hands each
node its pod's rank (``controller.sticky``). A timer retries a hand-over that failed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from mtc_replicator.controller import jobpods, sticky
from mtc_replicator.controller.handlers import REGISTRY, kube
from mtc_replicator.controller.jobpods import BadPod, JobPod
from mtc_replicator.transport.tls import TlsMaterial

log = logging.getLogger(__name__)
POD = ("", "v1", "pods")
OPTED_IN = {jobpods.NODES_LABEL: kopf.PRESENT}
RETRY_SECONDS = float(os.environ.get("MTC_CONTROLLER_RANK_RETRY_SECONDS", "10"))
"""How often a pod whose node did not take its rank is tried again."""

_replicators = sticky.Replicators(None)


def use_tls(tls: TlsMaterial | None) -> None:
    """The controller's certificate for its calls to the replicators (``--tls-*``)."""
    global _replicators  # noqa: PLW0603 (set once at start, before kopf runs)
    _replicators = sticky.Replicators(tls)


def _member(body: Any) -> JobPod | None:
    try:
        return jobpods.job_pod(body)
    except BadPod as exc:
        log.warning("sticky ranks: %s", exc)
        return None


@kopf.index(*POD, labels=OPTED_IN, registry=REGISTRY)
def job_pods(body: kopf.Body, **_: Any) -> dict[tuple[str, str], JobPod] | None:
    member = _member(body)
    return None if member is None else {member.key: member}


@kopf.on.event(*POD, labels=OPTED_IN, registry=REGISTRY)
def on_job_pod(body: kopf.Body, **kwargs: Any) -> None:
    member = _member(body)
    if member is not None:
        settle(member, _indexed(kwargs, member))


@kopf.timer(*POD, labels=OPTED_IN, interval=RETRY_SECONDS, registry=REGISTRY)
def retry(body: kopf.Body, **kwargs: Any) -> None:
    member = _member(body)
    if member is not None and member.assignment and not member.delivered:
        settle(member, _indexed(kwargs, member))


def _indexed(kwargs: dict[str, Any], member: JobPod) -> list[JobPod]:
    """The members of ``member``'s job in kopf's index (passed as the ``job_pods`` kwarg)."""
    index: kopf.Index[tuple[str, str], JobPod] = kwargs["job_pods"]
    return list(index.get(member.key, []))


def settle(member: JobPod, indexed: list[JobPod]) -> None:
    """One step towards every pod of ``member``'s job holding a delivered rank."""
    with sticky.lock_for(member.key):
        # The index may lag the event at hand: this pod as it is now.
        members = [m for m in indexed if m.uid != member.uid] + [member]
        g = jobpods.group(members)
        if not g.ready:
            log.debug(
                "%s/%s: %s", member.namespace, member.job, g.why, extra={"job": member.mtc_job}
            )
            return
        if not g.assigned:
            # The index lags the annotations this controller wrote: a plan made from it
            # could differ from the one whose events are still queued, under the same id.
            # Plan only from the job's pods as the API server has them now.
            live = [_member(b) for b in kube().job_pods(member.namespace)]
            g = jobpods.group([m for m in live if m is not None and m.key == member.key])
            if not g.ready:
                return
        addresses = sticky.replicator_addresses(kube().node_stack_pods())
        if not g.assigned:
            p = sticky.plan(g, member.mtc_job, addresses, _replicators)
            for pod in g.pods:
                kube().annotate_pod(
                    pod.namespace, pod.name, sticky.rank_annotations(p.ranks[pod.name], p)
                )
            sticky.count(p, len(g.pods))
            log.info(
                "%s/%s: %d ranks assigned by %s (assignment %s): %d restore from their own "
                "node (%d had they kept their index)",
                member.namespace,
                member.job,
                len(g.pods),
                p.source,
                p.assignment,
                p.local,
                p.by_index,
                extra={"job": member.mtc_job},
            )
            return  # the annotations' events deliver
        ranks = {pod.name: pod.rank for pod in g.pods if pod.rank is not None}
        by_rank = {pod.rank: pod.holder for pod in g.pods if pod.rank is not None}
        holders = tuple(by_rank.get(r, "") for r in range(len(g.pods)))
        p = sticky.Plan(
            ranks,
            g.pods[0].assignment,
            g.pods[0].source or "index",
            sticky.coordinator(g.pods, ranks),
            0,
            0,
            holders if all(holders) else (),
        )
        for pod in g.pods:
            if pod.delivered or pod.rank is None:
                continue
            if sticky.deliver(
                pod,
                pod.rank,
                p,
                mtc_job=member.mtc_job,
                addresses=addresses,
                replicators=_replicators,
            ):
                kube().annotate_pod(
                    pod.namespace, pod.name, {jobpods.DELIVERED_ANNOTATION: p.assignment}
                )
