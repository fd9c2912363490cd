"""This node's disk: the RAM disk the training job writes and the daemon's store on it.

Atomic publishing (``fsutil``), hashing and verifying an item's files (``hashing``), the
local tier's store with its ingest, staging, views and retention deletes (``store``), and
file events from inotify (``watcher``). Imports ``core`` only.
"""
