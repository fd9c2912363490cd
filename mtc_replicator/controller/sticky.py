"""Sticky ranks: a training job's pods, each given the rank whose bytes its node holds.

kopf keeps an index of the pods that opt in (label ``checkpointing.mtc.dev/nodes``, watched
with a server-side selector) by job (``controller.jobpods``). When every index of a job has
its pod, each on a node with an IP, the controller asks those nodes' replicators what they
hold of the job (``mtc.v1.Node/Status``), assigns ranks (``core.ranks``), writes each pod's
rank and the assignment's id on the pod (annotations: the record that survives a controller
restart or a change of leader), then hands each node's replicator its pod's rank
(``mtc.v1.Node/AssignRank``), which writes ``jax-init-info.txt`` and ``mtc-rank.json`` into
CHECKPOINT_DIR for the workload. A node whose replicator cannot be asked makes the whole
job fall back to the pods' indexes (logged, counted): all or nothing. Calls to the
replicators carry the controller's certificate (``--tls-*``): a replicator takes
``AssignRank`` from that certificate only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import Counter

from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator._pb.mtc.v1 import node_pb2_grpc
from mtc_replicator.controller import jobpods
from mtc_replicator.controller.jobpods import Group, JobPod
from mtc_replicator.controller.plan import host_port, replicator_address
from mtc_replicator.core.ranks import Assignment, NoAssignment, Pod, assign
from mtc_replicator.transport.tls import TlsMaterial

log = logging.getLogger(__name__)

CALL_SECONDS = 5.0
NODE_STACK = "app.kubernetes.io/name=mtc-node"
GRPC_PORT_NAME = "grpc"

ASSIGNMENTS = Counter(
    "mtc_controller_rank_assignments_total",
    "Jobs whose pods were given ranks, by how: holdings (where the bytes are) or index "
    "(a fresh job, or the fallback when a node's replicator could not be asked)",
    ["source"],
)
RANKS = Counter(
    "mtc_controller_ranks_total",
    "Pods given a rank, by whether their node holds it at the step the restore will want",
    ["local"],
)


@dataclass(frozen=True)
class Plan:
    """One assignment: each pod's rank, and what the replicators are told."""

    ranks: Mapping[str, int]
    assignment: str
    source: str
    coordinator: str
    local: int
    by_index: int
    holders: tuple[str, ...] = ()
    """Each rank's node as its certificate names it, in rank order: the grant the nodes
    enforce (``core.grant``); empty when a node has no name (TLS off)."""


