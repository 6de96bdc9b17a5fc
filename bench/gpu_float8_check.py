"""GPU checks of float8 training and of selective AC with flex attention
(``python3 -m bench.gpu_float8_check``; ``bash bench/perf.sh float8check``).

What the CPU tests (emulated float8, no flex backward on CPU) cannot see, on one H100/H200; one
PASS/FAIL line per check:

1. torchao (the carried wheel) imports on this torch and ``torch._scaled_mm`` runs: a
   ``Float8Linear`` (tensorwise and rowwise) in bf16 matches ``nn.Linear`` forward and gradients
   to float8 accuracy, eager and compiled.
2. ``titan run`` of a small 8B-shaped model on one GPU with ``float8.enable``, compile and
   selective AC: the float8 strategy applies first, FSDP2 on the 1-GPU mesh after it, the
   block linears are ``Float8Linear`` (output stays ``nn.Linear``), the loss falls and stays
   within a few percent of the same run in bf16.
3. Selective AC's ``op`` policy keeps flex attention: with the document mask, the backward of a
   checkpointed attention runs no extra flex-attention forward kernel (profiler kernel count of
   ``op`` against no checkpointing; ``full`` recomputes it, as a control), and the policy is
   asked about ``_scaled_mm`` in float8 blocks.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from bench.gpu_checks import report, run_checks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_float8_linear() -> None:
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    details = [f"torchao {torchao.__version__}"]
    ok = True
    for recipe in ("tensorwise", "rowwise"):
        for compiled in (False, True):
            torch.manual_seed(0)
            ref = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
            f8 = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False, device="cuda"))
            f8 = f8.to(torch.bfloat16)
            f8[0].weight.data.copy_(ref.weight.data)
            convert_to_float8_training(f8, config=Float8LinearConfig.from_recipe_name(recipe))
            run = torch.compile(f8) if compiled else f8
            x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y, y_ref = run(x), ref(x)
            (gx,) = torch.autograd.grad(y.float().square().mean(), x)
            (gx_ref,) = torch.autograd.grad(y_ref.float().square().mean(), x)
            err, gerr = _rel(y, y_ref), _rel(gx, gx_ref)
            ok &= type(f8[0]).__name__ == "Float8Linear" and err < 0.08 and gerr < 0.15
            details.append(f"{recipe}{' compiled' if compiled else ''}: out {err:.3f} grad {gerr:.3f}")
    report("Float8Linear against nn.Linear (bf16)", ok, "; ".join(details))


def _small_8b(float8: bool, steps: int = 12) -> Any:
    from bench.recipes import bench_8b_l8_compile

    config = bench_8b_l8_compile()
    config.model.overrides = {**config.model.overrides, "n_layers": 2}
    config.training.seq_len = 2048
    config.training.local_batch_size = 2
    config.training.steps = steps
    config.job.dump_folder = f"/tmp/titan_perf/check_float8_{int(float8)}"
    config.float8.enable = float8
    return config


def check_float8_run() -> None:
    from titan_core._registry import get_registry
    from titan_core.trainer import Trainer

    losses: dict[bool, list[float]] = {}
    t = time.perf_counter()
    for float8 in (False, True):
        trainer = Trainer(_small_8b(float8), get_registry())
        try:
            losses[float8] = [row["loss"] for row in trainer.train() if "loss" in row]
        finally:
            trainer.close()
        if float8:
            model = trainer.parts[0]
            names = [type(m).__name__ for m in model.layers["0"].modules()]
            applied = trainer.ctx.applied
            # FSDP may give the output its own class (FSDPLinear), never Float8Linear's.
            output_kept = "Float8" not in type(model.output).__name__
    f8, bf16 = losses[True], losses[False]
    close = abs(f8[-1] - bf16[-1]) / bf16[-1] < 0.05
    report(
        "titan run with float8 on one GPU",
        applied[0] == "float8"
        and "fsdp" in applied
        and names.count("Float8Linear") == 7
        and output_kept
        and f8[-1] < f8[0]
        and close,
        f"applied {applied}; Float8Linear per block {names.count('Float8Linear')}; output kept "
        f"{output_kept}; losses float8 {f8[0]:.3f} -> {f8[-1]:.3f}, bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}; "
        f"{time.perf_counter() - t:.0f}s",
    )


def _flex_kernels(mode: str) -> tuple[int, list[str]]:
    """Flex-attention (inductor template) kernels launched by forward + backward under ``mode``."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    from titan_core import blocks
    from titan_plugins_parallel.activation_checkpoint import op_policy_contexts

    torch.manual_seed(0)
    b, h, s, d = 2, 16, 2048, 64
    tokens = torch.randint(3, 2000, (b, s), device="cuda")
    tokens[:, ::300] = 1
    mask = blocks.document_mask(tokens, 1)
    q, k, v = (
        torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return blocks.attention(q * 1.0, k, v, mask=mask)

    def run() -> None:
        if mode == "none":
            out = f(q, k, v)
        elif mode == "full":
            out = checkpoint(f, q, k, v, use_reentrant=False)
        else:
            out = checkpoint(f, q, k, v, use_reentrant=False, context_fn=op_policy_contexts)
        out.float().sum().backward()

    run()  # compile and autotune outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "triton_tem" in e.name]
    return len(names), sorted(set(names))


def check_sac_keeps_flex_attention() -> None:
    none, kinds = _flex_kernels("none")
    op, _ = _flex_kernels("op")
    full, _ = _flex_kernels("full")
    report(
        "selective AC (op) does not recompute flex attention",
        none > 0 and op == none and full > none,
        f"flex template kernels: no AC {none}, op {op}, full {full} ({', '.join(kinds)[:200]})",
    )


def main() -> int:
    return run_checks((check_float8_linear, check_float8_run, check_sac_keeps_flex_attention))


if __name__ == "__main__":
    sys.exit(main())
