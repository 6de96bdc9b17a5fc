"""What one compiled block keeps for backward and recomputes, per recomputation choice, on no GPU.

``python3 -m bench.recompute_plan --config bench_8b_l8_compile [--budgets 0.4 0.45 0.5]`` builds
the first block of a ``bench/recipes.py`` configuration on the meta device (bf16, the benchmark's
batch and sequence), compiles it with the ``aot_eager`` backend (AOTAutograd's partitioner as
under inductor, no kernels), runs forward and backward on meta tensors, and prints per block: the
bytes autograd saves for backward (activations, and the bf16 weights the matmuls keep), the
forward FLOPs and the FLOPs backward spends recomputing forward work (backward minus twice the
forward). Rows: no activation checkpointing, the selective ``op`` policy, and
``activation_checkpoint.mode = "memory_budget"`` at each budget. It plans a GPU measurement
(``bench/perf.sh recompute``); it measures no time.

Flex attention has no meta kernel, so attention is a stand-in operator with flex attention's
interface to autograd: it saves q, k, v, its output and the log-sum-exp, and counts the FLOPs of
causal attention over ``--attended`` of the causal blocks (document masking skips the rest; 0.5
is about what the bench data's document lengths leave at seq 8192). The partitioner prices
recomputation by these FLOP counts (``activation_memory_budget_runtime_estimator = "flops"``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch
from torch import Tensor, nn

from bench.recipes import CONFIGS, _bench

#: Share of the causal attention blocks flex attention computes under document masking.
_ATTENDED = [0.5]


@torch.library.custom_op("titan_plan::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    raise NotImplementedError("a planning stand-in: meta tensors only")


@_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titan_plan::attention_backward", mutates_args=())
def _attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    raise NotImplementedError("a planning stand-in: meta tensors only")


@_attention_backward.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, Tensor]) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx: Any, grad: Tensor, _grad_lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _attention_backward(*ctx.saved_tensors, grad)


_attention.register_autograd(_backward, setup_context=_setup)


def _attention_flops(q_shape: Any, *_: Any, **__: Any) -> int:
    batch, heads, seq, head_dim = q_shape
    return int(4 * batch * heads * seq * seq * head_dim * 0.5 * _ATTENDED[0])


@functools.cache  # once per process: a second registration is an error
def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.titan_plan.attention)(_attention_flops)
    register_flop_formula(torch.ops.titan_plan.attention_backward)(
        # Twice the forward, like a matmul's backward, so that backward minus twice the forward
        # is the recomputation alone (flex attention's backward does about 2.5 times its forward;
        # the partitioner prices forward operators only, so this changes no choice).
        lambda q_shape, *a, **k: 2 * _attention_flops(q_shape)
    )


def stand_in_attention(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    return _attention(q, k, v)[0]


stand_in_attention.grouped_kv = True  # type: ignore[attr-defined]


#: ``measure``'s modes -> ``activation_checkpoint.mode``.
_MODES = {"none": "none", "op": "selective", "budget": "memory_budget"}


def _first_block(config_name: str, mode: str, budget: float) -> tuple[nn.Module, Tensor, Tensor]:
    """The config's first block in bf16 on meta, checkpointed and compiled by the parallelism
    plugin's own strategies under ``mode``, an input batch and the rotary table."""
    from types import SimpleNamespace

    from titan_core._registry import get_registry
    from titan_plugins_parallel import activation_checkpoint, compile

    config = _bench(config_name)
    config.compile.enable = True
    config.compile.backend = "aot_eager"  # the partitioner inductor uses, no code generation
    config.activation_checkpoint.mode = _MODES[mode]  # type: ignore[assignment]
    config.activation_checkpoint.selective_ac_option = "op"
    config.activation_checkpoint.memory_budget = budget
    spec = get_registry().get("models", config.model.name, what="model.name")
    args = spec.flavor(config.model.flavor, config.model.overrides)
    with torch.device("meta"):
        model = spec.build(args)
    block = next(iter(model.layers.values())).to(dtype=torch.bfloat16)
    for module in block.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = stand_in_attention
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": block})
    ctx = SimpleNamespace(config=config, topology=SimpleNamespace(device=torch.device("meta")))
    if activation_checkpoint.applies(config, None):  # type: ignore[arg-type]
        # The op policy keeps attention's output: the stand-in's too.
        activation_checkpoint._ALWAYS_SAVED |= {torch.ops.titan_plan.attention.default}
        activation_checkpoint.apply([part], ctx)  # type: ignore[arg-type]
    compile.apply([part], ctx)  # type: ignore[arg-type]
    t = config.training
    x = torch.empty(t.local_batch_size, t.seq_len, args.dim, device="meta", dtype=torch.bfloat16)
    return part.layers["0"], x.requires_grad_(), model.freqs_cis


def measure(config_name: str, mode: str, budget: float = 1.0) -> dict[str, float]:
    """Saved GiB, forward and recomputed TFLOPs of one block under ``mode`` (none/op/budget)."""
    from torch.utils.flop_counter import FlopCounterMode

    _register_flops()
    torch._dynamo.reset()
    block, x, freqs = _first_block(config_name, mode, budget)
    saved = [0]

    def pack(tensor: Tensor) -> Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    # No dispatch mode around the compiled forward: dynamo does not compile under one.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = block(x, freqs)
    with FlopCounterMode(display=False) as backward:
        y.backward(torch.empty_like(y))
    with FlopCounterMode(display=False) as forward:
        block._call_impl(x.detach(), freqs)
    fwd, bwd = forward.get_total_flops() / 1e12, backward.get_total_flops() / 1e12
    return {"saved_gib": saved[0] / 2**30, "forward_tflop": fwd, "recompute_tflop": bwd - 2 * fwd}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench_8b_l8_compile", choices=sorted(CONFIGS))
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.4, 0.45, 0.5, 0.6])
    parser.add_argument("--attended", type=float, default=0.5, help="share of causal blocks attended")
    args = parser.parse_args(argv)
    _ATTENDED[0] = args.attended
    _, _, seq, batch, _, _ = CONFIGS[args.config]
    print(f"{args.config}: one block, batch {batch} x seq {seq}, bf16, compiled (aot_eager), per block:\n")
    print("| recomputation | saved for backward GiB | forward TFLOP | recomputed TFLOP |")
    print("| --- | --- | --- | --- |")
    rows = [("none", "none", 1.0), ("selective, op policy", "op", 1.0)]
    rows += [(f"memory_budget {b}", "budget", b) for b in args.budgets]
    for label, mode, budget in rows:
        r = measure(args.config, mode, budget)
        print(
            f"| {label} | {r['saved_gib']:.2f} | {r['forward_tflop']:.2f} | {r['recompute_tflop']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
