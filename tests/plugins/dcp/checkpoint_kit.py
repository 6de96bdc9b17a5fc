"""A tiny model, optimizer and schedule driven step by step, for checkpointer tests that do not
need the trainer (one process here; ``ranks_worker.py`` uses it under torchrun too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.parallel_harness import tiny_config
from titan_core.topology import Topology
from titan_plugins_dcp.checkpointer import DCPCheckpointer

META = {"lr_schedule": {"warmup_steps": 2, "steps": 6, "lr": 0.01}, "loss_finite": True}


class Net(nn.Module):
    """``layers`` square linear layers, kept in a ModuleDict as titan's models keep blocks."""

    def __init__(self, layers: int = 3, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleDict({str(i): nn.Linear(width, width) for i in range(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


class Run:
    """Model, AdamW and a decaying LambdaLR; ``step(i)`` trains on batch ``i`` (fixed data)."""

    def __init__(
        self, layers: int = 3, width: int = 4, seed: int = 0, model: nn.Module | None = None
    ) -> None:
        torch.manual_seed(seed)
        self.model = model if model is not None else Net(layers, width)
        self.width = width
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 / (1 + s))

    @property
    def parts(self) -> list[nn.Module]:
        return [self.model]

    def step(self, i: int) -> float:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, self.width, generator=g), torch.randn(8, self.width, generator=g)
        device = next(self.model.parameters()).device
        x, y = x.to(device), y.to(device)
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return loss.item()

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's values (local shards of DTensors), detached copies."""
        return {
            k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in self.model.state_dict().items()
        }


def checkpointer(
    dump: Path, world_size: int = 1, rank: int = 0, device: str = "cpu", **overrides: Any
) -> DCPCheckpointer:
    config = tiny_config(**{"job.dump_folder": str(dump), "checkpoint.enable": True, **overrides})
    return DCPCheckpointer(config, Topology(world_size, rank, rank, torch.device(device)))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Events:
    """Stands in for the checkpointer's logger: ``(level, event, fields)`` of every line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def warnings(self) -> list[tuple[str, str]]:
        return [
            (f["path"], f["reason"]) for level, _, f in self.lines if level == "warning" and "reason" in f
        ]

    def of(self, event: str) -> list[dict[str, Any]]:
        return [f for _, e, f in self.lines if e == event]
