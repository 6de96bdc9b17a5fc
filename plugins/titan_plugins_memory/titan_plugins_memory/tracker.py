"""What operators allocate while a dispatch mode is active: bytes current and peak, and a history.

The CPU has no caching allocator that keeps statistics or a history, so titan follows the
storages operators create instead. :class:`AllocationTracker` is a ``TorchDispatchMode`` below
DTensor (DTensor ops are let through to their local ops): it sees every operator's outputs and
remembers each new storage (not one of the operator's inputs: views, in-place operators and
``detach`` return those) by a weak reference whose callback subtracts its bytes when it is freed.
``UntypedStorage.resize_`` is wrapped while active because FSDP allocates and frees its
all-gather buffers by resizing storages in place.

Under fake execution (a run whose tensors are FakeTensors of one ``FakeTensorMode``) the fake
storages stand for real memory and are counted, except those DTensor's sharding propagation
makes: it runs each new operator once on fake tensors of the *global* shape, in the active fake
mode (``ShardingPropagator._propagate_tensor_meta_non_cached``, private; pinned by
``tests/core/test_private_torch_apis.py``), which nothing of the run allocates. The tracker
pauses while it runs.

With ``history`` > 0 it also keeps the last ``history`` allocation and free events with the
Python stack that made each allocation, in the event format of
``torch.cuda.memory._snapshot()["device_traces"]`` (``action``, ``addr``, ``size``, ``frames``,
``time_us``), which :mod:`titan_plugins_memory.cpu_snapshot` turns into a snapshot.

``TorchDispatchMode`` lives in the private ``torch.utils._python_dispatch``; it is the mechanism
PyTorch's own memory tools (``torch.distributed._tools.mem_tracker``) use, unchanged across torch
2.11-2.14.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Python frames kept per allocation (innermost first), as the CUDA allocator's history does.
MAX_FRAMES = 24
_THIS_FILE = __file__.removesuffix("c")
#: Files of the dispatch machinery between an operator call and this mode: not the caller's stack.
_MACHINERY = (
    "_python_dispatch.py",
    "torch/_compile.py",
    "_dynamo/eval_frame.py",
    "torch/_ops.py",
    "_dynamo/external_utils.py",
)


def python_frames(skip: int = 1) -> list[dict[str, Any]]:
    """The caller's Python stack, innermost first, without this module's and the dispatcher's frames."""
    frames: list[dict[str, Any]] = []
    frame = sys._getframe(skip)
    while frame is not None and len(frames) < MAX_FRAMES:
        code = frame.f_code
        filename = code.co_filename
        if filename != _THIS_FILE and not filename.endswith(_MACHINERY):
            frames.append({"filename": filename, "line": frame.f_lineno, "name": code.co_name})
        frame = frame.f_back
    return frames


def storage_address(storage: torch.UntypedStorage) -> int:
    """Where the storage lives; one without an address (a fake tensor's meta storage, a
    functional collective's wrapper) is named by its storage object's identity in C++
    (``_cdata``, private; pinned by tests/core/test_private_torch_apis.py), the same for every
    tensor that views it, while Python's wrapper objects come and go."""
    if storage.device.type == "meta":
        return storage._cdata
    try:
        return storage.data_ptr()
    except RuntimeError:  # "invalid python storage"
        return storage._cdata


class AllocationTracker(TorchDispatchMode):
    """Bytes of the storages operators create (or resize) while active, current and peak."""

    def __init__(self, history: int = 0, fake_mode: Any = None) -> None:
        super().__init__()
        #: The FakeTensorMode the run executes under, if any: its fake tensors stand for real
        #: memory and are counted. Other fake tensors (DTensor's sharding propagation makes some
        #: to infer shapes) hold nothing and are not.
        self.fake_mode = fake_mode
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._addrs: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize: Any = None
        self._orig_propagate: Any = None
        #: > 0 while DTensor's sharding propagation runs (its tensors are not the run's).
        self._paused = 0
        self.history = history
        #: Allocation and free events (``device_traces`` format), the last ``history`` of them.
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=history or 1)
        #: The Python stack of every live storage allocated while recording (by storage key).
        self.frames: dict[int, list[dict[str, Any]]] = {}

    # -- bookkeeping --------------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage, fake: bool = False) -> None:
        key = id(storage)
        # Meta storages hold no memory, except those of fake tensors standing for real ones
        # (FakeTensorMode execution: the shapes and sizes are the real run's).
        if key in self._sizes or (storage.device.type == "meta" and not fake):
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self._addrs[key] = storage_address(storage) if self.history else 0
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self._grow(nbytes)
        if self.history and nbytes:
            frames = python_frames(3)
            self.frames[key] = frames
            self._event("alloc", self._addrs[key], nbytes, frames)

    def _freed(self, key: int, _ref: Any) -> None:
        nbytes = self._sizes.pop(key, 0)
        addr = self._addrs.pop(key, 0)
        self.current -= nbytes
        self._refs.pop(key, None)
        frames = self.frames.pop(key, [])
        if self.history and nbytes:
            self._event("free_completed", addr, nbytes, frames)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _event(self, action: str, addr: int, size: int, frames: list[dict[str, Any]]) -> None:
        self.events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "frames": frames,
                "time_us": time.time_ns() // 1000,
            }
        )

    def live(self) -> list[dict[str, Any]]:
        """The storages allocated while active and still alive: address, size, stack."""
        return [
            {"addr": self._addrs[k], "size": size, "frames": self.frames.get(k, [])}
            for k, size in self._sizes.items()
            if size
        ]

    # -- the mode -------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor unwrap; its local ops come back here
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        inputs = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                storage = t.untyped_storage()
                if id(storage) in self._sizes:
                    continue
                if inputs is None:  # views, in-place ops and detach return an input's storage
                    inputs = {
                        id(a.untyped_storage())
                        for a in tree_leaves((args, kwargs))
                        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                    }
                if id(storage) not in inputs:
                    fake = (
                        self.fake_mode is not None
                        and isinstance(t, FakeTensor)
                        and t.fake_mode is self.fake_mode
                    )
                    self._add(storage, fake=fake)
        return out

    def __enter__(self) -> AllocationTracker:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            if tracker._paused:
                return orig(storage, size)
            key, before = id(storage), storage.nbytes()
            addr = storage_address(storage) if tracker.history else 0
            result = orig(storage, size)
            if key in tracker._sizes:
                after = storage.nbytes()
                tracker._sizes[key] = after
                tracker._grow(after - before)
                if tracker.history:
                    if before:
                        tracker._event("free_completed", addr, before, tracker.frames.get(key, []))
                    tracker._addrs[key] = storage_address(storage)
                    if after:
                        frames = python_frames(2)
                        tracker.frames[key] = frames
                        tracker._event("alloc", tracker._addrs[key], after, frames)
            else:
                # Under fake execution a resized meta storage is a fake tensor's standing for
                # real memory (FSDP's unsharded parameters are allocated this way).
                tracker._add(storage, fake=tracker.fake_mode is not None)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._orig_propagate = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def paused_propagate(propagator: Any, op_schema: Any) -> Any:
            tracker._paused += 1
            try:
                return propagate(propagator, op_schema)
            finally:
                tracker._paused -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = paused_propagate  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate  # type: ignore[method-assign]
        super().__exit__(*exc)
