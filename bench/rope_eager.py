"""Eager RoPE: the complex multiply against the real form, forward and backward, on CUDA.

``titan_core.blocks.apply_rope`` rotates with one complex multiply when eager and in real
arithmetic under ``torch.compile`` (inductor fuses the real form; it has no code for complex
operators). This times both forms eagerly on one block's q and k of a benchmark shape, as a
block's selective AC runs them: forward, recomputation, backward. Run on the GPU machine::

    python3 -m bench.rope_eager [1b] [8b]

It prints milliseconds per block for each form, and what the real form would add to a step of
the shape's layers.
"""

from __future__ import annotations

import sys

import torch

from titan_core import blocks

#: name: (batch, seq, heads, kv_heads, head_dim, layers), the benchmark recipes' shapes.
SHAPES = {"1b": (8, 4096, 32, 8, 64, 16), "8b": (4, 8192, 32, 8, 128, 8)}


def real_form(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The rotation in real arithmetic, the form ``apply_rope`` takes under ``torch.compile``."""
    return blocks._rotate_real(x, freqs_cis[: x.shape[1]])


def per_block_ms(form, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, repeats: int = 20) -> float:
    """One block's rotations of q and k: forward twice (forward and recomputation), backward once."""

    def once() -> None:
        for x in (q, k):
            with torch.no_grad():
                form(x, freqs)  # the recomputation's forward (its result is what backward uses)
            y = form(x, freqs)
            y.backward(torch.ones_like(y))

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(names: list[str]) -> None:
    for name in names or list(SHAPES):
        batch, seq, heads, kv_heads, head_dim, layers = SHAPES[name]
        freqs = blocks.rope_frequencies(head_dim, seq, theta=5e5, device="cuda")
        like = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
        q = torch.randn(batch, seq, heads, head_dim, **like)
        k = torch.randn(batch, seq, kv_heads, head_dim, **like)
        differ = (blocks.apply_rope(q, freqs).float() - real_form(q, freqs).float()).abs().max().item()
        complex_ms = per_block_ms(blocks.apply_rope, q, k, freqs)
        real_ms = per_block_ms(real_form, q, k, freqs)
        print(
            f"{name}: eager rope per block, complex {complex_ms:.2f} ms, real {real_ms:.2f} ms; "
            f"the real form adds {(real_ms - complex_ms) * layers:.1f} ms to a step of {layers} layers "
            f"(largest difference of the two forms' q: {differ:.3g})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
