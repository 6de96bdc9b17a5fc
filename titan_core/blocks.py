"""Shared building blocks for decoder model plugins: RMSNorm, rotary embeddings, SwiGLU, attention,
the pre-norm decoder block.

A model plugin composes these instead of copying them (titan's Llama 3 and MoE models do)::

    from titan_core import blocks

    freqs_cis = blocks.rope_frequencies(head_dim, max_seq_len, theta=5e5, scaling=blocks.RopeScaling())
    q, k = blocks.apply_rope(q, freqs_cis), blocks.apply_rope(k, freqs_cis)  # (batch, seq, heads, hd)
    mask = blocks.document_mask(tokens, bos_id)                             # once per forward
    out = blocks.attention(q, k, v, mask=mask)                              # (batch, heads, seq, hd)
    ffn = blocks.FeedForward(dim, hidden_dim)                               # w2(silu(w1 x) * w3 x)
    norm = blocks.RMSNorm(dim, eps=1e-5)                                    # torch's nn.RMSNorm
    attn = blocks.Attention(dim, n_heads, n_kv_heads)  # wq/wk/wv/wo + RoPE; forward(x, freqs_cis, mask)
    q, k, v = blocks.project_qkv(attn.wq, attn.wk, attn.wv, x)              # one matmul where it can
    block = blocks.DecoderBlock(layer_id, dim, 1e-5, attn, ffn)  # x + attn(norm x), + ffn(norm h)

**The attention-function contract.** An attention module stores its attention function in
``self.attention_fn`` (default :func:`attention`) and calls it on ``(batch, heads, seq, head_dim)``
tensors. A context-parallel strategy replaces ``attention_fn`` with one that sees the whole
sequence. Two optional parts of the contract, both declared by the function, keep old functions
working unchanged:

- *Grouped K/V*: a function whose attribute ``grouped_kv`` is true accepts K/V with fewer heads
  than Q (``n_heads`` a multiple of ``n_kv_heads``, each K/V head shared by consecutive query
  heads, as ``repeat_interleave`` would). For any other function the caller expands K/V first
  (:func:`call_attention` does this), so a replacement written for expanded heads stays correct.
- *Masks*: the model calls ``attention_fn(q, k, v, mask=mask)`` only when it uses a document
  mask; ``mask=None`` (or no argument) means causal attention over the whole sequence.

**Document masking** (block-causal attention over packed documents): titan's data loader frames
every document as ``BOS ... EOS`` and packs them into fixed-length sequences, so a token's
document is the number of BOS tokens at or before it (:func:`document_ids`). The mask lets a
query see keys of the same document at or before its own position. :func:`document_mask` builds
it once per forward: a flex-attention ``BlockMask`` on CUDA (fully masked blocks are skipped, so
attention costs what the documents need; its mask function reads each key's document end,
:func:`document_ends`) and a boolean ``(batch, 1, seq, seq)`` tensor elsewhere (SDPA with an
explicit mask: exact, for CPU runs and tests). Flex attention runs compiled: by a compiled
block's graph when the caller is compiled, else by its own ``torch.compile`` (made once).
Building the mask needs the token ids: a pipeline stage after the first gets them as
``input_tokens`` (:func:`stage_inputs`), and a context-parallel shard builds its rows of the whole
sequences' mask (:func:`document_mask_rows`; :func:`causal_mask_rows` without documents), again a
``BlockMask`` on CUDA, so that a shard skips the blocks above the diagonal too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.errors import UsageError

#: torch's fused RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``); re-exported so that model
#: plugins import every block from one place.
RMSNorm = nn.RMSNorm


@attrs.frozen
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (long wavelengths slowed by ``factor``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


def rope_frequencies(
    head_dim: int,
    seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Complex rotations ``(seq_len, head_dim // 2)``; ``scaling=None`` is plain RoPE."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    if scaling is not None:
        low_wavelen = scaling.original_max_len / scaling.low_freq_factor
        high_wavelen = scaling.original_max_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / freqs
        # Long wavelengths are slowed by the factor, short ones kept, the middle interpolated.
        smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = (1 - smooth) * freqs / scaling.factor + smooth * freqs
        freqs = torch.where(
            wavelen > low_wavelen,
            freqs / scaling.factor,
            torch.where(wavelen < high_wavelen, freqs, scaled),
        )
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (batch, seq, heads, head_dim)`` by the first ``seq`` rows of ``freqs_cis``.

    Each pair ``(x[2i], x[2i+1])`` is multiplied by the complex ``freqs_cis[pos, i]``. Under
    ``torch.compile`` it is written out in real arithmetic (``(a + bi)(c + di) = (ac - bd) +
    (ad + bc)i``, the same float32 operations, so the result is that of the complex multiply):
    inductor generates no code for complex operators, so a complex multiply in a compiled block
    ran as separate eager kernels in forward, recomputation and backward (1.3% of an 8B-shape
    step on an H200), while the real form fuses with its neighbours. Eager, every elementwise op
    is its own kernel and a full float32 pass over q or k: there the complex multiply, one
    kernel each way, is the fast form (the real form's ten passes are the likely cause of an
    eager 1B-shape run falling from 1.075x torchtitan to 0.92x; 3-4x the time on CPU).
    ``freqs_cis`` may also be given as its real view ``(seq, head_dim // 2, 2)``.
    """
    # freqs_cis may cover more positions than x (the whole buffer): x's length is only known
    # here, after sequence-parallel activations were gathered for attention.
    rows = freqs_cis[: x.shape[1]]
    return _rotate_real(x, rows) if torch.compiler.is_compiling() else _rotate_complex(x, rows)


