"""A minimal hand-written training loop on titan's Llama 3 module: the yardstick for titan's
framework overhead (``python3 -m bench.handloop --config bench_1b_compile --log FILE``).

Everything titan's trainer does around the model is written out here with PyTorch alone, in the
way that costs least on one GPU: FSDP2 on a 1-GPU mesh (bf16 parameters for compute, fp32
master weights and fp32 gradient reduction), per-block ``torch.compile`` (searching the Triton
kernels' tile sizes on CUDA), fused AdamW, the whole run's batches tokenized and copied to the
GPU before step 1 (no data loading in the loop), and no host synchronisation except the one per
step that reads the loss and the step time (titan's benchmark configs log every step, so they
synchronise as often). Same shapes, data, tokenizer,
optimizer settings, LR schedule, clipping, activation checkpointing and document masking as
``bench/recipes.py``. Selective activation checkpointing uses torchtitan's operator policy:
keep the outputs of attention (SDPA and flex attention, also as a compiled region) and of every
other matmul, recompute the rest. ``--ac memory_budget`` instead leaves the choice to the
compiler's min-cut partitioner under ``torch._functorch.config.activation_memory_budget``, set
process-wide as a plain PyTorch script would (titan sets it per build). The defaults of ``--ac``,
``--memory-budget`` and FSDP2-or-autocast follow the ``TITAN_BENCH_AC``,
``TITAN_BENCH_MEMORY_BUDGET`` and ``TITAN_BENCH_MIXED_PRECISION`` variables that
``bench/recipes.py`` reads, so one environment runs titan and this loop the same way
(``TITAN_BENCH_RESHARD=never`` too: no block resharded after forward).

Prints one JSON line per step with titan's metric names (``tps``, ``tflops``, ``mfu_pct``,
``max_reserved_gib``, ...), so ``bench/perf_table.py`` reads both the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench.recipes import CONFIGS, document_masking, fusion_overrides
from titan_core import blocks as titan_blocks
from titan_plugins_llama3.flavors import FLAVORS, flops_per_token
from titan_plugins_llama3.model import Llama3

PEAK_TFLOPS = 989.0  # H100/H200 dense bf16, torchtitan's figure

#: ``--without NAME``: the optimisations of the performance work, each of which can be turned off.
WITHOUT = {
    "document_mask": "document masking (flex attention, block-causal BlockMask) instead of causal SDPA "
    "over the packed sequence",
    "fuse_qkv": "one Q/K/V matmul over the concatenated weights instead of three",
    "fuse_w13": "one gate/up matmul over the concatenated w1/w3 weights instead of two",
    "gqa": "grouped-query attention without K/V copies (enable_gqa) instead of repeat_interleave",
    "fsdp": "bf16 parameters, fp32 master weights and reduction through FSDP2 on a 1-GPU mesh instead of "
    "autocast over fp32 weights",
    "fused_adamw": "fused AdamW instead of foreach",
    "compile": "torch.compile per block instead of eager blocks",
    "autotune": "inductor's tile search for the compiled blocks' Triton kernels (flex attention's among "
    "them; matmuls stay cuBLAS) instead of its default tiles",
}
#: Inductor settings of the compiled blocks on CUDA: the Triton kernels' tile sizes are searched
#: at the first step (flex attention gains most), matmuls stay cuBLAS.
TILE_SEARCH = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}


def batches(data: str | None, tokenizer_path: str | None, seq: int, batch: int, steps: int) -> torch.Tensor:
    """``(steps, batch, seq + 1)`` token ids: documents framed BOS ... EOS, packed in order."""
    from tokenizers import Tokenizer

    from titan_core.data.loader import BUNDLED_TOKENIZER, load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    backend = Tokenizer.from_file(str(tokenizer_path or BUNDLED_TOKENIZER))
    if data:
        texts = [json.loads(line)["text"] for line in Path(data).read_text().splitlines() if line.strip()]
    else:
        from titan_core.data.corpus import documents

        texts = list(documents(2000))
    need = steps * batch * (seq + 1)
    ids: list[int] = []
    while len(ids) < need:  # repeat the corpus if it is short, as titan's loader does
        for enc in backend.encode_batch(texts, add_special_tokens=False):
            ids += [tok.bos_id, *enc.ids, tok.eos_id]
    return torch.tensor(ids[:need]).view(steps, batch, seq + 1)


_SAVE = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
}
for _name in ("flex_attention", "inductor_compiled_code"):
    if hasattr(torch._higher_order_ops, _name):
        _SAVE.add(getattr(torch._higher_order_ops, _name))


def _sac_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _SAVE:
            return CheckpointPolicy.MUST_SAVE
        if func in (torch.ops.aten.mm.default, torch.ops.aten.linear.default):
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _expanded_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> Any:
    """titan's attention without ``grouped_kv``: ``call_attention`` repeats K/V heads first."""
    return titan_blocks.attention(q, k, v, mask=mask)


