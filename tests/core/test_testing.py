"""``titan_core.testing.check_model_spec`` on titan's own models and on broken fixture models."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from titan_core.records import ModelSpec
from titan_core.testing import ModelCheckError, check_model_spec
from titan_plugins_llama3.plugin import titan_models as llama3_models
from titan_plugins_moe.plugin import titan_models as moe_models

TIED = [("output.weight", "tok_embeddings.weight")]


@pytest.mark.parametrize("tie", [False, True])
def test_llama3_passes(tie: bool) -> None:
    (spec,) = llama3_models()
    overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "tie_embeddings": tie}
    check_model_spec(spec, "debugmodel", overrides=overrides, tied=TIED if tie else ())


@pytest.mark.parametrize("tie", [False, True])
def test_moe_passes(tie: bool) -> None:
    spec = next(s for s in moe_models() if s.name == "moe")
    check_model_spec(spec, "debugmodel", overrides={"tie_embeddings": tie}, tied=TIED if tie else ())


class _Toy(nn.Module):
    """A decoder-protocol toy with an optional bug: an untied head, a skipped init, a wrong count."""

    def __init__(self, vocab: int, dim: int, bug: str) -> None:
        super().__init__()
        self.bug = bug
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({"0": nn.Linear(dim, dim)})
        self.output = nn.Linear(dim, vocab, bias=False)
        if bug != "untied":  # the bug: says it ties, keeps two weights
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # A pipeline stage holds None for the other stages' ends (check_model_spec tries both).
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        if self.bug != "skipped_init":
            nn.init.normal_(self.layers["0"].weight, std=0.02)
        nn.init.zeros_(self.layers["0"].bias)
        if self.bug == "untied" and self.output is not None:
            nn.init.normal_(self.output.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.layers["0"](self.tok_embeddings(tokens)))


def _spec(bug: str, miscount: int = 0) -> ModelSpec:
    @attrs.frozen
    class Args:
        vocab_size: int = 32
        dim: int = 8

    def count(args: Args, include_embedding: bool) -> int:
        return args.vocab_size * args.dim + args.dim * args.dim + args.dim + miscount

    return ModelSpec("toy", {"t": Args()}, lambda a: _Toy(a.vocab_size, a.dim, bug), count, lambda a, s: 0.0)


def test_a_sound_toy_passes() -> None:
    check_model_spec(_spec("none"), "t", tied=TIED)


@pytest.mark.parametrize(
    ("bug", "miscount", "expected"),
    [
        ("untied", 0, "output.weight and tok_embeddings.weight: expected one tied parameter"),
        ("skipped_init", 0, "layers.0.weight: not initialised by init_weights"),
        ("none", 5, "num_params(args, True) = 333 but the model has 328 parameters"),
    ],
)
def test_a_broken_toy_fails_naming_the_problem(bug: str, miscount: int, expected: str) -> None:
    with pytest.raises(ModelCheckError) as info:
        check_model_spec(_spec(bug, miscount), "t", tied=TIED)
    assert expected in str(info.value)


def _replicate_everything(model: nn.Module, tp_mesh: object, loss_parallel: bool) -> None:
    """A naive plan: every weight a replicated DTensor, no input or output layouts, so the
    embedding meets plain token ids and a DTensor weight."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param, tp_mesh, [Replicate()])  # type: ignore[arg-type]
            module.register_parameter(name, nn.Parameter(dt))


def test_a_tp_plan_whose_forward_cannot_run_fails() -> None:
    """Every parameter a DTensor is not enough: the model must also run under the plan."""
    spec = attrs.evolve(_spec("untied"), tp_plan=_replicate_everything)
    with pytest.raises(ModelCheckError) as info:
        check_model_spec(spec, "t")
    assert "forward pass failed under tp_plan on a 2-rank mesh" in str(info.value)
    assert "mixed torch.Tensor and DTensor" in str(info.value)


