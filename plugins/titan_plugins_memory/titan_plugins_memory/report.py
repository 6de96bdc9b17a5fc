"""What PyTorch holds on this rank at the four observation points of a memory investigation.

The points (docs/debugging.md, "Memory report"; the spec's "memory debugging workflow"):

1. ``after_init``: model shards materialised and initialised, optimizer built (no state yet);
2. ``after_optimizer_warmup``: the optimizer state allocated ("complete optimizer warm-up"),
   before any forward pass;
3. ``steady_forward_backward``: the peak of the forward/backward of the steady step;
4. ``after_optimizer_step``: the steady step complete.

Point 2 does not wait for step 1: before the first observed forward the report allocates the
optimizer state with one optimizer step on zero gradients at learning rate 0 and weight decay 0,
then resets the step counters, so the weights and the next real step are exactly those of a run
without the report, and a one-step fake run already sees the steady state (gradients,
activations and optimizer state together). The steady step is step 2 when the run has two steps
or more (lazy initialisation happens in step 1), else the only step.

On CUDA the figures come from the caching allocator (``torch.cuda.memory_stats``: allocated and
reserved, current and peak; the peak of point 3 is reset just before that forward/backward), and
a snapshot for https://pytorch.org/memory_viz is written when ``profiler.enable_memory_snapshot``
is on. On CPU there is no allocator to ask, so tensors are accounted: parameters, buffers,
gradients and optimizer state are counted directly (local shards of DTensors), and during the
steady step an :class:`~titan_plugins_memory.tracker.AllocationTracker` follows every storage
created (or resized) by an operator until it is freed; what it holds at its peak is added to what
was accounted when the step began.

Every rank writes ``memory_report_rank{logical_rank}.json`` under ``job.dump_folder`` (at the end
of the run, or with the error when the run fails) and prints a table; the reports of earlier runs
are removed when the run starts (:mod:`titan_plugins_memory.outputs`). The JSON carries what
identifies the configuration (layout, schedule, microbatches, compile, activation checkpointing,
dtype, sequence and batch, model overrides and a hash of the whole config), so that
``titan memory compare A.json B.json`` can put two of them side by side.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.errors import TitanError, write_failure
from titan_core.log import get_logger
from titan_core.run_folder import write_json_whole, write_whole
from titan_plugins_memory.oom import note_rank, out_of_memory_cause
from titan_plugins_memory.outputs import layout_key, report_name
from titan_plugins_memory.tracker import AllocationTracker

log = get_logger("titan.memory")

POINTS = ("after_init", "after_optimizer_warmup", "steady_forward_backward", "after_optimizer_step")

MiB = 1024**2


def report_path(dump_folder: str, logical_rank: int) -> str:
    return os.path.join(dump_folder, report_name(logical_rank))


def run_layout(trainer: Any) -> tuple[Any, Any, Any]:
    """This run's :func:`~titan_plugins_memory.outputs.layout_key`, as its reports will carry it."""
    return layout_key(
        {
            "config_hash": config_identity(trainer.config)["config_hash"],
            "world_size": trainer.topology.world_size,
            "degrees": trainer.parallel_dims.degrees(),
        }
    )


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


def execution_fake_mode(parts: list[nn.Module]) -> Any:
    """The FakeTensorMode the model runs under (its parameters are fake tensors), or ``None``."""
    from torch._subclasses.fake_tensor import FakeTensor

    for part in parts:
        for p in part.parameters():
            local = local_shard(p)
            return local.fake_mode if isinstance(local, FakeTensor) else None
    return None


def accounted_bytes(account: dict[str, int]) -> int:
    return sum(account[k] for k in ("params_bytes", "buffers_bytes", "grads_bytes", "optimizer_state_bytes"))