class Recompute(nn.Module):
    """Selective activation checkpointing of one block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False, context_fn=_sac_context)

    def init_weights(self) -> None:
        self.block.init_weights()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True, help="a bench/recipes.py config")
    env = os.environ.get
    parser.add_argument(
        "--ac", choices=("selective", "memory_budget", "none"), default=env("TITAN_BENCH_AC", "selective")
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=float(env("TITAN_BENCH_MEMORY_BUDGET", "0.5")),
        help="with --ac memory_budget: the partitioner's activation memory budget (0..1)",
    )
    parser.add_argument("--no-compile", action="store_true", help="eager blocks even for a compiled config")
    parser.add_argument("--steps", type=int, help="override the config's step count")
    parser.add_argument("--log", help="also write the JSON lines here")
    parser.add_argument("--seq", type=int, help="override seq_len (smoke runs)")
    parser.add_argument("--batch", type=int, help="override the batch size (smoke runs)")
    parser.add_argument("--model", type=json.loads, default={}, help="JSON model overrides (smoke runs)")
    parser.add_argument(
        "--without",
        choices=sorted(WITHOUT),
        action="append",
        default=[],
        help="turn one optimisation off (repeatable), for the per-optimisation table",
    )
    parser.add_argument("--trace", help="write a torch.profiler chrome trace of the second-to-last step here")
    opts = parser.parse_args(argv)

    flavor, overrides, seq, batch, steps, compiled = CONFIGS[opts.config]
    steps, seq, batch = opts.steps or steps, opts.seq or seq, opts.batch or batch
    overrides = {**overrides, **fusion_overrides(), **opts.model}
    without = set(opts.without)
    if os.environ.get("TITAN_BENCH_MIXED_PRECISION") == "autocast":
        without.add("fsdp")
    compiled = compiled and not opts.no_compile and "compile" not in without
    if opts.ac == "memory_budget":
        if not compiled:
            parser.error("--ac memory_budget needs a compiled config (the partitioner chooses what to keep)")
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = opts.memory_budget
    data, tokenizer = os.environ.get("TITAN_BENCH_DATA"), os.environ.get("TITAN_BENCH_TOKENIZER")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    masking = {"document_mask": False} if "document_mask" in without else document_masking(tokenizer)
    fusions = {name: False for name in ("fuse_qkv", "fuse_w13") if name in without}
    args = attrs.evolve(FLAVORS[flavor], **{**overrides, **masking, **fusions})
    torch.manual_seed(0)

    # FSDP2 needs a process group and a mesh, even for one GPU.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if cuda else None,
    )
    mesh = init_device_mesh(device.type, (1,))
    data_all = batches(data, tokenizer, seq, batch, steps).to(device)  # before step 1, off the loop

    with torch.device("meta"):
        model = Llama3(args)
    blocks = list(model.layers.keys())
    for key in blocks:
        block = model.layers[key]
        if opts.ac == "selective":
            block = Recompute(block)
        if compiled:
            block.compile(options=TILE_SEARCH if cuda and "autotune" not in without else None)
        model.layers[key] = block
    if "gqa" in without:  # an attention function that does not declare grouped_kv: K/V expanded first
        for block in model.layers.values():
            inner = getattr(block, "block", block)  # under Recompute
            inner.attention.attention_fn = _expanded_kv_attention
    # fp32 on CPU (smoke runs): a policy with no dtypes.
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cuda else MixedPrecisionPolicy()
    autocast: Any = contextlib.nullcontext()
    if "fsdp" in without:  # fp32 weights, bf16 compute by autocast
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    else:
        for i, key in enumerate(blocks):
            # TITAN_BENCH_RESHARD=never keeps every block's gathered parameters for backward.
            reshard = i < len(blocks) - 1 and os.environ.get("TITAN_BENCH_RESHARD", "default") != "never"
            fully_shard(model.layers[key], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)

    params = list(model.parameters())
    fused = cuda and "fused_adamw" not in without
    optimizer = torch.optim.AdamW(
        params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused, foreach=not fused
    )
    warmup, decay_steps = 5, int(0.8 * (steps - 5))

    def lr_factor(step: int) -> float:  # titan's schedule: linear warm-up, linear decay to 0.1
        if step < warmup:
            return (step + 1) / warmup
        done = step - (steps - decay_steps)
        return 1.0 if done < 0 else 1.0 - 0.9 * min(done / max(decay_steps, 1), 1.0)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    fpt = flops_per_token(args, seq)
    out = open(opts.log, "w") if opts.log else None  # noqa: SIM115 - closed below
    print(
        json.dumps(
            {
                "event": "built",
                "config": opts.config,
                "ac": opts.ac,
                "memory_budget": opts.memory_budget if opts.ac == "memory_budget" else None,
                "compile": compiled,
                "without": sorted(without),
            }
        ),
        flush=True,
    )
    prof = None
    if opts.trace:  # the second-to-last step, as titan's profiler.profile_freq traces one step
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(
            activities=activities[: 1 + cuda],
            schedule=torch.profiler.schedule(wait=max(steps - 3, 0), warmup=1, active=1),
            on_trace_ready=lambda p: p.export_chrome_trace(opts.trace),
        )
        prof.start()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = data_all[step - 1]
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the step's one synchronisation
        now = time.perf_counter()
        dt, t0 = now - t0, now
        tps = batch * seq / dt
        row: dict[str, Any] = {
            "event": "step",
            "step": step,
            "loss": round(loss_value, 5),
            "tps": round(tps, 1),
        }
        row["tflops"] = round(fpt * tps / 1e12, 3)
        row["mfu_pct"] = round(100 * row["tflops"] / PEAK_TFLOPS, 2)
        if cuda:
            row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            row["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        row["step_time_s"] = round(dt, 4)
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    if out:
        out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
