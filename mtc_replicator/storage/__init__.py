"""The backup tier: object stores and what the replicator keeps in them.

The small ``ObjectStore`` interface with its ``file://`` and in-memory implementations
(``objectstore``), opening one by URL (``stores``), the S3 and GCS adapters (``s3``,
``gcs``; each vendor SDK lives in its adapter only, and the two never import each other),
parallel parts and verified downloads (``parts``), items and COMMITs on a store
(``backup``), one rank's upload of a step (``upload``), one step downloaded into a
directory (``step_download``), the operators' list and verify
(``backup_audit``), restore pins, which the daemon also reads (``restore_pins``), and
prune's deletions (``backup_prune``; its policy is ``core.prune``). Imports ``local``,
``obs`` and ``core``.
"""
