"""GPU check of the MoE plugin (issue: MoE for real): scaled-down real flavors train on one GPU
through the grouped-GEMM experts path.

For each case below (a published flavor with few layers, bf16 autocast, vocab and shapes as
published otherwise) it trains ``STEPS`` steps with titan's trainer on one CUDA device and checks:

* the experts ran through ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` (every call
  of the expert SwiGLU is counted; a run that fell back to the loop fails the check);
* the loss falls and stays finite; the router statistics are in the rows;
* a grouped-GEMM forward and backward equal the loop's within bf16 rounding on the GPU.

It prints one JSON row per case: tokens/s, MFU on active parameters (titan's ``flops_per_token``:
6 x the active non-embedding parameters + attention, against ``metrics.peak_tflops`` or the
device's dense bf16 peak), peak memory, and the imbalance of the last logged step; averages skip
the first ``WARMUP`` logged steps. With an argument, the rows are also written to ``DIR/gpu_moe.json``.

Run from the repository root on one H200: ``python3 -m bench.gpu_moe [DIR]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

STEPS = 30
WARMUP = 2

#: (name, flavor, model.overrides, seq_len, local_batch_size, moe settings)
CASES: list[tuple[str, str, dict[str, Any], int, int, dict[str, Any]]] = [
    # Qwen3-30B-A3B layers (128 experts of 768, top-8, q/k norm, head_dim 128), 4 of 48.
    ("qwen3_30b_a3b_l4", "qwen3_30b_a3b", {"n_layers": 4}, 4096, 4, {"aux_loss_weight": 0.001}),
    # DeepSeek-V2-Lite layers (MLA without low-rank q, 64 experts of 1408, 2 shared), 4 of 27.
    ("deepseek_v2_lite_l4", "deepseek_v2_lite", {"n_layers": 4}, 4096, 4, {"aux_loss_weight": 0.001}),
    # DeepSeek-V3 shapes (MLA, 8 groups / 4, sigmoid + bias update), 1 dense + 1 MoE layer with
    # 64 of the 256 experts (8 groups of 8) so that AdamW state fits one GPU.
    (
        "deepseek_v3_l2_e64",
        "deepseek_v3_671b",
        {"n_layers": 2, "n_dense_layers": 1, "n_experts": 64},
        4096,
        2,
        {"bias_update_rate": 0.001, "aux_loss_weight": 0.0001},
    ),
]


def _grouped_equals_loop() -> dict[str, float]:
    """One grouped GEMM forward/backward against the loop on the GPU, bf16 (relative error)."""
    import torch

    from titan_plugins_moe.grouped_mm import swiglu_grouped_mm, swiglu_loop, use_grouped_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 130, 7, 257, 1, 0, 64, 33], device="cuda")
    x = torch.randn(int(counts.sum()), 512, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(8, 256, 512, device="cuda", generator=g, dtype=torch.bfloat16) / 512**0.5
    w2 = torch.randn(8, 512, 256, device="cuda", generator=g, dtype=torch.bfloat16) / 256**0.5
    w3 = torch.randn(8, 256, 512, device="cuda", generator=g, dtype=torch.bfloat16) / 512**0.5
    assert use_grouped_mm(x, w1, w2), "the grouped kernel is not available on this device"
    results = {}
    grads = {}
    for name, fn in (("loop", swiglu_loop), ("grouped", swiglu_grouped_mm)):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = fn(leaves[0], counts, *leaves[1:])
        out.float().square().sum().backward()
        results[name] = out.float()
        grads[name] = [t.grad.float() for t in leaves]
    rel = (results["grouped"] - results["loop"]).norm() / results["loop"].norm()
    grad_rel = max(
        float((a - b).norm() / b.norm().clamp_min(1e-30))
        for a, b in zip(grads["grouped"], grads["loop"], strict=True)
    )
    return {"forward_rel_err": float(rel), "grad_rel_err": grad_rel}


def run_case(
    name: str, flavor: str, overrides: dict[str, Any], seq: int, batch: int, moe: dict[str, Any]
) -> dict:
    import torch

    from titan_core._registry import get_registry
    from titan_core.config import TrainerConfig
    from titan_core.trainer import train
    from titan_plugins_moe import moe as moe_module

    calls = {"grouped": 0, "loop": 0}
    grouped, loop = moe_module.swiglu_grouped_mm, moe_module.swiglu_loop

    def count(kind: str, fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            calls[kind] += 1
            return fn(*args)

        return wrapped

    moe_module.swiglu_grouped_mm = count("grouped", grouped)
    moe_module.swiglu_loop = count("loop", loop)
    try:
        config = TrainerConfig()
        config.model.name = "moe"
        config.model.flavor = flavor
        config.model.overrides = {"max_seq_len": seq, **overrides}
        config.job.dump_folder = tempfile.mkdtemp(prefix=f"gpu_moe_{name}_")
        config.training.steps = STEPS
        config.training.seq_len = seq
        config.training.local_batch_size = batch
        config.training.warmup_steps = 5
        config.training.lr = 3e-4
        config.training.device = "cuda"
        config.training.dtype = "bfloat16"
        config.activation_checkpoint.mode = "selective"
        config.metrics.log_freq = 5
        for key, value in moe.items():
            setattr(config.moe, key, value)
        torch.cuda.reset_peak_memory_stats()
        rows = train(config, get_registry())
    finally:
        moe_module.swiglu_grouped_mm, moe_module.swiglu_loop = grouped, loop
    steady = rows[WARMUP:] or rows
    spec = get_registry().get("models", "moe", what="model")
    args = spec.flavor(flavor, {"max_seq_len": seq, **overrides})
    losses = [r["loss"] for r in rows]
    result = {
        "case": name,
        "params_total": spec.num_params(args, True),
        "params_active": spec.num_active_params(args),
        "seq_len": seq,
        "local_batch_size": batch,
        "tokens_per_s": round(statistics.mean(r["tps"] for r in steady), 1),
        "tflops": round(statistics.mean(r["tflops"] for r in steady), 2),
        "mfu_pct_active": round(statistics.mean(r.get("mfu_pct", 0.0) for r in steady), 2),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 1024**3, 2),
        "memory_row": {k: v for k, v in rows[-1].items() if "mem" in k or "gib" in k},
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "imbalance_max_last": rows[-1].get("moe/imbalance_max"),
        "grouped_mm_calls": calls["grouped"],
        "loop_calls": calls["loop"],
    }
    result["ok"] = bool(
        calls["grouped"] > 0
        and calls["loop"] == 0
        and all(map(_finite, losses))
        and losses[-1] < losses[0]
        and result["imbalance_max_last"] is not None
    )
    return result


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu_moe needs a CUDA device", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = [{"case": "grouped_vs_loop_bf16", **_grouped_equals_loop()}]
    rows[0]["ok"] = rows[0]["forward_rel_err"] < 2e-2 and rows[0]["grad_rel_err"] < 2e-2
    print(json.dumps(rows[0]), flush=True)
    for case in CASES:
        result = run_case(*case)
        print(json.dumps(result), flush=True)
        rows.append(result)
        torch.cuda.empty_cache()
    if argv:
        out = Path(argv[0])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_moe.json").write_text(json.dumps(rows, indent=2))
    ok = all(r["ok"] for r in rows)
    print("gpu_moe:", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
