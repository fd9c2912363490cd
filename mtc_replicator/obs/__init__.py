"""Observability shared by both daemons: structured logs (``logs``) and Prometheus
metrics with their ``/metrics`` endpoint (``metrics``). Imports ``core`` only."""
