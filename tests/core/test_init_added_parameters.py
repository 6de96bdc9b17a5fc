"""Parameters a strategy adds to the model (a LoRA-style adapter): titan initialises parameters
only through the model's ``init_weights``, which does not know them.

Written from the outside: a LoRA strategy adding ``lora_a``/``lora_b`` beside the attention
projections trained on ``to_empty``'s memory. On one process the run stopped at step 1 with
``the loss or gradient norm became non-finite ... Lower training.lr, check the data`` (or, where
that memory held finite values, trained on garbage without a word); on several processes the
one-process copy said ``a strategy renamed it``. Both are now one error naming the parameters,
the module class holding them and the contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import plugin_module, tiny_llama3
from titan_core import Strategy, _registry
from titan_core._registry import Registry
from titan_core.errors import PluginError
from titan_core.init import initialise
from titan_core.trainer import Trainer


class Adapter(nn.Module):
    """A low-rank adapter around a linear layer: two parameters the model's init never sees."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(2, base.in_features))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, 2))

    @property
    def weight(self) -> torch.Tensor:  # the model's init_weights initialises wq.weight
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def add_adapters(parts: list[nn.Module], ctx: Any = None) -> list[nn.Module]:
    for part in parts:
        for block in part.layers.values():
            block.attention.wq = Adapter(block.attention.wq)
    return parts


EXPECTED = (
    r"4 parameters of the model were not initialised: layers\.0\.attention\.wq\.lora_a, "
    r"layers\.0\.attention\.wq\.lora_b, layers\.1\.attention\.wq\.lora_a and 1 more \(held by "
    r"tests\.core\.test_init_added_parameters\.Adapter\)"
)


def test_a_strategy_adding_parameters_is_one_error_at_build_not_a_nan_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry().load_entry_points()
    strategy = Strategy("adapters", 5, lambda config, dims: True, add_adapters, "LoRA-style adapters")
    plugin = plugin_module("adapters", titan_strategies=[strategy])
    registry.register(plugin, "adapters", "dist-adapters", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    with pytest.raises(PluginError, match=EXPECTED) as raised:
        Trainer(tiny_llama3(tmp_path, 1), registry)
    assert "model 'llama3''s init_weights" in str(raised.value)


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "one-process-copy"])
def test_both_initialisation_paths_name_added_parameters(world_size: int) -> None:
    """World size 2 takes the path that copies each rank's values out of a one-process build."""
    spec = Registry().load_entry_points().get("models", "llama3")
    args = spec.flavor("debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 4})
    with torch.device("meta"):
        model = add_adapters([spec.build(args)])[0]
    model.to_empty(device="cpu")
    with pytest.raises(PluginError, match=EXPECTED):
        initialise(
            [model],
            spec,
            args,
            0,
            device=torch.device("cpu"),
            simulated=False,
            max_full_gib=8.0,
            pp_coordinate=0,
            world_size=world_size,
        )
