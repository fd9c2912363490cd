"""The pure core: decisions as functions of state, with no I/O.

The workload contract (``contract``), item manifests (``manifest``), the bucket layout and
its COMMIT record (``backup_layout``), the peer layout and steady-state rules (``layout``),
the node's policy for hand-offs, retention and backup intervals (``policy``), the restore
round's plan (``restore_plan``), the coordinator's state machine (``coordination``) and the
one backoff schedule (``retry``).

Imports nothing but the standard library and PyYAML: no gRPC, no SDKs, no asyncio, threads
or sockets (an import-linter contract in ``pyproject.toml`` holds this). ``mtc_replicator/client/``
may import ``core.contract``.
"""
