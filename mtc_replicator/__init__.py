"""mtc-replicator: a node-local, multi-tier checkpoint replicator for ML training jobs.

Importing the package imports nothing heavy: ``mtc_replicator/client/`` uses
``mtc_replicator.core.contract`` without pulling in gRPC, inotify or cloud SDKs.
"""

__version__ = "0.1.0"
