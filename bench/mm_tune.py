"""The 8B shape's matmuls, cuBLAS against inductor's Triton templates: ``python3 -m bench.mm_tune``.

``compile.autotune`` searches only flex attention's tiles and leaves every matmul to ATen
(cuBLAS), ``max_autotune_gemm_backends = "ATEN"``. Before a block's matmuls go to Triton's
templates instead (``"ATEN,TRITON"``: inductor keeps whichever is faster per shape, at the price
of a longer first step), this measures what that could buy, per matmul of a Llama 3 8B block at
8192 x 4 tokens (bf16): the forward ``x @ W.T``, backward's ``dy @ W`` and the weight gradient
``dy.T @ x``, each with

- ``aten``: ``torch.mm`` (cuBLAS);
- ``triton``: one ``torch.compile(mode max_autotune)`` of the same ``mm`` with only Triton's
  templates, the best tile of its search;
- ``either``: ``"ATEN,TRITON"``, what inductor picks.

Prints one JSON line per (matmul, pass) with milliseconds (median of 20 after 3) and TFLOP/s,
and a last line with the FLOP-weighted total of each variant over one block's forward, recomputed
forward (``op`` policy: ``wo`` and ``w3``) and backward. ``MM_TUNE_TOKENS`` sets M (default 32768).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from bench.flex_tune import median_ms

#: name -> (in features K, out features N, forward calls per step: 1 + recomputations).
LINEARS = {
    "wqkv": (4096, 6144, 1),
    "wo": (4096, 4096, 2),
    "w1": (4096, 14336, 1),
    "w3": (4096, 14336, 2),
    "w2": (14336, 4096, 1),
}


def _variants() -> dict[str, Any]:
    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)

    out: dict[str, Any] = {"aten": mm}
    for name, backends in (("triton", "TRITON"), ("either", "ATEN,TRITON")):
        options = {"max_autotune": True, "max_autotune_gemm_backends": backends}
        out[name] = torch.compile(mm, dynamic=False, options=options)
    return out


def main(argv: list[str]) -> int:
    tokens = int(os.environ.get("MM_TUNE_TOKENS", "32768"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, M={tokens}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    totals: dict[str, float] = {}
    for linear, (k, n, forwards) in LINEARS.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        # (pass, operands, calls per step): forward, input gradient, weight gradient.
        passes = (("fwd", (x, w.t()), forwards), ("bwd_in", (dy, w), 1), ("bwd_w", (dy.t(), x), 1))
        for pass_name, (a, b), calls in passes:
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            row: dict[str, Any] = {"linear": linear, "pass": pass_name, "calls": calls}
            for variant, fn in _variants().items():
                torch._dynamo.reset()
                try:
                    t0 = time.perf_counter()
                    fn(a, b)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    ms = median_ms(lambda fn=fn, a=a, b=b: fn(a, b))
                except Exception as exc:  # one failing variant must not hide the others
                    row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    continue
                row[variant] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
                row[variant]["first_call_s"] = round(first, 1)
                totals[variant] = totals.get(variant, 0.0) + ms * calls
            print(json.dumps(row), flush=True)
    print(json.dumps({"block_total_ms": {k: round(v, 2) for k, v in totals.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
