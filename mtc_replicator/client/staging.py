"""Host snapshots of a state dict, in staging buffers allocated once and reused.

Owns: turning a (nested) state dict into a copy whose tensors live in buffers this module
keeps between saves, so that an asynchronous save can serialize the copy while the training
loop changes the originals. No file I/O; torch is imported when a ``Staging`` is made.

Buffers are keyed by the tensor's place in the tree (its keys and indices) and reused while
its shape and dtype stay the same; one that changes is reallocated, one that disappears is
freed, so the extra host memory is one copy of the current state's tensors. Tensors on a
CUDA device are copied into PINNED buffers (pageable memory registered with
``cudaHostRegister``, the exact size, rather than torch's caching host allocator, which
rounds every block up to a power of two) with ``non_blocking`` copies on a side stream; an
event recorded after them is what the writer waits on, and the device's current stream
waits on it too, so no later kernel on that stream writes a tensor before it was copied.
CPU tensors are copied at once. Tensors on other accelerators are copied synchronously.

One tensor object found twice in the tree is staged once (tied weights stay tied in the
file); two views of one storage are staged as two tensors. A non-contiguous tensor is
staged contiguous. Values that are not tensors, mappings, lists or tuples are deep-copied.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

Path_ = tuple[object, ...]
"""A tensor's place in the tree: the keys and indices that lead to it."""

_REGISTER_MIN_BYTES = 1 << 16
"""Below this a buffer comes from torch's pinned allocator: registering costs more than
the rounding wastes."""


@dataclass
class Snapshot:
    """The staged copy of one state dict."""

    tree: Any
    """The state dict with every tensor replaced by its staging buffer."""
    nbytes: int
    """Bytes of tensor data copied."""
    device_bytes: int
    """Of those, bytes copied from a device (CUDA, or a stand-in: see ``Staging``)."""
    waits: list[Callable[[], None]] = field(default_factory=list)
    """Block until the device copies have landed in host memory."""

    def ready(self) -> None:
        """Wait for every device copy; after this the buffers hold the snapshot."""
        for wait in self.waits:
            wait()
        self.waits.clear()


@dataclass
class _Walk:
    """What one snapshot's walk over the tree gathers."""

    seen: set[Path_] = field(default_factory=set)
    memo: dict[int, Any] = field(default_factory=dict)
    """Tensors staged so far, by ``id``: one object found twice is staged once."""
    pending: dict[Any, list[tuple[Any, Any]]] = field(default_factory=dict)
    """Device copies to enqueue, ``(buffer, tensor)`` by device."""
    nbytes: int = 0
    device_bytes: int = 0


@dataclass
class _Buffer:
    tensor: Any
    for_device: bool
    """Staged a device tensor (pinned where a pinned allocator exists)."""
    registered: bool = False
    """Pinned by ``cudaHostRegister``: unregistered when dropped."""


