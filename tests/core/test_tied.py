"""``titan_core.tied`` and ``titan_core.wrapped_names``: tied weights and one-process init names
survive any wrapper a strategy puts around a module, not only torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_core.errors import UsageError
from titan_core.tied import retie, shared_parameters
from titan_core.wrapped_names import find_unwrapped, find_wrapped


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4, bias=False) for i in range(3)})
        self.output = nn.Linear(4, 16, bias=False)
        self.output.weight = self.tok_embeddings.weight


class Wrapper(nn.Module):
    """A third-party strategy's wrapper: the model below ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class LayerWrapper(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.wrapped = block


def test_a_tie_survives_to_empty_under_a_third_party_wrapper() -> None:
    with torch.device("meta"):
        model = Tiny()
    groups = shared_parameters(model)
    assert groups == [["tok_embeddings.weight", "output.weight"]]
    part = Wrapper(model)
    part.to_empty(device="cpu")
    assert part.inner.output.weight is not part.inner.tok_embeddings.weight  # what to_empty does
    retie([part], groups)
    assert part.inner.output.weight is part.inner.tok_embeddings.weight
    assert len(list(part.parameters())) == 4  # one embedding/output, three layers


def test_a_tie_survives_wrappers_at_several_depths() -> None:
    with torch.device("meta"):
        model = Tiny()
    groups = shared_parameters(model)
    model.output = LayerWrapper(model.output)
    part = Wrapper(model)
    part.to_empty(device="cpu")
    retie([part], groups)
    assert part.inner.output.wrapped.weight is part.inner.tok_embeddings.weight


@pytest.mark.parametrize(
    ("wrapped", "unwrapped"),
    [
        ("inner.layers.1.weight", "layers.1.weight"),
        ("layers.1._checkpoint_wrapped_module.weight", "layers.1.weight"),
        ("_orig_mod.inner.layers.2.wrapped.weight", "layers.2.weight"),
        ("inner.output.weight", "output.weight"),
    ],
)
def test_names_map_between_the_wrapped_and_the_plain_model(wrapped: str, unwrapped: str) -> None:
    plain = [n for n, _ in Tiny().named_parameters(remove_duplicate=False)]
    assert find_unwrapped(wrapped, plain) == unwrapped
    others = ["inner.layers.0.weight", "inner.tok_embeddings.weight"]
    assert find_wrapped(unwrapped, [wrapped, *others]) == wrapped


def test_a_name_in_no_layer_is_not_matched_to_another_layer() -> None:
    plain = ["layers.1.weight", "layers.2.weight"]
    assert find_unwrapped("inner.layers.3.weight", plain) is None
    assert find_unwrapped("inner.layers.weight", plain) is None  # ambiguous: none of them


class InitTiny(Tiny):
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for p in self.parameters():
            nn.init.normal_(p)


def test_one_process_init_reaches_parameters_under_a_third_party_wrapper() -> None:
    """The multi-process path copies each parameter's one-process value by name: a plugin's
    wrapper (``inner.``) must not end in a KeyError or a wrong tensor."""
    from types import SimpleNamespace

    from titan_core.init import init_like_one_process

    spec = SimpleNamespace(build=lambda args: InitTiny())
    part = Wrapper(InitTiny())
    part.inner.layers["1"] = LayerWrapper(part.inner.layers["1"])
    with torch.no_grad():
        for p in part.parameters():
            p.zero_()
    init_like_one_process([part], spec, None, seed=3)
    reference = InitTiny()
    torch.manual_seed(3)
    reference.init_weights()
    assert torch.equal(part.inner.layers["1"].wrapped.weight, reference.layers["1"].weight)
    assert torch.equal(part.inner.tok_embeddings.weight, reference.tok_embeddings.weight)


class Scale(nn.Module):
    """A strategy's wrapper around a whole model part, as a plugin would write it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.inner(*args, **kwargs)

    def init_weights(self, *args: object, **kwargs: object) -> None:
        self.inner.init_weights(*args, **kwargs)


def _tied_trainer(tmp_path: object, name: str, apply: object) -> object:
    """A Trainer of the tiny tied Llama 3 with a third-party strategy ``name`` doing ``apply``."""
    import types

    from tests.conftest import tiny_llama3
    from titan_core import Strategy, hookimpl
    from titan_core._registry import Registry
    from titan_core.trainer import Trainer

    strategy = Strategy(name, 45, lambda config, dims: True, apply)
    module = types.ModuleType(f"third_party_{name}")
    module.titan_strategies = hookimpl(lambda: [strategy])  # type: ignore[attr-defined]
    registry = Registry().load_entry_points()
    registry.register(module, f"third_party_{name}")
    config = tiny_llama3(tmp_path, 2)
    config.model.overrides = {"tie_embeddings": True}
    return Trainer(config, registry)


def test_the_trainer_keeps_a_tie_under_a_plugins_wrapping_strategy(tmp_path: object) -> None:
    trainer = _tied_trainer(tmp_path, "wrap", lambda parts, ctx: [Scale(p) for p in parts])
    try:
        model = trainer.parts[0].inner
        assert model.output.weight is model.tok_embeddings.weight
        optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        assert id(model.output.weight) in optimized
        assert len(optimized) == len(list(trainer.parts[0].parameters()))
        trainer.train()
        assert model.output.weight is model.tok_embeddings.weight
    finally:
        trainer.close()


def _stages() -> tuple[list[list[str]], nn.Module, nn.Module]:
    """A tied model cut in two pipeline stages the way PP cuts it (ends set to None)."""
    import copy

    with torch.device("meta"):
        model = Tiny()
    groups = shared_parameters(model)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.output = None
    last.tok_embeddings = None
    return groups, first, last


@pytest.mark.parametrize("layout", ["first stage", "last stage", "both stages on one rank"])
def test_a_tie_split_over_pipeline_stages_is_refused(layout: str) -> None:
    groups, first, last = _stages()
    parts = {"first stage": [first], "last stage": [last], "both stages on one rank": [first, last]}[layout]
    with pytest.raises(UsageError, match=r"tok_embeddings\.weight and output\.weight would be split"):
        retie(parts, groups)


def test_a_stage_holding_no_name_of_a_tie_is_fine() -> None:
    groups, first, _ = _stages()
    middle = first
    middle.tok_embeddings = None
    retie([middle], groups)  # nothing of the tie here: nothing to keep together


def test_the_trainer_refuses_a_strategy_that_splits_a_tie(tmp_path: object) -> None:
    """A third-party strategy that drops the output from this rank's part (as a pipeline stage
    does) gets one error naming the tie and the strategy, not a run whose copies drift apart."""

    def first_stage(parts: list[nn.Module], ctx: object) -> list[nn.Module]:
        for part in parts:
            part.output = None
        return parts

    split = r"after strategy 'stage'.*would be split.*tok_embeddings\.weight only"
    with pytest.raises(UsageError, match=split):
        _tied_trainer(tmp_path, "stage", first_stage)
