"""Observability shared by both daemons: structured logs (``logs``), the figures of the
transfer log lines (``stopwatch``) and Prometheus metrics with their ``/metrics`` endpoint
(``metrics``). Imports ``core`` only."""
