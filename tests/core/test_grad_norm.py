"""``titan_core.grad_norm``: the total gradient norm that clipping and the logs use."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from titan_core.grad_norm import clip_grad_norm, total_grad_norm


def _model_with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048, bias=False), nn.Linear(2048, 256))
    for p in model.parameters():  # a wide range of magnitudes, as real gradients have
        p.grad = torch.randn_like(p) * torch.rand_like(p).pow(8)
    return model


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(
        parallel_dims=SimpleNamespace(pp=1), topology=SimpleNamespace(device=torch.device("cpu"))
    )


def test_the_cpu_norm_is_the_exact_one_not_a_float32_running_sum() -> None:
    """CPU's float32 norm kernel sums a tensor's squares one after another: over millions of
    elements it is off by 1e-5 relative and more, enough that one process and FSDP 2 (which sums
    half of each tensor per rank) log and clip with visibly different norms."""
    model = _model_with_grads()
    exact = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
    norm = total_grad_norm([model], _ctx())  # type: ignore[arg-type]
    assert norm.dtype == torch.float32
    assert abs(norm.item() - exact) / exact < 2e-7


def test_clipping_scales_every_gradient_to_the_max_norm() -> None:
    model = _model_with_grads()
    before = total_grad_norm([model], _ctx())  # type: ignore[arg-type]
    returned = clip_grad_norm([model], 0.5, _ctx())  # type: ignore[arg-type]
    assert returned.item() == before.item()
    after = total_grad_norm([model], _ctx())  # type: ignore[arg-type]
    assert abs(after.item() - 0.5) < 1e-5