def warm_up_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Allocate ``optimizer``'s state without changing a weight; ``False`` if it had state already.

    One step on zero gradients with every group's learning rate and weight decay set to 0 (AdamW
    multiplies the weights by ``1 - lr * weight_decay`` before its update; both factors are then
    exactly 1 and 0), then every ``step`` counter back to 0, so the next real step computes what
    it would have computed on fresh state (Adam's moments of zero gradients are zeros). The
    gradients are dropped again. On the CPU the step runs per parameter (``foreach=False``) so its
    temporaries do not raise the process's peak RSS.
    """
    if any(optimizer.state.get(p) for p in params):
        return False  # e.g. restored from a checkpoint
    # On the CPU the multi-tensor path's temporaries (a few copies of every shard) would stay in
    # the process's heap and in its peak RSS; the per-parameter path makes the same state.
    keys = ("lr", "weight_decay", "foreach")
    saved = [(group, {k: group[k] for k in keys if k in group}) for group in optimizer.param_groups]
    on_cpu = all(local_shard(p).device.type == "cpu" for p in params)
    had_grad = {id(p) for p in params if p.grad is not None}
    try:
        for group, values in saved:
            for key, value in values.items():
                if key == "foreach":
                    group[key] = False if on_cpu and not group.get("fused") else value
                else:
                    group[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, values in saved:
            group.update(values)
        for p in params:
            if id(p) not in had_grad:
                p.grad = None
    for state in optimizer.state.values():
        if "step" in state:
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step.zero_()
            else:
                state["step"] = 0
    return True


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _field(config: Any, section: str, name: str) -> Any:
    """``config.<section>.<name>``, or ``None`` when the plugin adding that section is absent."""
    try:
        return getattr(getattr(config, section), name)
    except AttributeError:
        return None


def config_identity(config: Any) -> dict[str, Any]:
    """What tells two configurations apart, and a hash of everything but where the run writes."""
    from titan_core.config import to_dict

    data = to_dict(config)
    data.pop("job", None)
    data.pop("recipe", None)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    t, p = config.training, config.parallelism
    return {
        "model_overrides": dict(config.model.overrides),
        "dtype": t.dtype,
        "seq_len": t.seq_len,
        "local_batch_size": t.local_batch_size,
        "pp_schedule": p.pp_schedule if p.pp > 1 else None,
        "pp_microbatches": p.pp_microbatches,
        "pp_stages_per_rank": p.pp_stages_per_rank,
        "loss_parallel": p.loss_parallel,
        "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
        "compile": _field(config, "compile", "enable"),
        "activation_checkpoint": _field(config, "activation_checkpoint", "mode"),
        "selective_ac_option": _field(config, "activation_checkpoint", "selective_ac_option"),
        "config_hash": digest[:16],
    }


class MemoryReport:
    """The memory report as a loop callback (``Callback("memory_report")``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.config = trainer.config
        self.topology = trainer.topology
        self.parallel_dims = trainer.parallel_dims
        self.device: torch.device = self.topology.device
        self.cuda = self.device.type == "cuda"
        self.observations: list[dict[str, Any]] = []
        self.snapshot_path: str | None = None
        if self.cuda and _field(self.config, "profiler", "enable_memory_snapshot"):
            # Private but documented (https://pytorch.org/docs/stable/torch_cuda_memory.html).
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.snapshot_path = os.path.join(
                self.config.job.dump_folder,
                self.config.profiler.save_memory_snapshot_folder,
                f"memory_report_rank{self.topology.rank}.pickle",
            )
        self._tracker: AllocationTracker | None = None
        self._base_bytes = 0  # accounted bytes when the steady step began
        self._parts: list[nn.Module] = []
        self._optimizer: Any = None
        self.steady_step = 1
        self.warmed_up = False
        self.done = False
        self.error: str | None = None

    # -- the loop's calls ------------------------------------------------------------------------

    def on_train_start(self, step: int) -> None:
        """Points 1 and 2: after init, then after allocating the optimizer state."""
        self._parts, self._optimizer = self.trainer.parts, self.trainer.optimizer
        first = step + 1
        self.steady_step = first + 1 if self.trainer.steps > first else first
        self._observe("after_init", step)
        params = [p for part in self._parts for p in part.parameters() if p.requires_grad]
        self.warmed_up = warm_up_optimizer(self._optimizer, params)
        self._observe("after_optimizer_warmup", step)

    def before_forward_backward(self, step: int) -> None:
        if self.done or step != self.steady_step:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._base_bytes = accounted_bytes(tensor_account(self._parts, self._optimizer))
            self._tracker = AllocationTracker(fake_mode=execution_fake_mode(self._parts))
            self._tracker.__enter__()

    def after_forward_backward(self, step: int) -> None:
        if not self.done and step == self.steady_step:
            self._observe("steady_forward_backward", step)

    def after_optimizer_step(self, step: int) -> None:
        if self.done or step != self.steady_step:
            return
        self._observe("after_optimizer_step", step)
        self._stop_tracker()
        self.done = True

    def on_train_end(self, step: int) -> None:
        self.write()

    def on_failure(self, step: int, exc: BaseException) -> None:
        """Keep what was observed, with the error, so a failed configuration still says why."""
        self._stop_tracker()
        # An out-of-memory step is named as one, also when a pipeline stage wrapped the
        # allocator's error in its own ('[Stage 1] failed to run forward:'), which says nothing.
        oom = out_of_memory_cause(exc)
        cause, what = (exc, "") if oom is None else (oom, "out of memory: ")
        if oom is not None:  # the logical rank, for the run's last line (titan_core.run)
            note_rank(exc, self.topology.rank)
        first = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
        self.error = f"step {step}: {what}{type(cause).__name__}: {first}"
        if self.observations:
            try:
                self.write()
            except TitanError as failed:
                # The run ends with its own error (an out-of-memory step, say): a report that could
                # not be written is said, and must not take that error's place.
                log.warning(str(failed))

    # -- recording -------------------------------------------------------------------------------

    def _stop_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None

    def _observe(self, point: str, step: int) -> None:
        row: dict[str, Any] = {"point": point, "step": step}
        row.update(tensor_account(self._parts, self._optimizer))
        accounted = row["accounted_bytes"] = accounted_bytes(row)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            row["allocated_bytes"] = stats.get("allocated_bytes.all.current", 0)
            row["allocated_peak_bytes"] = stats.get("allocated_bytes.all.peak", 0)
            row["reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
            row["reserved_peak_bytes"] = stats.get("reserved_bytes.all.peak", 0)
            row["peak_bytes"] = row["allocated_peak_bytes"]
        elif self._tracker is not None:
            # Activations, unsharded parameters, gradients and temporaries made since the step
            # began, at their peak; plus what existed when it began.
            row["step_allocations_bytes"] = self._tracker.current
            row["step_allocations_peak_bytes"] = self._tracker.peak
            row["peak_bytes"] = max(self._base_bytes + self._tracker.peak, accounted)
        else:
            row["peak_bytes"] = accounted
        row["rss_bytes"] = _rss_bytes()
        row["max_rss_bytes"] = _max_rss_bytes()
        self.observations.append(row)

    def _pp_group(self) -> Any:
        groups = getattr(self.topology, "groups", None) or {}
        return groups.get("pp", getattr(self.topology, "pp_group", None))

    def _physical_world_size(self) -> int:
        group = self._pp_group()
        if group is not None:
            import torch.distributed as dist

            return dist.get_world_size(group)
        simulated = getattr(self.topology, "simulated", None) or getattr(self.topology, "fake", False)
        return 1 if simulated else self.topology.world_size

    def summary(self) -> dict[str, Any]:
        """The report as plain data (what the JSON file holds)."""
        config, top = self.config, self.topology
        by_point = {o["point"]: o for o in self.observations}
        first = self.observations[0] if self.observations else {}
        last = by_point.get("after_optimizer_step") or by_point.get("after_optimizer_warmup") or {}
        group = self._pp_group()
        identity = config_identity(config)
        return {
            "recipe": config.recipe,
            "model": f"{config.model.name}/{config.model.flavor}",
            "comm_backend": top.backend,
            "logical_rank": top.rank,
            "pp_rank": self.parallel_dims.coordinates(top.rank)["pp"],
            "world_size": top.world_size,
            "physical_world_size": self._physical_world_size(),
            "pp_group_backend": None if group is None else _backend_name(group),
            "degrees": self.parallel_dims.degrees(),
            "device": str(self.device),
            **identity,
            "torch_version": torch.__version__,
            "optimizer_warmup": self.warmed_up,
            "steady_step": self.steady_step,
            "params_numel": first.get("params_numel"),
            "params_bytes": first.get("params_bytes"),
            "optimizer_state_bytes": last.get("optimizer_state_bytes"),
            "peak_bytes": max((o["peak_bytes"] for o in self.observations), default=None),
            "max_rss_bytes": _max_rss_bytes(),
            "snapshot": self.snapshot_path,
            "error": self.error,
            "observations": self.observations,
        }

    def write(self) -> dict[str, Any]:
        """Write the JSON (and the CUDA snapshot) and print the table."""
        if self.snapshot_path is not None:
            # Written whole, as the profiler's snapshots: a full disk leaves no half pickle, and
            # is one error naming the file (it escaped on_failure's guard, replacing the run's).
            try:
                os.makedirs(os.path.dirname(self.snapshot_path), exist_ok=True)
                write_whole(self.snapshot_path, torch.cuda.memory._dump_snapshot)
            except OSError as exc:
                raise write_failure(self.snapshot_path, exc, what="the memory report's snapshot") from None
        data = self.summary()
        path = report_path(self.config.job.dump_folder, self.topology.rank)
        print(format_table(data), flush=True)  # the figures reach the console even if the file cannot
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write_json_whole(path, data)
        except OSError as exc:
            raise write_failure(path, exc, what="the memory report") from None
        log.info("memory report written", path=path, peak_mib=round((data["peak_bytes"] or 0) / MiB, 1))
        return data


def _backend_name(group: Any) -> str:
    """The backend of the real PP group (``real_pp_fake_spmd``), e.g. ``gloo``."""
    import torch.distributed as dist

    return str(dist.get_backend(group))


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.1f}"


def format_table(data: dict[str, Any]) -> str:
    """A fixed-width table of the observations, in MiB."""
    from titan_plugins_memory.table import format_rows

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
    lines = [head, format_rows(rows)]
    if data.get("error"):
        lines.append(f"run failed at {data['error']}")
    lines.append(
        "(MiB; peak: "
        + ("CUDA allocated peak" if cuda else "accounted at step start + step allocations at their peak")
        + ")"
    )
    return "\n".join(lines)