class Replicators:
    """The calls to the node stack's replicators, plaintext or with the controller's TLS."""

    def __init__(self, tls: TlsMaterial | None) -> None:
        self.tls = tls

    def _channel(self, address: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(
            address, self.tls.channel_credentials(), options=self.tls.channel_options()
        )

    def holdings(self, address: str, job: str) -> dict[int, set[int]]:
        """Rank -> the steps of ``job`` the node at ``address`` holds whole."""
        return self.status(address, job)[1]

    def status(self, address: str, job: str) -> tuple[str, dict[int, set[int]]]:
        """The node its certificate names ("" without TLS) and what it holds of ``job``."""
        with self._channel(address) as channel:
            reply = node_pb2_grpc.NodeStub(channel).Status(
                pb.NodeStatusRequest(job=job), timeout=CALL_SECONDS
            )
        held: dict[int, set[int]] = {}
        for j in reply.jobs:
            if j.job != job:
                continue
            if j.active and j.local_steps:
                held.setdefault(j.rank, set()).update(j.local_steps)
            for copy in j.peer_copies:
                held.setdefault(copy.rank, set()).update(copy.steps)
        return reply.node, held

    def assign(self, address: str, request: pb.AssignRankRequest) -> list[str]:
        with self._channel(address) as channel:
            reply = node_pb2_grpc.NodeStub(channel).AssignRank(request, timeout=CALL_SECONDS)
        return list(reply.written)


def replicator_addresses(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Node -> ``IP:PORT`` of the replicator's gRPC port, from the node stack's pods."""
    out: dict[str, str] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        address = replicator_address(pod, GRPC_PORT_NAME)
        if node and address:
            out[str(node)] = address
    return out


def plan(g: Group, mtc_job: str, addresses: Mapping[str, str], replicators: Replicators) -> Plan:
    """Ask the pods' nodes what they hold and assign; the indexes when any cannot be asked
    (all or nothing), or when the pods hold nothing of the job (a fresh start)."""
    nodes = g.pods[0].nodes
    missing = sorted({p.node for p in g.pods if p.node not in addresses})
    held: dict[str, dict[int, set[int]]] = {}
    names: dict[str, str] = {}
    why = f"no replicator known on nodes {missing}" if missing else ""
    if not missing:
        with ThreadPoolExecutor(min(32, len(g.pods)), thread_name_prefix="mtc-held") as pool:
            node_names = sorted({p.node for p in g.pods})
            futures = {
                n: pool.submit(replicators.status, addresses[n], mtc_job) for n in node_names
            }
            for n, f in futures.items():
                try:
                    names[n], held[n] = f.result()
                except grpc.RpcError as exc:
                    why = f"the replicator on node {n} could not be asked: {exc.code().name}"
                    break
    fixed = {p.name: p.rank for p in g.pods if p.rank is not None and p.assignment}
    pods = [Pod(p.name, p.index, p.node) for p in g.pods]
    a: Assignment | None = None
    if not why:
        try:
            a = assign(pods, held, nodes, fixed=fixed)
        except NoAssignment as exc:
            why = str(exc)
    if a is None or a.step is None:
        ranks = by_index(g.pods, fixed)
        source, local, by_index_count = "index", 0, 0
        if why:
            log.warning("%s/%s: ranks by index: %s", g.pods[0].namespace, g.pods[0].job, why)
    else:
        ranks, source, local, by_index_count = dict(a.ranks), "holdings", a.local, a.by_index
    return Plan(
        ranks,
        g.assignment_id,
        source,
        coordinator(g.pods, ranks),
        local,
        by_index_count,
        grant_holders(g.pods, ranks, names),
    )


def grant_holders(
    pods: Sequence[JobPod], ranks: Mapping[str, int], names: Mapping[str, str]
) -> tuple[str, ...]:
    """Each rank's node by its certificate's name, in rank order; () when any is unnamed."""
    by_rank = {ranks[p.name]: names.get(p.node, "") for p in pods}
    holders = tuple(by_rank.get(r, "") for r in range(len(pods)))
    return holders if all(holders) and len(set(holders)) == len(holders) else ()


def by_index(pods: Sequence[JobPod], fixed: Mapping[str, int]) -> dict[str, int]:
    """The fallback: running pods keep their ranks, the others take their index when free,
    else the lowest free rank."""
    ranks = dict(fixed)
    taken = set(ranks.values())
    for p in pods:
        if p.name not in ranks and p.index not in taken:
            ranks[p.name] = p.index
            taken.add(p.index)
    free = sorted(set(range(len(pods))) - taken)
    for p in pods:
        if p.name not in ranks:
            ranks[p.name] = free.pop(0)
    return ranks


def coordinator(pods: Sequence[JobPod], ranks: Mapping[str, int]) -> str:
    """The workload's coordinator: the pod that got rank 0, at its port."""
    first = next(p for p in pods if ranks[p.name] == 0)
    return host_port(first.ip, first.port)


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def lock_for(key: tuple[str, str]) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def deliver(
    pod: JobPod,
    rank: int,
    p: Plan,
    *,
    mtc_job: str,
    addresses: Mapping[str, str],
    replicators: Replicators,
) -> bool:
    """Tell ``pod``'s node its rank; False (logged) when the call failed: retried later."""
    address = addresses.get(pod.node)
    if address is None:
        log.warning("pod %s/%s: no replicator known on node %s", pod.namespace, pod.name, pod.node)
        return False
    request = pb.AssignRankRequest(
        job=mtc_job,
        pod_uid=pod.uid,
        rank=rank,
        nodes=pod.nodes,
        coordinator=p.coordinator,
        assignment=p.assignment,
        source=p.source,
        holders=list(p.holders),
    )
    try:
        replicators.assign(address, request)
    except grpc.RpcError as exc:
        log.warning(
            "pod %s/%s: node %s did not take rank %d: %s: %s",
            pod.namespace,
            pod.name,
            pod.node,
            rank,
            exc.code().name,
            exc.details(),
        )
        return False
    return True


def rank_annotations(rank: int, p: Plan) -> dict[str, str]:
    marks = {
        jobpods.RANK_ANNOTATION: str(rank),
        jobpods.ASSIGNMENT_ANNOTATION: p.assignment,
        jobpods.SOURCE_ANNOTATION: p.source,
    }
    if p.holders:  # the node this rank is granted to, so a new leader can hand the grant on
        marks[jobpods.HOLDER_ANNOTATION] = p.holders[rank]
    return marks


def count(p: Plan, pods: int) -> None:
    ASSIGNMENTS.labels(p.source).inc()
    RANKS.labels("true").inc(p.local)
    RANKS.labels("false").inc(pods - p.local)
