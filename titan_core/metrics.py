"""Per-step throughput, FLOPs, MFU and memory; the log line and TensorBoard scalars."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch

from titan_core.log import get_logger

GiB = 1024**3

# Dense bf16 peak TFLOP/s (without sparsity) by device-name fragment.
_PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
}


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset, in GiB (CUDA allocator, or this process's RSS on CPU)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            "max_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / GiB,
            "max_reserved_gib": reserved / GiB,
            "max_reserved_pct": 100 * reserved / total,
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"max_rss_gib": rss_kib / 1024**2}


class MetricsLogger:
    """Times steps and logs one line every ``log_freq`` steps (and TensorBoard scalars)."""

    def __init__(
        self,
        config: Any,
        device: torch.device,
        flops_per_token: float,
        tokens_per_step: int,
        write: bool,
    ) -> None:
        self.log_freq = config.metrics.log_freq
        self.device = device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak = peak_tflops(device, config.metrics.peak_tflops)
        self.logger = get_logger("titan.metrics")
        self.writer = None
        if write and config.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(config.job.dump_folder, config.metrics.save_tb_folder)
            self.writer = SummaryWriter(folder)
        self._t0 = time.perf_counter()
        self._steps = 0
        self.history: list[dict[str, float]] = []

    def step_done(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        self._steps += 1
        if step % self.log_freq and step != 1:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        tps = self.tokens_per_step * self._steps / elapsed
        tflops = self.flops_per_token * tps / 1e12
        row: dict[str, float] = {"step": step}
        if loss is not None:
            row["loss"] = round(loss, 5)
        if grad_norm is not None:
            row["grad_norm"] = round(grad_norm, 4)
        row["tps"] = round(tps, 1)
        row["tflops"] = round(tflops, 3)
        if self.peak:
            row["mfu_pct"] = round(100 * tflops / self.peak, 2)
        row.update({k: round(v, 3) for k, v in memory_stats(self.device).items()})
        self.history.append(row)
        self.logger.info("step", **row)
        if self.writer is not None:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(f"train/{key}", value, step)
            self.writer.flush()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()
        self._steps = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