class Staging:
    """Staging buffers for one state dict's tensors, reused from one snapshot to the next.

    ``offload``: device types whose tensors go to pinned buffers through the device path
    (default ``{"cuda"}``). Tests pass ``{"cpu"}`` to run that path with CPU tensors standing
    in; where no pinned allocator exists (CPU-only torch) its buffers are pageable.
    Not thread-safe: one snapshot at a time, and none while a previous one is being written.
    """

    def __init__(self, *, offload: Collection[str] = ("cuda",)) -> None:
        import torch

        self._torch = torch
        self._offload = frozenset(offload)
        self._buffers: dict[Path_, _Buffer] = {}
        self._streams: dict[Any, Any] = {}
        self._pinnable: bool | None = None
        self.allocations = 0
        """Buffers allocated so far: grows only when the state's layout changes."""

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold now."""
        return sum(int(b.tensor.untyped_storage().nbytes()) for b in self._buffers.values())

    def buffers(self) -> dict[Path_, Any]:
        """The staging tensors by their place in the tree (for tests and accounting)."""
        return {path: b.tensor for path, b in self._buffers.items()}

    def snapshot(self, state: Mapping[str, Any]) -> Snapshot:
        """Copy ``state`` into the staging buffers and return the staged tree.

        Host copies are done when this returns; device copies are enqueued (call
        ``Snapshot.ready`` before reading the buffers). Buffers of tensors no longer in the
        state are freed.
        """
        walk = _Walk()
        with self._torch.no_grad():
            tree = self._stage(state, (), walk)
            snap = Snapshot(tree, walk.nbytes, walk.device_bytes)
            for device, pairs in walk.pending.items():
                snap.waits.append(self._copy_from_device(device, pairs))
        for path in [p for p in self._buffers if p not in walk.seen]:
            self._free(self._buffers.pop(path))
        return snap

    def release(self) -> None:
        """Free every buffer (unpinning the registered ones)."""
        for buffer in self._buffers.values():
            self._free(buffer)
        self._buffers.clear()

    # --- the tree ---------------------------------------------------------------------------

    def _stage(self, node: Any, path: Path_, walk: _Walk) -> Any:
        if isinstance(node, self._torch.Tensor):
            return self._stage_tensor(node, path, walk)
        if isinstance(node, Mapping):
            out = OrderedDict() if isinstance(node, OrderedDict) else {}
            for key, value in node.items():
                out[key] = self._stage(value, (*path, key), walk)
            return out
        if type(node) in (list, tuple):
            items = [self._stage(v, (*path, i), walk) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return copy.deepcopy(node)

    def _stage_tensor(self, tensor: Any, path: Path_, walk: _Walk) -> Any:
        if id(tensor) in walk.memo:
            return walk.memo[id(tensor)]
        buffer = self._buffer_for(path, tensor)
        walk.seen.add(path)
        nbytes = tensor.numel() * tensor.element_size()
        walk.nbytes += nbytes
        if tensor.device.type in self._offload:
            walk.pending.setdefault(tensor.device, []).append((buffer, tensor))
            walk.device_bytes += nbytes
        else:
            buffer.copy_(tensor)
        walk.memo[id(tensor)] = buffer
        return buffer

    # --- buffers ----------------------------------------------------------------------------

    def _buffer_for(self, path: Path_, tensor: Any) -> Any:
        pinned = tensor.device.type in self._offload
        held = self._buffers.get(path)
        if held is not None:
            t = held.tensor
            if t.shape == tensor.shape and t.dtype == tensor.dtype and pinned == held.for_device:
                return t
            self._free(self._buffers.pop(path))
        buffer = self._allocate(tensor, pinned)
        self._buffers[path] = buffer
        self.allocations += 1
        return buffer.tensor

    def _allocate(self, tensor: Any, pinned: bool) -> _Buffer:
        torch = self._torch
        shape, dtype = tensor.shape, tensor.dtype
        if not pinned or not self._can_pin():
            return _Buffer(torch.empty(shape, dtype=dtype), for_device=pinned)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < _REGISTER_MIN_BYTES or not torch.cuda.is_available():
            return _Buffer(torch.empty(shape, dtype=dtype, pin_memory=True), for_device=True)
        buffer = torch.empty(shape, dtype=dtype)
        cudart = torch.cuda.cudart()
        status = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if status != 0:
            raise RuntimeError(
                f"cudaHostRegister of a {nbytes}-byte staging buffer: error {status}"
            )
        return _Buffer(buffer, for_device=True, registered=True)

    def _can_pin(self) -> bool:
        """Whether this torch has a pinned allocator (CPU-only builds raise on a pin)."""
        if self._pinnable is None:
            try:
                self._torch.empty(1, pin_memory=True)
                self._pinnable = True
            except RuntimeError as exc:
                log.info("no pinned memory here (%s): staging device tensors in pageable", exc)
                self._pinnable = False
        return self._pinnable

    def _free(self, buffer: _Buffer) -> None:
        if buffer.registered:
            cudart = self._torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(buffer.tensor.data_ptr())
            buffer.registered = False

    # --- device copies ----------------------------------------------------------------------

    def _copy_from_device(self, device: Any, pairs: list[tuple[Any, Any]]) -> Callable[[], None]:
        """Enqueue ``dst.copy_(src)`` for every pair; a function that waits for them."""
        torch = self._torch
        if device.type != "cuda":
            # A device without CUDA's streams and events here (or the CPU standing in for
            # one): the copies are synchronous, and done when this returns.
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return lambda: None
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)  # the copies see every kernel queued so far
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(side)  # the allocator keeps src until the copy has read it
        done = torch.cuda.Event()
        done.record(side)
        current.wait_event(done)  # later kernels on the loop's stream wait for the copy
        return done.synchronize  # type: ignore[no-any-return]
