"""mtc-csi: the CSI node plugin that gives training pods the node's CHECKPOINT_DIR.

At start it makes sure the RAM disk (a size-limited tmpfs on a host path) is mounted,
reusing one that already is so checkpoints outlive a plugin restart or upgrade; each
``NodePublishVolume`` bind-mounts its CHECKPOINT_DIR subdirectory into a pod, for one
namespace at a time (``mtc_replicator.csi.owner``). It reads no checkpoint data; it empties
CHECKPOINT_DIR when another namespace takes it over, and never touches the daemon's store.
"""
