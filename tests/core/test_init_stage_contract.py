"""A model's ``init_weights`` on a pipeline stage: the modules the stage dropped are ``None``.

A GPT-2-style model whose ``init_weights`` reads ``self.wpe.weight`` directly (a learned position
table, one of its ``first_stage_modules``) used to end the later stage's process with a bare
``AttributeError`` traceback from ``titan_core/init.py`` (and its peers with gloo's "Connection
closed by peer"); it is one error naming the model, the dropped modules and the contract, and
``check_model_spec`` finds it before any run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from titan_core.errors import PluginError
from titan_core.init import initialise
from titan_core.records import ModelSpec
from titan_core.testing import ModelCheckError, check_model_spec

ARGS = {"vocab_size": 64, "dim": 16, "n_layers": 2, "max_seq_len": 32}


class PosLM(nn.Module):
    """Learned absolute positions; ``init_weights`` reads its end modules without a None check."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, max_seq_len: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(n_layers)})
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        for layer in self.layers.values():
            layer.reset_parameters()
        self.ln_f.reset_parameters()
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.ln_f(h))


def _spec() -> ModelSpec:
    def count(args: Any, include_embedding: bool = True) -> int:
        d, v, n, t = args["dim"], args["vocab_size"], args["n_layers"], args["max_seq_len"]
        return n * (d * d + d) + 2 * d + v * d + (v * d + t * d if include_embedding else 0)

    return ModelSpec(
        "poslm",
        {"tiny": ARGS},
        lambda args: PosLM(**args),
        num_params=count,
        flops_per_token=lambda args, seq_len: 6.0 * count(args, False),
        first_stage_modules=("wte", "wpe"),
        last_stage_modules=("ln_f", "lm_head"),
    )


def _last_stage() -> nn.Module:
    with torch.device("meta"):
        stage = PosLM(**ARGS)
    stage.wte = None
    stage.wpe = None
    stage.to_empty(device="cpu")
    return stage


def test_init_weights_reading_a_dropped_module_is_one_error_naming_the_contract() -> None:
    with pytest.raises(PluginError) as caught:
        initialise(
            [_last_stage()],
            _spec(),
            ARGS,
            0,
            device=torch.device("cpu"),
            simulated=False,
            max_full_gib=8.0,
            pp_coordinate=1,
            world_size=2,
        )
    message = str(caught.value)
    assert "model 'poslm'" in message and "init_weights" in message
    assert "wte, wpe" in message and "must skip" in message
    assert isinstance(caught.value.__cause__, AttributeError)


def test_check_model_spec_finds_an_init_weights_that_fails_on_a_stage() -> None:
    with pytest.raises(ModelCheckError, match=r"init_weights.*pipeline stage without wte, wpe"):
        check_model_spec(_spec(), "tiny")
    check_model_spec(_spec(), "tiny", pipeline=False)  # a model that never runs under PP
