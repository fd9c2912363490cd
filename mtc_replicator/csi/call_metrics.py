"""Prometheus metrics of the CSI plugin: one count and one duration per gRPC call.

Fed by the server's logging interceptor. ``CallMetrics`` records nothing (no ``--metrics``);
``PrometheusCallMetrics`` records on its own registry, which
``mtc_replicator.obs.metrics_endpoint.serve`` exposes. Labels are bounded: a method of the
Identity and Node services (unknown methods never reach the interceptor) and a status code
name. No I/O.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

CALL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Seconds: probes take microseconds, a mount milliseconds, a stuck mount much longer."""

# No ``*_created`` series (process-wide, read at scrape time).
disable_created_metrics()  # type: ignore[no-untyped-call]


class CallMetrics:
    """Records nothing."""

    def call(self, method: str, code: str, seconds: float) -> None:
        """A call to ``method`` (``NodePublishVolume``) ended with ``code`` (``OK``)."""


NO_CALL_METRICS = CallMetrics()


class PrometheusCallMetrics(CallMetrics):
    """``mtc_csi_calls_total{method, code}`` and ``mtc_csi_call_seconds{method}``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self._calls = Counter(
            "mtc_csi_calls",
            "CSI calls answered, by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            "mtc_csi_call_seconds",
            "Duration of CSI calls, by method.",
            ["method"],
            registry=self.registry,
            buckets=CALL_BUCKETS,
        )

    def call(self, method: str, code: str, seconds: float) -> None:
        self._calls.labels(method, code).inc()
        self._seconds.labels(method).observe(max(seconds, 0.0))
