"""What PyTorch holds on this rank at the four observation points of a memory investigation.

The points (docs/debugging.md, "Memory debugging workflow"):

1. ``after_init``: model shards materialised and initialised, optimizer built (no state yet);
2. ``after_first_optimizer_step``: step 1 complete, so optimizer state exists;
3. ``steady_forward_backward``: the peak of the forward/backward of the steady step;
4. ``after_optimizer_step``: the steady step complete.

The steady step is step 2 when the run has two steps or more, else the only step (a one-step
fake run observes step 1 at points 2-4).

On CUDA the figures come from the caching allocator (``torch.cuda.memory_stats``: allocated and
reserved, current and peak; the peak of point 3 is reset just before that forward/backward), and
a snapshot for https://pytorch.org/memory_viz is written when ``profiler.enable_memory_snapshot``
is on. On CPU there is no allocator to ask, so tensors are accounted: parameters, buffers,
gradients and optimizer state are counted directly (local shards of DTensors), and during steps
1..steady an :class:`AllocationTracker` follows every storage created (or resized) by an operator
until it is freed; what it holds at its peak is added to what was accounted when the step began.
(``torch.distributed._tools.mem_tracker.MemTracker`` does the same with categories, but refuses
a module called twice in one step, which every pipeline microbatch does.)

Every rank writes ``memory_report_rank{logical_rank}.json`` under ``job.dump_folder`` and prints a
table. The report is on under the fake comm backends and when ``debug.memory_report`` is set;
otherwise the trainer holds ``None`` and the loop does nothing for it.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_core.log import get_logger

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.topology import Topology

log = get_logger("titan.memory")

POINTS = ("after_init", "after_first_optimizer_step", "steady_forward_backward", "after_optimizer_step")

MiB = 1024**2


def report_path(dump_folder: str, logical_rank: int) -> str:
    return os.path.join(dump_folder, f"memory_report_rank{logical_rank}.json")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: the local shard of a DTensor, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = local_shard(t)
    return t.numel() * t.element_size()


def tensor_account(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, buffers, gradients and optimizer state (local shards)."""
    params = [p for part in parts for p in part.parameters()]
    account = {
        "params_numel": sum(local_shard(p).numel() for p in params),
        "params_bytes": sum(_nbytes(p) for p in params),
        "buffers_bytes": sum(_nbytes(b) for part in parts for b in part.buffers()),
        "grads_bytes": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state_bytes": 0,
    }
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                account["optimizer_state_bytes"] += _nbytes(value)
    return account


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class AllocationTracker(TorchDispatchMode):
    """Bytes of the storages operators create (or resize) while active, current and peak.

    A dispatch mode below DTensor (DTensor ops are let through to their local ops) sees every
    operator's outputs; each new storage is remembered by a weak reference whose callback
    subtracts its bytes when it is freed. ``UntypedStorage.resize_`` is wrapped while active
    because FSDP allocates and frees its all-gather buffers by resizing storages in place.
    ``TorchDispatchMode`` lives in the private ``torch.utils._python_dispatch``; it is the
    mechanism PyTorch's own memory tools use, unchanged across torch 2.11-2.14.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize: Any = None

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes or storage.device.type == "meta":
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self._grow(self._sizes[key])

    def _freed(self, key: int, _ref: Any) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor unwrap; its local ops come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self._add(t.untyped_storage())
        return out

    def __enter__(self) -> AllocationTracker:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            key, before = id(storage), storage.nbytes()
            result = orig(storage, size)
            if key in tracker._sizes:
                tracker._sizes[key] = storage.nbytes()
                tracker._grow(storage.nbytes() - before)
            else:
                tracker._add(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)


class MemoryReport:
    """Observes memory at the four points and writes the report once the steady step is done."""

    def __init__(self, config: TrainerConfig, topology: Topology, parallel_dims: ParallelDims) -> None:
        self.config = config
        self.topology = topology
        self.parallel_dims = parallel_dims
        self.device: torch.device = topology.device
        self.cuda = self.device.type == "cuda"
        self.observations: list[dict[str, Any]] = []
        self.snapshot_path: str | None = None
        if self.cuda and config.profiler.enable_memory_snapshot:
            # Private but documented (https://pytorch.org/docs/stable/torch_cuda_memory.html);
            # started here, before the model is materialised, so the snapshot shows init too.
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.snapshot_path = os.path.join(
                config.job.dump_folder,
                config.profiler.save_memory_snapshot_folder,
                f"memory_report_rank{topology.rank}.pickle",
            )
        self._tracker: AllocationTracker | None = None
        self._base_bytes = 0  # accounted bytes when the tracked step began
        self._parts: list[nn.Module] = []
        self._optimizer: Any = None
        self.steady_step = 1
        self.done = False

    @classmethod
    def maybe(
        cls, config: TrainerConfig, topology: Topology, parallel_dims: ParallelDims
    ) -> MemoryReport | NoMemoryReport:
        """A report when this run wants one (fake backends, or ``debug.memory_report``)."""
        if topology.fake or config.debug.memory_report:
            return cls(config, topology, parallel_dims)
        return NoMemoryReport()

    # -- the trainer's calls ----------------------------------------------------------------------

    def start(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, steps: int) -> None:
        """Point 1; called once everything is built, before step 1."""
        self._parts, self._optimizer = parts, optimizer
        self.steady_step = 2 if steps >= 2 else 1
        self._observe("after_init", 0)

    def before_forward_backward(self, step: int) -> None:
        if self.done or step > self.steady_step:
            return
        if not self.cuda:
            self._base_bytes = self._accounted(tensor_account(self._parts, self._optimizer))
            self._tracker = AllocationTracker()
            self._tracker.__enter__()
        elif step == self.steady_step:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def after_forward_backward(self, step: int) -> None:
        if not self.done and step == self.steady_step:
            self._observe("steady_forward_backward", step)

    def after_optimizer_step(self, step: int) -> None:
        if self.done or step > self.steady_step:
            return
        if step == 1:
            self._observe("after_first_optimizer_step", step)
        if step == self.steady_step:
            self._observe("after_optimizer_step", step)
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        if step == self.steady_step:
            self.finish()

    # -- recording --------------------------------------------------------------------------------

    @staticmethod
    def _accounted(account: dict[str, int]) -> int:
        return sum(
            account[k] for k in ("params_bytes", "buffers_bytes", "grads_bytes", "optimizer_state_bytes")
        )

    def _observe(self, point: str, step: int) -> None:
        row: dict[str, Any] = {"point": point, "step": step}
        row.update(tensor_account(self._parts, self._optimizer))
        accounted = row["accounted_bytes"] = self._accounted(row)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            row["allocated_bytes"] = stats.get("allocated_bytes.all.current", 0)
            row["allocated_peak_bytes"] = stats.get("allocated_bytes.all.peak", 0)
            row["reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
            row["reserved_peak_bytes"] = stats.get("reserved_bytes.all.peak", 0)
            row["peak_bytes"] = row["allocated_peak_bytes"]
        elif self._tracker is not None:
            # Activations, unsharded parameters, gradients, optimizer state and temporaries made
            # since the step began, at their peak; plus what existed when it began.
            row["step_allocations_bytes"] = self._tracker.current
            row["step_allocations_peak_bytes"] = self._tracker.peak
            row["peak_bytes"] = max(self._base_bytes + self._tracker.peak, accounted)
        else:
            row["peak_bytes"] = accounted
        row["rss_bytes"] = _rss_bytes()
        row["max_rss_bytes"] = _max_rss_bytes()
        self.observations.append(row)

    def summary(self) -> dict[str, Any]:
        """The report as plain data (what the JSON file holds)."""
        config, top = self.config, self.topology
        by_point = {o["point"]: o for o in self.observations}
        first = self.observations[0] if self.observations else {}
        last = by_point.get("after_optimizer_step", {})
        return {
            "recipe": config.recipe,
            "model": f"{config.model.name}/{config.model.flavor}",
            "comm_backend": top.backend,
            "logical_rank": top.rank,
            "pp_rank": top.pp_rank
            if top.pp_rank is not None
            else self.parallel_dims.coordinates(top.rank)["pp"],
            "world_size": top.world_size,
            "physical_world_size": top.physical_world_size,
            "pp_group_backend": _backend_name(top.pp_group),
            "degrees": self.parallel_dims.degrees(),
            "device": str(self.device),
            "dtype": config.training.dtype,
            "seq_len": config.training.seq_len,
            "local_batch_size": config.training.local_batch_size,
            "activation_checkpoint": config.activation_checkpoint.mode,
            "steady_step": self.steady_step,
            "params_numel": first.get("params_numel"),
            "params_bytes": first.get("params_bytes"),
            "optimizer_state_bytes": last.get("optimizer_state_bytes"),
            "peak_bytes": max((o["peak_bytes"] for o in self.observations), default=None),
            "max_rss_bytes": _max_rss_bytes(),
            "snapshot": self.snapshot_path,
            "observations": self.observations,
        }

    def finish(self) -> dict[str, Any]:
        """Write the JSON (and the CUDA snapshot), print the table; called after the steady step."""
        self.done = True
        if self.snapshot_path is not None:
            os.makedirs(os.path.dirname(self.snapshot_path), exist_ok=True)
            torch.cuda.memory._dump_snapshot(self.snapshot_path)
        data = self.summary()
        path = report_path(self.config.job.dump_folder, self.topology.rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(format_table(data), flush=True)
        log.info("memory report written", path=path, peak_mib=round((data["peak_bytes"] or 0) / MiB, 1))
        return data


class NoMemoryReport:
    """Stands in for the report when none is wanted, so the training loop has no branch for it."""

    def start(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, steps: int) -> None:
        pass

    def before_forward_backward(self, step: int) -> None:
        pass

    def after_forward_backward(self, step: int) -> None:
        pass

    def after_optimizer_step(self, step: int) -> None:
        pass


def _backend_name(group: Any) -> str | None:
    """The backend of the real PP group (``real_pp_fake_spmd``), e.g. ``gloo``; else ``None``."""
    if group is None:
        return None
    import torch.distributed as dist

    return str(dist.get_backend(group))


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.1f}"


def format_table(data: dict[str, Any]) -> str:
    """A fixed-width table of the observations, in MiB."""
    degrees = " ".join(f"{k}={v}" for k, v in data["degrees"].items() if v > 1) or "single rank"
    head = (
        f"memory report: {data['recipe']} ({data['model']}), logical rank {data['logical_rank']} "
        f"of {data['world_size']}, pp_rank {data['pp_rank']}, {degrees}, {data['device']}, "
        f"{data['comm_backend']}"
    )
    cuda = str(data["device"]).startswith("cuda")
    cols = ["point", "step", "params", "grads", "optim", "peak"]
    cols += ["allocated", "reserved", "rsv peak"] if cuda else ["step alloc peak", "rss"]
    rows = [cols]
    for o in data["observations"]:
        row = [o["point"], str(o["step"]), _mib(o["params_bytes"]), _mib(o["grads_bytes"])]
        row += [_mib(o["optimizer_state_bytes"]), _mib(o["peak_bytes"])]
        if cuda:
            row += [_mib(o["allocated_bytes"]), _mib(o["reserved_bytes"]), _mib(o["reserved_peak_bytes"])]
        else:
            row += [_mib(o.get("step_allocations_peak_bytes")), _mib(o["rss_bytes"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [head, *(line(r) for r in rows)]
    lines.append(
        "(MiB; peak: "
        + ("CUDA allocated peak" if cuda else "accounted at step start + step allocations at their peak")
        + ")"
    )
    return "\n".join(lines)
