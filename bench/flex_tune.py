"""Flex attention's kernels on this GPU, per benchmark shape: ``python3 -m bench.flex_tune [SHAPE ...]``.

Times one attention call forward and backward (bf16, grouped-query, the block-causal mask of the
peer kit's packed documents, as ``bench/recipes.py`` trains) compiled the ways titan can compile
it, so that a change of inductor options is measured before it goes into a model:

- ``block``: flex attention traced into a compiled function with default options (what a
  compiled transformer block gets: inductor's default tiles for this GPU);
- ``autotune``: the same with ``max_autotune`` (tiles searched at the first call) and ATen
  matmuls (so that only the Triton templates are searched);
- ``tma``: default tiles with ``kernel_options={"USE_TMA": True}`` (Hopper's tensor memory
  accelerator for the loads);
- ``autotune_tma``: both;
- ``varlen``: not flex attention but Flash Attention's variable-length kernel
  (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) on the same documents, each packed
  document one causal sequence (the candidate replacement kernel: the same masking, exact per
  document rather than at flex's 128-token block granularity).

``FLEX_TUNE_VARIANTS=block,varlen`` runs only the named variants. Prints one JSON line per
(shape, variant) with the forward and forward+backward milliseconds (median over 20 calls after
3), the mask's share of computed blocks and the build time of the mask; and the compile wall
time of each variant.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch

#: shape name -> (batch, q heads, kv heads, seq, head_dim): bench_1b_compile's, bench_8b_l8_compile's.
SHAPES = {"1b": (8, 32, 8, 4096, 64), "8b": (4, 32, 8, 8192, 128)}
_AUTOTUNE = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}
#: Tiles of 64 everywhere (forward and both backward loops): the largest a 64-token mask allows.
_TILES_64 = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
_TILES_64 |= {f"bwd_{k}": 64 for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")}
#: name -> (inductor options, kernel options, the mask's block size).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, int]] = {
    "block": ({}, None, 128),
    "autotune": (_AUTOTUNE, None, 128),
    "tma": ({}, {"USE_TMA": True}, 128),
    "autotune_tma": (_AUTOTUNE, {"USE_TMA": True}, 128),
    # A finer mask skips more of the tiles across document boundaries and above the diagonal,
    # but forces tiles of at most 64 tokens: measured against 128-token masks at the same tiles.
    "tiles64": ({}, _TILES_64, 128),
    "mask64_tiles64": ({}, _TILES_64, 64),
    "mask64_autotune": (_AUTOTUNE, None, 64),
}


def median_ms(fn: Any, warmup: int = 3, iters: int = 20) -> float:
    """Median CUDA-event milliseconds of ``fn()`` over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape: str) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    from bench.handloop import batches
    from titan_core import blocks
    from titan_core.data.loader import load_tokenizer

    batch, heads, kv_heads, seq, head_dim = SHAPES[shape]
    data, tokenizer = os.environ.get("TITAN_BENCH_DATA"), os.environ.get("TITAN_BENCH_TOKENIZER")
    if not data or not tokenizer:
        # Without them the loader falls back to titan's bundled corpus, whose documents are far
        # shorter than the peer kit's: another mask, so timings that compare with nothing.
        raise SystemExit(
            "bench.flex_tune: set TITAN_BENCH_DATA and TITAN_BENCH_TOKENIZER to the peer kit's data "
            "and tokenizer (bench/perf.sh exports them; see its header)"
        )
    tokens = batches(data, tokenizer, seq, batch, 1)[0, :, :-1].cuda()
    bos = load_tokenizer(tokenizer).bos_id
    mask = blocks.document_mask(tokens, bos)
    torch.cuda.synchronize()
    build_ms = median_ms(lambda: blocks.document_mask(tokens, bos))
    kv_blocks = _computed_blocks(mask)
    causal_blocks = batch * (seq // 128) * (seq // 128 + 1) // 2
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(h: int) -> torch.Tensor:
        x = torch.randn(batch, h, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    # FLEX_TUNE_VARIANTS=block,varlen: only those (the 8B tile search takes minutes).
    chosen = os.environ.get("FLEX_TUNE_VARIANTS", ",".join([*VARIANTS, "varlen"])).split(",")
    masks = {128: (mask, kv_blocks)}
    for name, (options, kernel_options, mask_block) in VARIANTS.items():
        if name not in chosen:
            continue
        torch._dynamo.reset()
        if mask_block not in masks:
            finer = _document_mask(tokens, bos, mask_block)
            masks[mask_block] = (finer, _computed_blocks(finer) * (mask_block / 128) ** 2)
        block_mask, computed = masks[mask_block]

        def attend(q: Any, k: Any, v: Any, m: Any, ko: Any = kernel_options) -> Any:
            return flex_attention(q, k, v, block_mask=m, enable_gqa=True, kernel_options=ko)

        try:
            fn = torch.compile(attend, dynamic=False, options=options)
            t0 = time.perf_counter()
            fn(q, k, v, block_mask).backward(grad)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            with torch.no_grad():
                fwd = median_ms(lambda fn=fn, m=block_mask: fn(q, k, v, m))
            both = median_ms(lambda fn=fn, m=block_mask: fn(q, k, v, m).backward(grad))
            row: dict[str, Any] = {"fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(both, 3)}
            row["compile_s"] = round(compile_s, 1)
        except Exception as exc:  # one failing variant must not hide the others
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        record = {"shape": shape, "variant": name, **row}
        # In units of 128 x 128 blocks, so that masks of other block sizes compare.
        record["mask_blocks_share"] = round(computed / causal_blocks, 3)
        record["mask_block"] = mask_block
        record["mask_build_ms"] = round(build_ms, 3)
        print(json.dumps(record), flush=True)
    if "varlen" in chosen:
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        with torch.no_grad():
            reference = flex(q, k, v, block_mask=mask, enable_gqa=True)
        row = _varlen(tokens, bos, q, k, v, grad, reference)
        print(json.dumps({"shape": shape, "variant": "varlen", **row}), flush=True)


def _computed_blocks(mask: Any) -> int:
    """The blocks ``mask`` computes, partial and full."""
    full = mask.full_kv_num_blocks
    return int(mask.kv_num_blocks.sum().item() + (full.sum().item() if full is not None else 0))


def _document_mask(tokens: Any, bos: int, block: int) -> Any:
    """titan's block-causal document mask (``blocks.document_mask``) at another block size."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titan_core import blocks

    ends = blocks.document_ends(tokens, bos)

    def block_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx <= ends[b, kv_idx])

    batch, seq = tokens.shape
    build = torch.compile(create_block_mask)
    return build(block_causal, batch, None, seq, seq, device=tokens.device, BLOCK_SIZE=block)


def _varlen(tokens: Any, bos: int, q: Any, k: Any, v: Any, grad: Any, reference: Any) -> dict[str, Any]:
    """Flash Attention's varlen kernel on the documents of ``tokens``: fwd and fwd+bwd ms, and
    its largest difference from flex attention's output ``reference`` (the same masking)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return {"error": f"ImportError: {exc}"}
    batch, seq = tokens.shape
    starts = (tokens == bos).clone()
    starts[:, 0] = True  # every row starts a sequence, whatever its first token
    flat = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat([flat, torch.tensor([batch * seq], device=flat.device, dtype=torch.int32)])
    lengths = cu[1:] - cu[:-1]
    max_len = int(lengths.max())

    def packed(x: Any) -> Any:  # (batch, heads, seq, dim) -> (batch * seq, heads, dim)
        return x.detach().transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]).requires_grad_()

    qp, kp, vp = packed(q), packed(k), packed(v)
    gp = grad.transpose(1, 2).reshape(batch * seq, grad.shape[1], grad.shape[3])
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    row: dict[str, Any] = {"documents": int(lengths.numel()), "max_document": max_len}
    row["mean_document"] = round(batch * seq / lengths.numel(), 1)
    # (name, grouped K/V, max_len): the bound ``seq`` needs no host read of the lengths (a model
    # cannot read them without a sync every step), at the price of empty tiles in the grid.
    for name, gqa, bound in (
        ("gqa", True, max_len),
        ("gqa_bound_seq", True, seq),
        ("kv_copied", False, max_len),
    ):
        kk, vv = (
            (kp, vp)
            if gqa
            else (
                kp.detach().repeat_interleave(q.shape[1] // k.shape[1], 1).requires_grad_(),
                vp.detach().repeat_interleave(q.shape[1] // k.shape[1], 1).requires_grad_(),
            )
        )
        extra = {"enable_gqa": True} if gqa and "enable_gqa" in params else {}

        def attend(kk: Any = kk, vv: Any = vv, extra: dict[str, Any] = extra, bound: int = bound) -> Any:
            return varlen_attn(qp, kk, vv, cu, cu, bound, bound, **causal, **extra)

        try:
            out = attend()
            out.backward(gp)
            torch.cuda.synchronize()
            flat_ref = reference.transpose(1, 2).reshape(out.shape)
            row[f"{name}_max_abs_diff_vs_flex"] = round(float((out.detach() - flat_ref).abs().max()), 5)
            with torch.no_grad():
                fwd = median_ms(attend)
            both = median_ms(lambda attend=attend: attend().backward(gp))
            row[name] = {"fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(both, 3)}
        except Exception as exc:  # GQA may need torch >= 2.12's enable_gqa: try with copies too
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def main(argv: list[str]) -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for shape in argv or list(SHAPES):
        measure(shape)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
