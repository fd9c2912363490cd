"""mtc-csi: the CSI node plugin that gives training pods the node's RAM disk.

At start it makes sure the RAM disk (a size-limited tmpfs on a host path) is mounted,
reusing one that already is so checkpoints outlive a plugin restart or upgrade; each
``NodePublishVolume`` bind-mounts it into a pod. It never reads or writes checkpoint data.
"""