def _rotate_complex(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope`'s eager form: ``x`` times the complex ``rows`` (``x.shape[1]`` of them)."""
    table = rows if rows.is_complex() else torch.view_as_complex(rows)
    # Contiguous: a complex view needs even strides and offset, which a float32 slice of a wider
    # projection (MLA's rope part) need not have; a bf16 x is copied by float() anyway.
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


def _rotate_real(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope`'s compiled form: the same product written out in real arithmetic."""
    rotation = (torch.view_as_real(rows) if rows.is_complex() else rows).view(1, x.shape[1], 1, -1, 2)
    cos, sin = rotation[..., 0], rotation[..., 1]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)`` without biases (Llama's).

    ``fuse_w13`` computes ``w1 x`` and ``w3 x`` with one matmul over ``cat(w1, w3)`` when both
    projections allow it (:func:`_fusable`), as Megatron-LM's fused gate/up projection: one GEMM
    twice as wide in forward and in backward, while the parameters, their names and checkpoints
    stay ``w1``/``w3``. It is a trade, hence off by default: selective activation checkpointing's
    ``op`` policy, which keeps every other matmul's output, then keeps the gate and the up
    projection together and recomputes only ``wo`` in a Llama block (``wo`` and ``w3``
    separately), for one more ``hidden_dim``-wide activation per token and block kept.
    """

    def __init__(self, dim: int, hidden_dim: int, *, fuse_w13: bool = False) -> None:
        super().__init__()
        self.fuse_w13 = fuse_w13
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_fused((self.w1, self.w3), x, fuse=self.fuse_w13)
        return self.w2(F.silu(gate) * up)

    def init_weights(self, std: float) -> None:
        """``w1`` at std 0.02, the others at ``std`` (depth-scaled by the caller), as torchtitan."""
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``(batch, seq)`` index of each token's document: the number of BOS tokens up to it.

    Tokens before the first BOS (the tail of a document cut by the packing) form document 0.
    """
    return torch.cumsum(tokens == bos_id, dim=1, dtype=torch.int32)


def document_mask(tokens: torch.Tensor, bos_id: int) -> Any:
    """The block-causal mask of a packed batch ``tokens (batch, seq)``, for :func:`attention`.

    On CUDA a flex-attention ``BlockMask`` (built by a compiled kernel, no ``seq x seq`` tensor);
    elsewhere a boolean ``(batch, 1, seq, seq)`` tensor, True where the query may see the key.
    """
    if tokens.device.type == "cuda":
        return _document_block_mask(document_ends(tokens, bos_id))
    return _dense_document_rows(tokens, bos_id, torch.arange(tokens.shape[1], device=tokens.device))


def document_mask_rows(tokens: torch.Tensor, bos_id: int, positions: torch.Tensor) -> Any:
    """The rows of the block-causal mask of ``tokens (batch, seq)`` at the query ``positions
    (local,)``, over every key in sequence order. What a context-parallel rank holding those
    positions attends with, once it has every rank's K/V (a document may start on another rank's
    shard). On CUDA a flex-attention ``BlockMask`` of ``local x seq``; elsewhere a boolean
    ``(batch, 1, local, seq)`` tensor, True where the query may see the key."""
    if tokens.device.type == "cuda":
        return _rows_block_mask(positions, tokens.shape[1], document_ends(tokens, bos_id))
    return _dense_document_rows(tokens, bos_id, positions)


def causal_mask_rows(positions: torch.Tensor, seq_len: int) -> Any:
    """The rows at the query ``positions (local,)`` of the causal mask over ``seq_len`` keys in
    sequence order: a context-parallel shard's mask without documents. On CUDA a flex-attention
    ``BlockMask`` (the blocks above the diagonal are skipped, where a dense mask pays for every
    score); elsewhere a boolean ``(local, seq_len)`` tensor, True where the query may see the key."""
    if positions.device.type == "cuda":
        return _rows_block_mask(positions, seq_len)
    return _dense_causal_rows(positions, seq_len)


def _dense_causal_rows(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    return positions[:, None] >= torch.arange(seq_len, device=positions.device)[None, :]


def _dense_document_rows(tokens: torch.Tensor, bos_id: int, positions: torch.Tensor) -> torch.Tensor:
    docs = document_ids(tokens, bos_id)
    causal = _dense_causal_rows(positions, tokens.shape[1])
    return (causal & (docs[:, positions][:, :, None] == docs[:, None, :]))[:, None]


def stage_inputs(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    input_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """What a decoder's blocks take: ``(h, freqs_cis, mask)`` for ``tokens`` (or hidden states).

    ``model`` has ``args`` (``document_mask``, ``bos_id``), ``tok_embeddings`` (``None`` on a
    pipeline stage after the first, whose input is already hidden states) and ``freqs_cis``.
    ``positions (seq,)`` selects the rotary rows of a sequence shard (context parallel); without
    it attention takes the first rows it needs (:func:`apply_rope`). ``mask`` is ``None`` unless
    ``args.document_mask``. The mask comes from the token ids: the input itself on the first
    stage, and ``input_tokens (batch, seq)`` on a later one. The pipeline strategy passes every
    stage the token ids of its microbatch under that keyword, when the stage's ``forward``
    accepts it (docs/plugins.md, "The decoder protocol"). Under context parallel (``positions``
    given) ``input_tokens`` holds the whole sequences, and ``mask`` is this shard's rows of the
    mask over every key (:func:`document_mask_rows`).
    """
    mask = None
    first = model.tok_embeddings is not None
    if model.args.document_mask:
        ids = input_tokens if input_tokens is not None else tokens if first else None
        if ids is None:
            raise UsageError(
                "model.overrides.document_mask: this pipeline stage has no embedding, and its forward "
                "got no input_tokens to build the mask from; the pipeline strategy in use must pass "
                "them (titan's pp does), or set model.overrides.document_mask = False"
            )
        if positions is not None and ids.shape[1] > positions.numel():
            # A context-parallel shard: its rows of the whole sequences' mask.
            mask = document_mask_rows(ids, model.args.bos_id, positions)
        else:
            mask = document_mask(ids, model.args.bos_id)
    h = model.tok_embeddings(tokens) if first else tokens
    freqs_cis = model.freqs_cis[positions] if positions is not None else model.freqs_cis
    return h, freqs_cis, mask


def document_ends(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``(batch, seq)`` position of the last token of each token's document (int32).

    With it the block-causal mask is ``kv <= q <= end[kv]``: one lookup per score instead of
    comparing two document ids (torchtitan's fast path for packed documents).
    """
    batch, seq = tokens.shape
    pos = torch.arange(seq, device=tokens.device, dtype=torch.int32).expand(batch, seq)
    starts = torch.where(tokens == bos_id, pos, torch.full_like(pos, seq))
    # The first document start at or after each position (a suffix minimum), shifted by one:
    # the start of the next document after each token, or seq when there is none.
    next_start = starts.flip(1).cummin(1).values.flip(1)
    following = torch.cat([next_start[:, 1:], torch.full_like(next_start[:, :1], seq)], dim=1)
    return following - 1


def _document_block_mask(ends: torch.Tensor, compiled: bool = True) -> Any:
    """Flex attention's ``BlockMask`` of the block-causal mask given :func:`document_ends`."""

    def block_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx <= ends[b, kv_idx])

    batch, seq = ends.shape
    return _block_mask_builder(compiled)(block_causal, batch, None, seq, seq, device=ends.device)


def _rows_block_mask(
    positions: torch.Tensor, seq_len: int, ends: torch.Tensor | None = None, compiled: bool = True
) -> Any:
    """Flex attention's ``BlockMask`` of the rows at query ``positions (local,)`` over ``seq_len``
    keys in sequence order: causal, and block-causal with ``ends`` (:func:`document_ends`).
    Query block ``i`` holds the queries at ``positions[i*128:(i+1)*128]``; context parallel's
    chunks are contiguous runs of positions, so whole blocks of keys are still skipped."""
    if ends is None:

        def rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return positions[q_idx] >= kv_idx

    else:

        def rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            query = positions[q_idx]
            return (query >= kv_idx) & (query <= ends[b, kv_idx])

    batch = None if ends is None else ends.shape[0]
    build = _block_mask_builder(compiled)
    return build(rows, batch, None, positions.numel(), seq_len, device=positions.device)


def _block_mask_builder(compiled: bool) -> Any:
    """``create_block_mask``, compiled unless asked not to or already inside a compiled graph.

    Compiled, it evaluates the mask block by block instead of materialising (batch, q, kv)
    booleans. A new mask function per batch does not recompile: dynamo guards on its code, and
    the tensors it reads become graph inputs."""
    from torch.nn.attention.flex_attention import create_block_mask

    if compiled and not torch.compiler.is_compiling():
        return _compiled_create_block_mask()
    return create_block_mask


@functools.cache
def _compiled_create_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


#: Inductor options of the flex-attention kernel, torchtitan 0.3's: autotuned tile sizes (the
#: first step of a shape pays for the search; the results are cached on disk), no CUDA graphs,
#: and the compiled region wrapped as one operator so that selective activation checkpointing
#: can keep its output instead of recomputing it.
_FLEX_OPTIONS = {
    "wrap_inductor_compiled_regions": True,
    "max_autotune": True,
    "coordinate_descent_tuning": True,
    "triton.cudagraphs": False,
}


@functools.cache
def _compiled_flex_attention() -> Any:
    import torch._inductor.config as inductor_config
    from torch.nn.attention.flex_attention import flex_attention

    def known(name: str) -> bool:  # options differ between torch releases
        owner: Any = inductor_config
        for part in name.split("."):
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True

    # flex attention is only fast compiled (eager runs a reference implementation that builds
    # the whole score matrix); compiled here, an uncompiled model gets the fused kernel too.
    options = {k: v for k, v in _FLEX_OPTIONS.items() if known(k)}
    return torch.compile(flex_attention, dynamic=False, options=options)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None) -> torch.Tensor:
    """Scaled dot-product attention on ``(batch, heads, seq, head_dim)`` tensors.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention, no K/V copies: SDPA's
    and flex attention's ``enable_gqa``). ``mask``: ``None`` for causal attention, a boolean
    tensor broadcastable to ``(batch, heads, q_seq, k_seq)`` (True = attend), or a flex-attention
    ``BlockMask`` (from :func:`document_mask` on CUDA).
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        if gqa and q.device.type == "cuda":
            # On CUDA, SDPA with an explicit mask and enable_gqa falls back to its math kernel,
            # which holds every score (O(seq^2) memory); expanded K/V keep the memory-efficient one.
            k, v = _expand_kv(q, k, v)
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if torch.compiler.is_compiling():  # inside a compiled block: flex attention joins its graph
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)


attention.grouped_kv = True  # type: ignore[attr-defined]


def call_attention(
    fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None
) -> torch.Tensor:
    """Call an attention function under the contract above (expanding K/V heads for a function
    that does not declare ``grouped_kv``; passing ``mask`` only when there is one)."""
    if q.shape[1] != k.shape[1] and not getattr(fn, "grouped_kv", False):
        k, v = _expand_kv(q, k, v)
    return fn(q, k, v) if mask is None else fn(q, k, v, mask=mask)


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped K/V with as many heads as ``q``: each K/V head repeated for its query heads."""
    repeats = q.shape[1] // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def _fusable(linears: tuple[nn.Module, ...]) -> bool:
    """Whether the projections can run as one matmul over their concatenated weights.

    Only plain ``nn.Linear`` modules without biases or hooks holding plain weights: a subclass
    (torchao's ``Float8Linear``) computes differently, a hook (LoRA, activation statistics)
    expects its module to run, and a DTensor weight (tensor parallel) would be concatenated over
    its sharded dimension. FSDP2's weights are plain tensors inside the forward.
    """
    return all(
        type(m) is nn.Linear
        and m.bias is None
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and not isinstance(m.weight, DTensor)
        for m in linears
    )


def project_fused(
    linears: tuple[nn.Module, ...], x: torch.Tensor, *, fuse: bool = True
) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``: one matmul over the concatenated weights when ``fuse``
    and the projections allow it (:func:`_fusable`), one call each otherwise. Fused, the outputs
    are views of the one output."""
    if not (fuse and _fusable(linears)):
        return tuple(m(x) for m in linears)
    weights = [m.weight for m in linears]
    return F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)


def project_qkv(
    wq: nn.Module, wk: nn.Module, wv: nn.Module, x: torch.Tensor, *, fuse: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wq(x), wk(x), wv(x)`` through :func:`project_fused`.

    Fused, ``q`` and ``k`` are views of the one output and ``v`` is a copy of its slice: attention
    saves V for backward, and a saved view would keep the whole fused output (Q and K too) alive
    until backward, one more ``dim + kv_dim`` wide activation per token and layer than separate
    projections hold without activation checkpointing. A caller that saves Q or K for backward
    itself (a norm over them) makes them contiguous first, for the same reason.
    """
    q, k, v = project_fused((wq, wk, wv), x, fuse=fuse)
    return q, k, v.contiguous()


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE: ``wq/wk/wv/wo`` projections, no biases.

    ``forward(x (batch, seq, dim), freqs_cis, mask=None)``. Heads are reshaped with ``-1``
    (``view(batch, seq, -1, head_dim)``) so the module works on a tensor-parallel slice of them.

    ``fuse_qkv`` (default) computes Q, K and V with one matmul over ``cat(wq, wk, wv)`` when
    the three projections allow it (:func:`_fusable`), separately otherwise: one large GEMM
    instead of three (two of them narrow, ``n_kv_heads * head_dim`` wide) in forward and in
    backward, while the parameters, their names and checkpoints stay ``wq``/``wk``/``wv``.
    Selective activation checkpointing then counts one matmul where it counted three.
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, fuse_qkv: bool = True
    ) -> None:
        super().__init__()
        self.fuse_qkv = fuse_qkv
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        # Replaced by context parallelism with an attention that sees the whole sequence.
        self.attention_fn: Any = attention

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = project_qkv(self.wq, self.wk, self.wv, x, fuse=self.fuse_qkv)
        q = q.view(bs, seq, -1, self.head_dim)
        k = k.view(bs, seq, -1, self.head_dim)
        v = v.view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        out = call_attention(self.attention_fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, std: float) -> None:
        """``wq/wk/wv`` at std 0.02, ``wo`` at ``std`` (depth-scaled by the caller), as torchtitan."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: ``h = x + attention(norm(x))``, then ``h + feed_forward(norm(h))``.

    ``attention`` is called as ``attention(x, freqs_cis, mask=mask)`` and both sub-modules have
    ``init_weights(std)``; ``std`` is the depth-scaled init of the residual projections,
    ``0.02 / sqrt(2 (layer_id + 1))`` as in torchtitan. The parameter names (``attention.*``,
    ``feed_forward.*``, ``attention_norm``, ``ffn_norm``) are what the TP plans, activation
    checkpointing and the Hugging Face mappings of the model plugins address.
    """

    def __init__(
        self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module
    ) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        # The mask as a keyword: the TP plans' PrepareModuleInput lays out positional inputs only.
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


def tp_plan_ends(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    """The tensor-parallel plan of a decoder's ends, shared by titan's model plugins.

    The token embedding is split over the vocabulary and hands the first block a sequence shard;
    the final norm runs on sequence shards; the output projection gathers the sequence and keeps
    its logits split over the vocabulary under loss parallelism (``Shard(-1)``) or replicates
    them. Missing ends (``None`` on a middle pipeline stage) are skipped. Tied embeddings are
    re-tied: both weights are ``Shard(0)`` over the vocabulary on the same mesh.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top: dict[str, Any] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    if tied and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
