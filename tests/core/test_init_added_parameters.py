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


def _initialise(model: Any, spec: Any, args: Any, world_size: int, **kwargs: Any) -> str:
    """``initialise`` of one real (not simulated) CPU part, seed 0, with the full model fitting."""
    return initialise(
        [model],
        spec,
        args,
        0,
        device=torch.device("cpu"),
        simulated=False,
        max_full_gib=8.0,
        pp_coordinate=0,
        world_size=world_size,
        **kwargs,
    )


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
        _initialise(model, spec, args, world_size)


# A third-party model whose own init_weights misses a layer (a forgotten branch of its loop) was
# told "a strategy added them" with no strategy applied; on several processes the one-process
# copy took the unset values of its unmarked full build (finite memory, often zeros) and trained
# on them without a word. Both paths now blame the model's init_weights, naming its plugin.


class Skippy(nn.Module):
    """A decoder whose ``init_weights`` forgets the blocks' ``mix`` layers."""

    def __init__(self, vocab_size: int = 1024, dim: int = 256, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict(
            {str(i): nn.ModuleDict({"mix": nn.Linear(dim, dim)}) for i in range(n_layers)}
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)) and not name.endswith("mix"):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = h + block["mix"](h)
        return self.output(self.norm(h))


def _skippy_spec() -> Any:
    from titan_core import ModelSpec

    return ModelSpec(
        "skippy",
        {"tiny": {"vocab_size": 1024, "dim": 256, "n_layers": 2}},
        lambda args: Skippy(**args),
        lambda args, include_embedding=True: 0,
        lambda args, seq_len: 0.0,
    )


SKIPPED = (
    r"init_weights left 4 parameters uninitialised: layers\.0\.mix\.weight, layers\.0\.mix\.bias, "
    r"layers\.1\.mix\.weight and 1 more \(held by torch\.nn\.modules\.linear\.Linear\); initialise "
    r"every parameter and buffer in place there"
)


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "one-process-copy"])
def test_a_model_whose_init_weights_misses_parameters_is_blamed_not_a_strategy(world_size: int) -> None:
    spec = _skippy_spec()
    args = spec.flavors["tiny"]
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    with pytest.raises(PluginError, match=r"^model 'skippy': " + SKIPPED) as raised:
        _initialise(model, spec, args, world_size)
    assert "strategy" not in str(raised.value)


def test_the_trainer_names_the_plugin_whose_init_weights_misses_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry().load_entry_points()
    registry.register(plugin_module("skippy", titan_models=[_skippy_spec()]), "skippy", "skippy-lm", "0.2")
    monkeypatch.setattr(_registry, "_default", registry)
    config = tiny_llama3(tmp_path, 1)
    config.model.name, config.model.flavor, config.model.overrides = "skippy", "tiny", {}
    with pytest.raises(PluginError, match=r"^model 'skippy' \(plugin skippy, skippy-lm 0\.2\): " + SKIPPED):
        Trainer(config, registry)


class Raising(Skippy):
    """A decoder whose ``init_weights`` raises (a typo in an attribute name, say)."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        raise ValueError("std must be positive")


def _raising_spec() -> Any:
    from titan_core import ModelSpec

    return ModelSpec(
        "raising",
        {"tiny": {"vocab_size": 1024, "dim": 64, "n_layers": 2}},
        lambda args: Raising(**args),
        lambda args, include_embedding=True: 0,
        lambda args, seq_len: 0.0,
    )


def test_an_init_weights_that_raises_is_one_error_naming_the_model_and_its_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a bare traceback from deep in the trainer: the one model callable called unguarded."""
    registry = Registry().load_entry_points()
    registry.register(
        plugin_module("raising", titan_models=[_raising_spec()]), "raising", "raising-lm", "0.3"
    )
    monkeypatch.setattr(_registry, "_default", registry)
    config = tiny_llama3(tmp_path, 1)
    config.model.name, config.model.flavor, config.model.overrides = "raising", "tiny", {}
    with pytest.raises(PluginError) as raised:
        Trainer(config, registry)
    assert str(raised.value).startswith(
        "model 'raising' (plugin raising, raising-lm 0.3) failed in init_weights: ValueError: std must "
        "be positive; the traceback is in "
    )
    assert "std must be positive" in (tmp_path / "plugin_error.log").read_text()


def test_the_full_copy_of_several_processes_calls_init_weights_as_plugin_code_too() -> None:
    """World size 2 initialises a full copy on the CPU: its init_weights goes through ``call``
    (the trainer's guard) as the parts' does."""
    spec = _raising_spec()
    args = spec.flavors["tiny"]
    with torch.device("meta"):
        model = Skippy(**args)
    model.to_empty(device="cpu")
    calls: list[str] = []

    def call(fn: Any, *call_args: Any) -> Any:
        calls.append(fn)
        return None  # the trainer's guard would call it; skipped here, so nothing is initialised

    with pytest.raises(PluginError, match="init_weights left"):
        _initialise(model, spec, args, 2, call=call)
    assert len(calls) == 2