def _plan_with_output(output: str) -> object:
    """A toy plan whose forward runs, with the output projection's style chosen by ``output``:
    ``gathered`` (sound), or one that leaves the logits split or a DTensor on every rank."""

    def plan(model: nn.Module, tp_mesh: object, loss_parallel: bool) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {
            "gathered": ColwiseParallel(output_layouts=Replicate()),
            "vocab_sharded": ColwiseParallel(),  # Shard(-1), handed back as the local shard
            "seq_sharded": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
            "dtensor": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
        }
        parallelize_module(
            model,
            tp_mesh,  # type: ignore[arg-type]
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "layers.0": ColwiseParallel(
                    output_layouts=Shard(1) if output == "seq_sharded" else Replicate()
                ),
                "output": styles[output],
            },
        )

    return plan


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (
            "vocab_sharded",
            "forward under tp_plan on a 2-rank mesh returned shape (2, 32, 16), expected (batch, seq, "
            "vocab_size) = (2, 32, 32): the output projection's plan leaves the logits sharded over "
            "the vocabulary",
        ),
        (
            "seq_sharded",
            "forward under tp_plan on a 2-rank mesh returned shape (2, 16, 32), expected (batch, seq, "
            "vocab_size) = (2, 32, 32): the plan leaves the logits sharded over the sequence",
        ),
        ("dtensor", "forward under tp_plan on a 2-rank mesh returned a DTensor (Replicate())"),
    ],
)
def test_a_tp_plan_whose_logits_are_not_whole_plain_tensors_fails(output: str, expected: str) -> None:
    """The forward under the plan runs, but its logits are not the plain (batch, seq, vocab_size)
    tensor the loss takes: split over the vocabulary or the sequence, the loss would be taken
    over the wrong classes or tokens; a DTensor fails only at the first step."""
    untied = _spec("untied", miscount=32 * 8)  # counts its own output weight: no other problem
    check_model_spec(attrs.evolve(untied, tp_plan=_plan_with_output("gathered")), "t")
    with pytest.raises(ModelCheckError) as info:
        check_model_spec(attrs.evolve(untied, tp_plan=_plan_with_output(output)), "t")
    message = str(info.value)
    assert expected in message
    assert "output_layouts=Replicate()" in message  # what to change
    assert "forward without tp_plan" not in message  # the plain forward is sound


def test_a_plain_forward_of_the_wrong_shape_fails_naming_it() -> None:
    """Logits that are not (batch, seq, vocab_size): say it is the forward without the plan."""

    class Cut(_Toy):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return super().forward(tokens)[..., :-1]

    spec = attrs.evolve(_spec("none"), build=lambda a: Cut(a.vocab_size, a.dim, "none"))
    with pytest.raises(ModelCheckError) as info:
        check_model_spec(spec, "t", tied=TIED)
    expected = "forward without tp_plan returned shape (2, 16, 31), expected (batch, seq, vocab_size)"
    assert f"{expected} = (2, 16, 32)" in str(info.value)


class _NotLlama(nn.Module):
    """Not Llama-shaped: blocks in a ModuleList, the head tied under other names, and buffers of
    integer and boolean type that ``init_weights`` must fill (made on the meta device, they hold
    whatever memory ``to_empty`` gives them)."""

    def __init__(self, vocab_size: int, dim: int, bug: str) -> None:
        super().__init__()
        self.bug = bug
        self.wte = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(64), persistent=False)
        self.register_buffer("keep", torch.ones(64, dtype=torch.bool), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.wte.weight, std=0.02)
        for block in self.blocks:
            block.reset_parameters()
        if self.bug != "positions":
            self.positions.copy_(torch.arange(64))
        if self.bug != "keep":
            self.keep.fill_(True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        for block in self.blocks:
            h = h + block(h)
        seq = tokens.shape[1]
        return self.lm_head(h * self.keep[:seq, None] + 0 * self.positions[:seq, None])


def _not_llama(bug: str) -> ModelSpec:
    def count(args: dict[str, int], include_embedding: bool) -> int:
        return args["vocab_size"] * args["dim"] + 2 * (args["dim"] ** 2 + args["dim"])

    return ModelSpec(
        "gpt", {"t": {"vocab_size": 32, "dim": 8}}, lambda a: _NotLlama(**a, bug=bug), count, lambda a, s: 0.0
    )


def test_a_model_that_is_not_llama_shaped_passes() -> None:
    check_model_spec(_not_llama("none"), "t", tied=[("lm_head.weight", "wte.weight")])


@pytest.mark.parametrize(
    ("bug", "expected"),
    [
        # An integer buffer made with torch.arange on the meta device held garbage after to_empty:
        # NaN cannot mark an integer, so only floating-point tensors were checked, and it passed.
        ("positions", "buffer positions: not initialised by init_weights"),
        ("keep", "buffer keep: not initialised by init_weights"),
    ],
)
def test_an_integer_or_boolean_buffer_left_uninitialised_fails(bug: str, expected: str) -> None:
    with pytest.raises(ModelCheckError, match=expected):
        check_model_spec(_not_llama(bug), "t", tied=[("lm_head.weight", "wte.weight")])
