"""The training step checked from outside: titan's losses, logged LRs, gradient norms and weights
against a plain PyTorch loop over the same batches, and optimizer settings that cannot train."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_llama3
from titan_core._registry import get_registry
from titan_core.config import ConfigError, TrainerConfig, validate
from titan_core.trainer import Trainer


def _factor(step: int, steps: int, warmup: int, ratio: float, floor: float) -> float:
    """docs/config.md's schedule by hand, for the 1-based ``step``."""
    if step <= warmup:
        return step / (warmup + 1)
    after = max(steps - warmup, 0)
    decay = 0 if ratio <= 0 or after == 0 else min(max(round(after * ratio), 1), after)
    if decay == 0 or step <= steps - decay:
        return 1.0
    return 1.0 - (1.0 - floor) * min((step - (steps - decay)) / decay, 1.0)


@pytest.mark.parametrize(
    ("local", "global_batch", "max_norm", "mask"),
    [
        (1, 4, 0.05, True),  # 4 microbatches, clipping active, document mask
        (2, None, 0.0, False),  # one microbatch, clipping off
    ],
)
def test_each_step_is_what_a_plain_pytorch_loop_computes(
    tmp_path: Path, local: int, global_batch: int | None, max_norm: float, mask: bool
) -> None:
    """Mean next-token cross-entropy over the global batch, the pre-clip total norm, one clip of
    the accumulated gradient, AdamW at the schedule's LR: loss, LR, norm and final weights of
    titan's run equal those of a hand-written loop (torch's own clip_grad_norm_ and AdamW)."""
    steps, warmup, ratio, floor = 5, 1, 0.6, 0.2
    config = tiny_llama3(tmp_path, steps)
    t = config.training
    t.local_batch_size, t.global_batch_size, t.max_norm = local, global_batch, max_norm
    t.warmup_steps, t.decay_ratio, t.min_lr_factor = warmup, ratio, floor
    config.metrics.log_freq = 1
    if mask:
        config.model.overrides = {**config.model.overrides, "document_mask": True}
    trainer = Trainer(config, get_registry())
    try:
        model = copy.deepcopy(trainer.parts[0])
        per_step = (global_batch or local) // local
        batches = list(itertools.islice(iter(trainer.batches), steps * per_step))
        rows = trainer.train()
        weights = [p.detach().clone() for p in trainer.parts[0].parameters()]
    finally:
        trainer.close()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay
    )
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for step, row in enumerate(rows, 1):
        chunk = batches[(step - 1) * per_step : step * per_step]
        inputs = torch.cat([i for i, _ in chunk])
        labels = torch.cat([label for _, label in chunk])
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels: the next token of each input
        lr = t.lr * _factor(step, steps, warmup, ratio, floor)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
        optimizer.step()
        assert row["lr"] == pytest.approx(lr, rel=1e-12), step
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-6), step
        # titan's CPU norm adds in float64; torch's float32 sum is off by about 1e-5 relative.
        assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), step
        if max_norm > 0:
            assert row["grad_norm"] > max_norm  # the logged norm is the one before clipping
    for mine, theirs in zip(weights, model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-4, atol=1e-5)


def _training(**values: Any) -> TrainerConfig:
    config = TrainerConfig()
    for name, value in values.items():
        setattr(config.training, name, value)
    return config


@pytest.mark.parametrize("eps", [1e-39, 1e-46, 1e-300])
def test_an_adamw_eps_float32_cannot_hold_is_refused_where_it_is_set(eps: float) -> None:
    """AdamW adds eps to float32 state: 1e-46 is 0 there (1e-39 a subnormal, 0 where denormals
    flush), so a parameter whose gradient is 0 (the embedding of a token not in the batch) got
    0 / 0 = NaN; the run stopped as "non-finite ... Lower training.lr, check the data"."""
    config = TrainerConfig()
    with pytest.raises(ConfigError) as info:
        config.training.eps = eps
    (problem,) = info.value.problems
    assert problem.startswith(f"training.eps: {eps:g} is below float32's smallest normal number")
    assert "use 1e-08 (the default)" in problem
    config.training.eps = 1.2e-38  # the smallest that float32 holds at full precision
    assert validate(config) is config


@pytest.mark.parametrize(("lr", "weight_decay"), [(1e-3, 1000.0), (3e-3, 400.0), (1.0, 1.0)])
def test_a_weight_decay_that_zeroes_the_weights_every_step_is_refused(lr: float, weight_decay: float) -> None:
    """AdamW multiplies every parameter by 1 - lr x weight_decay each step: at 0 or below, the
    weights were zeroed (or flipped) at the peak LR and the run went on at loss log(vocab),
    exit 0, without a word."""
    with pytest.raises(ConfigError) as info:
        validate(_training(lr=lr, weight_decay=weight_decay))
    (problem,) = info.value.problems
    assert problem.startswith(
        f"training.weight_decay: {weight_decay:g} x training.lr {lr:g} = {weight_decay * lr:g} is >= 1"
    )
    assert validate(_training(lr=lr, weight_decay=0.99 / lr)) is not None


def test_a_weight_decay_that_zeroes_the_weights_fails_the_run_of_a_python_caller(tmp_path: Path) -> None:
    """A caller that skips validate() gets the same error before anything is built."""
    config = tiny_llama3(tmp_path, 2)
    config.training.lr, config.training.weight_decay = 1e-3, 1000.0
    with pytest.raises(ConfigError, match=r"training\.weight_decay: 1000 x training\.lr 0\.001 = 1 is >= 1"):
        Trainer(config, get_registry())
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_infinite_max_norm_says_how_to_turn_clipping_off() -> None:
    config = TrainerConfig()
    with pytest.raises(ConfigError) as info:
        config.training.max_norm = float("inf")
    (problem,) = info.value.problems
    assert problem == (
        "training.max_norm: expected a finite number, got inf; 0 (or any value <= 0) turns "
        "gradient clipping off"
    )
    config.training.max_norm = -1.0  # off, as documented
    assert validate(config) is config


def test_a_run_whose_only_step_has_learning_rate_0_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step, no warm-up, a decay to min_lr_factor = 0: the decay's last step (the only one)
    is at the floor, so the step trained nothing (AdamW at LR 0), exit 0, without a word."""
    import titan_core.trainer as trainer_module

    warnings: list[str] = []
    monkeypatch.setattr(trainer_module.log, "warning", lambda event, **kw: warnings.append(event))
    config = tiny_llama3(tmp_path, 1)
    config.training.warmup_steps, config.training.min_lr_factor = 0, 0.0
    trainer = Trainer(config, get_registry())
    trainer.close()
    (line,) = [w for w in warnings if "learning rate" in w]
    assert line.startswith("training.steps=1 with training.warmup_steps=0 decays to training.min_lr_factor=0")
    assert "learning rate 0" in line
    warnings.clear()
    config.job.dump_folder = str(tmp_path / "floor")
    config.training.min_lr_factor = 0.1  # the only step at 0.1 x lr: trains, as documented
    Trainer(config, get_registry()).close()
    assert not [w for w in warnings if "learning rate" in w]
