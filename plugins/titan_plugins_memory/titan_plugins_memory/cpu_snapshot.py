"""Memory snapshots on the CPU: what one rank's tensors hold, in the CUDA snapshot's layout.

The CPU allocator keeps no segments and no history, so what a CPU snapshot can honestly give is a
tensor-level account of this rank, not the allocator's view:

Under the fake backends the rank's tensors are fake (no memory): they are accounted at the sizes
the real run would have, each storage once.

- every storage an operator created (or FSDP resized) since recording started and still alive,
  with the Python stack that allocated it (an :class:`~titan_plugins_memory.tracker.
  AllocationTracker` with a history);
- this rank's parameters, gradients, buffers and optimizer state (local shards of DTensors),
  named, even when they were allocated before recording started;
- the last allocation and free events (``device_traces``).

Memory outside torch tensors (the Python heap, libraries, allocator slack) is not in it; the
process RSS is recorded beside it for comparison. The pickle has the layout of
``torch.cuda.memory._snapshot()`` (``segments`` with one block per live storage, ``device_traces``
of events) plus a ``titan`` entry (rank, step, account), so ``titan memory view`` and
``torch.cuda._memory_viz``'s functions read it like a CUDA snapshot.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from titan_plugins_memory.report import local_shard, tensor_account
from titan_plugins_memory.tracker import AllocationTracker, storage_address

FORMAT = "titan-cpu-memory-snapshot"
VERSION = 1
NOTE = (
    "CPU snapshots account for torch tensors only (storages made by operators while recording, "
    "plus this rank's parameters, gradients, buffers and optimizer state), not the CPU allocator."
)


def _named_tensors(parts: list[nn.Module], optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = []
    names: dict[int, str] = {}
    for i, part in enumerate(parts):
        prefix = f"part{i}." if len(parts) > 1 else ""
        for name, p in part.named_parameters():
            names[id(p)] = prefix + name
            named.append((f"parameter {prefix}{name}", p))
            if p.grad is not None:
                named.append((f"gradient {prefix}{name}", p.grad))
        for name, b in part.named_buffers():
            named.append((f"buffer {prefix}{name}", b))
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    named.append((f"optimizer {key} of {names.get(id(p), '?')}", value))
    return named


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def build_snapshot(
    tracker: AllocationTracker | None,
    parts: list[nn.Module],
    optimizer: Any,
    *,
    rank: int,
    step: int,
    oom: bool = False,
    oom_request_bytes: int | None = None,
) -> dict[str, Any]:
    """The snapshot dict (``segments``, ``device_traces``, ``titan``)."""
    blocks: dict[int, dict[str, Any]] = {}
    for live in tracker.live() if tracker is not None else []:
        blocks[live["addr"]] = {"size": live["size"], "frames": list(live["frames"])}
    for name, t in _named_tensors(parts, optimizer):
        local = local_shard(t)
        storage = local.untyped_storage()
        size = storage.nbytes()
        if not size or (storage.device.type == "meta" and not isinstance(local, FakeTensor)):
            continue  # a meta tensor holds nothing; a fake one stands for real memory of its size
        addr = storage_address(storage)
        label = {"name": name, "filename": "<tensor account>", "line": 0}
        if addr in blocks:
            blocks[addr]["frames"].insert(0, label)
        else:
            blocks[addr] = {"size": size, "frames": [label]}
    segments = [
        {
            "device": 0,
            "address": addr,
            "total_size": b["size"],
            "allocated_size": b["size"],
            "active_size": b["size"],
            "requested_size": b["size"],
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": [
                {
                    "address": addr,
                    "size": b["size"],
                    "requested_size": b["size"],
                    "state": "active_allocated",
                    "frames": b["frames"],
                }
            ],
        }
        for addr, b in sorted(blocks.items())
    ]
    return {
        "segments": segments,
        "device_traces": [list(tracker.events) if tracker is not None else []],
        "allocator_settings": {},
        "titan": {
            "format": FORMAT,
            "version": VERSION,
            "device": "cpu",
            "rank": rank,
            "step": step,
            "oom": oom,
            "oom_request_bytes": oom_request_bytes,
            "account": {**tensor_account(parts, optimizer), "rss_bytes": _rss()},
            "note": NOTE,
        },
    }


def dump_snapshot(path: str, snapshot: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
