"""The per-node daemon process: one job incarnation at a time (``agent``) and the
``mtc-replicator`` process that watches CHECKPOINT_DIR, serves the gRPC port and hosts
coordinators (``daemon``), its parts wired once (``wiring``). Imports ``cluster`` and
everything below it."""
