"""The routed experts' SwiGLU on tokens sorted by expert: grouped GEMM, or a loop over experts.

``x (tokens, dim)`` holds the tokens of expert 0, then expert 1, ...; ``counts (experts,)`` says
how many each has (zero is fine: dropless routing gives some experts no token). The weights are
stacked on the expert dimension: ``w1, w3 (experts, hidden, dim)``, ``w2 (experts, dim, hidden)``.

* :func:`swiglu_grouped_mm`: three ``grouped_mm`` calls (``torch.nn.functional.grouped_mm`` where
  torch has it, the private ``torch._grouped_mm`` of older releases otherwise) with the group
  ends ``cumsum(counts)`` as int32 offsets. On CUDA devices of compute capability 9.0 or 10.x with
  bf16 operands torch runs one CUTLASS kernel per call and never reads the counts on the host;
  elsewhere (CPU, fp32, other GPUs) torch falls back to one matmul per group.
* :func:`swiglu_loop`: one matmul chain per expert (reads the counts on the host).

Both compute the same products on the same rows, so on CPU they agree exactly (the tests check
it, forward and backward). :func:`use_grouped_mm` decides for ``experts_impl = "auto"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from titan_core.fake_tensors import even_split, is_fake


def grouped_mm_function() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM: public ``F.grouped_mm`` (newer torch) or ``torch._grouped_mm``."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _fast_kernel(device_index: int) -> bool:
    """Whether torch's grouped GEMM has its fused kernel on this CUDA device (SM 9.0 and 10.x)."""
    major, _ = torch.cuda.get_device_capability(device_index)
    return major in (9, 10)


def use_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """``experts_impl = "auto"``: the grouped kernel exists for this device and dtype, and the
    operands' strides are 16-byte aligned (``dim`` and ``hidden`` multiples of 8 in bf16)."""
    if not x.is_cuda or torch.version.hip is not None or grouped_mm_function() is None:
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype != torch.bfloat16 or not _fast_kernel(x.device.index or 0):
        return False
    hidden, dim = w1.shape[-2], w1.shape[-1]
    return dim % 8 == 0 and hidden % 8 == 0 and w2.shape[-2] == dim


def swiglu_grouped_mm(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """``w2(silu(w1 x) * w3 x)`` per expert group with grouped GEMMs (no host sync on CUDA)."""
    gmm = grouped_mm_function()
    if gmm is None:
        raise RuntimeError("this torch has no grouped GEMM (torch._grouped_mm); use experts_impl='loop'")
    # grouped_mm is not an autocast operator: cast as autocast casts the loop's matmuls (x may
    # still be fp32, the residual stream), on every device, so both paths compute alike; the
    # fused CUDA kernel also takes bf16 only.
    device = x.device.type
    if torch.is_autocast_enabled(device):
        compute = torch.get_autocast_dtype(device)
        x, w1, w2, w3 = (t.to(compute) for t in (x, w1, w2, w3))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    # torch runs other dtypes eagerly (a matmul per group) but traces the operator in bf16 only
    # (its meta function refuses the rest): outside bf16 the products run outside the graph.
    products = _swiglu_products if x.dtype == torch.bfloat16 else _swiglu_products_eager
    return products(gmm, x, offs, w1, w2, w3)


def _swiglu_products(
    gmm: Callable[..., torch.Tensor],
    x: torch.Tensor,
    offs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    # x @ w.T per group: the transposed weight views are column-major, as the kernel wants.
    h = F.silu(gmm(x, w1.transpose(-2, -1), offs=offs)) * gmm(x, w3.transpose(-2, -1), offs=offs)
    return gmm(h, w2.transpose(-2, -1), offs=offs)


_swiglu_products_eager = torch.compiler.disable(_swiglu_products)


# Not compiled: the loop's sizes are the counts read on the host, so a compiled block would
# specialise on them and recompile for every new split (an expert with 0 or 1 tokens among them)
# until dynamo's recompile limit sends the whole block back to eager. Here the compiled caller
# breaks its graph around the loop, which runs eagerly, one matmul chain per expert.
@torch.compiler.disable
def swiglu_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The same, one expert at a time (the reference, and the fallback everywhere)."""
    # Fake tensors (shape-only steps) have no counts to read: an even split stands for them.
    sizes = even_split(x.shape[0], w1.shape[0]) if is_fake(counts) else counts.tolist()
    chunks = torch.split(x, sizes)
    outs = [(F.silu(chunk @ w1[i].T) * (chunk @ w3[i].T)) @ w2[i].T for i, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-2])
