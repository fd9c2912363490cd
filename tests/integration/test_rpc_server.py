"""The daemon's gRPC server (``transport.grpc_server.RpcServer``) under a burst of calls.

A 4,096-rank job's joins reach rank 0's daemon together, while its event loop is busy.
gRPC queues calls the server has not asked for yet and, by default, drops new ones at
random past 1,000 queued and all past 3,000; every dropped join cost a retry with backoff.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator.transport.grpc_server import RpcServer

BURST = 4000


def _burst(address: str, started: threading.Event, out: list[grpc.StatusCode]) -> None:
    """``BURST`` health checks at once from another thread's loop, each status noted."""

    async def calls() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await channel.channel_ready()
            pending = [
                stub.Check(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(BURST)
            ]
            started.set()
            for call in pending:
                try:
                    await call
                    out.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    out.append(exc.code())

    asyncio.run(calls())


def test_a_burst_of_calls_while_the_loop_is_busy_is_queued_not_dropped() -> None:
    statuses: list[grpc.StatusCode] = []

    async def scenario() -> None:
        server = RpcServer()
        address = server.bind("127.0.0.1:0")
        await server.start()
        await server.set_serving()
        started = threading.Event()
        client = threading.Thread(target=_burst, args=(address, started, statuses))
        client.start()
        try:
            await asyncio.to_thread(started.wait, 30)
            # The loop is busy while the calls arrive: they queue in gRPC, unasked for.
            time.sleep(1.5)  # noqa: ASYNC251 (blocking the loop is the point)
            await asyncio.to_thread(client.join, 60)
        finally:
            await server.stop(0.5)
            client.join(60)

    asyncio.run(scenario())
    refused = {
        code: statuses.count(code) for code in set(statuses) if code is not grpc.StatusCode.OK
    }
    assert len(statuses) == BURST
    assert refused == {}, f"calls refused while queued: {refused}"
