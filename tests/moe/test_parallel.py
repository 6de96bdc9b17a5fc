"""The new architectures under parallel layouts: per-step losses and gradient norms equal to one
process (losses within 1e-4) from the same seed checkpoint, with both balancing methods on (the
bias update's token counts are summed over the data-parallel ranks; the balance loss of pipeline
microbatches adds up to the batch mean).

EP 2 (experts sharded, dense weights FSDP 2), EP 2 with expert FSDP 2 (4 ranks, also with
multi-token prediction), TP 2 (with sequence and loss parallel) and PP 2 (also interleaved, and
with a first stage of dense blocks only) for DeepSeek-V3's shape (MLA, group-limited sigmoid
routing, shared expert, dense first layer), and PP 2 x EP 2 (4 ranks) with a first stage of dense
blocks only (no experts to shard there); EP 2, EP 2 with expert FSDP 2 and TP 2 for Qwen3-MoE's
(q/k norm, explicit head_dim), and PP 2, CP 2 and CP 2 x PP 2 for Qwen3-MoE's with document
masking; CP 2 for DeepSeek-V3's (MLA's decoupled RoPE key at the shard's positions); CP 2 and CP 2 x
FSDP 2 (4 ranks) for Qwen3-MoE's with a stronger balance loss (each sequence's expert counts summed
over its shards). EP 2 with gradient accumulation (one sequence per microbatch) for the
Llama-style debug flavor (softmax top-2, shared expert) and EP 2 with expert FSDP 2 for its top-1
variant (Switch-style weights, balance loss only). Every layout logs the one-process run's balance
loss, bias and router statistics of every MoE layer (under PP the stages add theirs up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import GLOBAL_BATCH, write_seed_checkpoint
from tests.plugins.parallel.rows import assert_rows_close, layout_rows

BALANCING = {"moe.bias_update_rate": 0.01, "moe.aux_loss_weight": 0.01}

ARCHS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "model.name": "moe",
        "model.flavor": "deepseek_v3_debugmodel",
        "model.overrides": {
            "dim": 64,
            "n_layers": 4,
            "n_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_experts": 4,
            "top_k": 2,
            "expert_hidden_dim": 32,
            "shared_expert_hidden_dim": 32,
            "n_expert_groups": 2,
            "n_limited_groups": 1,
            "dense_hidden_dim": 64,
        },
        **BALANCING,
    },
    "qwen3": {
        "model.name": "moe",
        "model.flavor": "qwen3_debugmodel",
        "model.overrides": {
            "dim": 64,
            "n_layers": 4,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 24,
            "n_experts": 4,
            "top_k": 2,
            "expert_hidden_dim": 32,
            "n_dense_layers": 1,
            "dense_hidden_dim": 64,
        },
        **BALANCING,
    },
}

#: Qwen3-MoE with document masking: under PP the second stage masks from the token ids the
#: pipeline passes it.
ARCHS["qwen3_masked"] = {
    **ARCHS["qwen3"],
    "model.overrides": {**ARCHS["qwen3"]["model.overrides"], "document_mask": True},
}

#: Qwen3-MoE with a balance loss ten times stronger: under context parallelism its gradient (not
#: only the logged value) shows whether each sequence's loss is the whole sequence's.
ARCHS["qwen3_aux"] = {**ARCHS["qwen3"], "moe.aux_loss_weight": 0.1}

#: DeepSeek-V3 with multi-token prediction: its MoE block's experts are sharded by EP too.
ARCHS["deepseek_v3_mtp"] = {
    **ARCHS["deepseek_v3"],
    "model.overrides": {**ARCHS["deepseek_v3"]["model.overrides"], "n_mtp_layers": 1},
}

#: DeepSeek-V3 with two dense blocks: PP 2's first stage holds no MoE layer, and still joins the
#: stages' sum of the router statistics on logging steps (else the other stage would wait).
ARCHS["deepseek_v3_dense2"] = {
    **ARCHS["deepseek_v3"],
    "model.overrides": {**ARCHS["deepseek_v3"]["model.overrides"], "n_dense_layers": 2},
}

#: The Llama-style debug flavor (softmax top-2 router, shared expert) and its top-1 variant
#: (Switch-style weights, no shared expert): EP must not depend on the DeepSeek/Qwen3 shapes.
LLAMA_STYLE = {
    "dim": 64,
    "n_layers": 3,
    "n_heads": 4,
    "n_kv_heads": 2,
    "n_experts": 4,
    "top_k": 2,
    "expert_hidden_dim": 32,
    "shared_expert_hidden_dim": 32,
    "dense_hidden_dim": 64,
}
ARCHS["llama_style"] = {
    "model.name": "moe",
    "model.flavor": "debugmodel",
    "model.overrides": LLAMA_STYLE,
    **BALANCING,
}
ARCHS["top1"] = {
    "model.name": "moe",
    "model.flavor": "debugmodel_top1",
    "model.overrides": {**LLAMA_STYLE, "top_k": 1, "shared_expert_hidden_dim": 0},
    "moe.aux_loss_weight": 0.05,
}

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "ep2": (2, {"parallelism.ep": 2, "training.local_batch_size": GLOBAL_BATCH // 2}),
    "ep2_efsdp2": (4, {"parallelism.ep": 2, "training.local_batch_size": GLOBAL_BATCH // 4}),
    # Gradient accumulation under EP: two microbatches of one sequence per rank make the one
    # process's batch (the balance loss, bias update and statistics count both).
    "ep2_accum2": (
        2,
        {
            "parallelism.ep": 2,
            "training.local_batch_size": GLOBAL_BATCH // 4,
            "training.global_batch_size": GLOBAL_BATCH,
        },
    ),
    "tp2": (2, {"parallelism.tp": 2}),
    "pp2": (2, {"parallelism.pp": 2}),
    # Two stages per rank (an interleaved schedule): a rank's layers come from two model parts.
    "pp2_interleaved": (
        2,
        {
            "parallelism.pp": 2,
            "parallelism.pp_schedule": "Interleaved1F1B",
            "parallelism.pp_stages_per_rank": 2,
        },
    ),
    # EP inside pipeline stages (2 ranks each); with deepseek_v3_dense2 the first stage holds
    # dense blocks only, and no experts to shard.
    "pp2_ep2": (
        4,
        {"parallelism.pp": 2, "parallelism.ep": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
    ),
    "cp2": (2, {"parallelism.cp": 2}),
    # CP inside pipeline stages: each stage's shard rows of the mask come from its microbatch.
    "cp2_pp2": (4, {"parallelism.cp": 2, "parallelism.pp": 2}),
    "cp2_fsdp2": (
        4,
        {"parallelism.cp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
    ),
}

CASES = [
    ("deepseek_v3", "ep2"),
    ("deepseek_v3", "ep2_efsdp2"),
    ("deepseek_v3", "tp2"),
    ("deepseek_v3", "pp2"),
    ("deepseek_v3", "pp2_interleaved"),
    ("deepseek_v3_dense2", "pp2"),
    ("deepseek_v3_dense2", "pp2_ep2"),
    ("deepseek_v3_mtp", "ep2_efsdp2"),
    ("qwen3", "ep2"),
    ("qwen3", "ep2_efsdp2"),
    ("qwen3", "tp2"),
    ("qwen3_masked", "pp2"),
    ("qwen3_masked", "cp2"),
    ("qwen3_masked", "cp2_pp2"),
    ("deepseek_v3", "cp2"),
    ("qwen3_aux", "cp2"),
    ("qwen3_aux", "cp2_fsdp2"),
    ("llama_style", "ep2_accum2"),
    ("top1", "ep2_efsdp2"),
]

_SEEDS: dict[str, Path] = {}
_REFERENCE: dict[str, list[dict[str, Any]]] = {}


def reference(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The seed checkpoint of ``arch`` and its one-process step records (once per session)."""
    if arch not in _SEEDS:
        folder = tmp_path_factory.mktemp(f"moe_{arch}")
        # The weights do not depend on the mask, and the seed is built without the trainer
        # that fills in the tokenizer's bos_id for it.
        model = {k: v for k, v in ARCHS[arch]["model.overrides"].items() if k != "document_mask"}
        _SEEDS[arch] = write_seed_checkpoint(folder / "seed.pt", **{**ARCHS[arch], "model.overrides": model})
        _REFERENCE[arch] = layout_rows(folder / "one", 1, _SEEDS[arch], ARCHS[arch])
    return _SEEDS[arch], _REFERENCE[arch]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_layout_matches_one_process(
    arch: str, layout: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    seed, expected = reference(arch, tmp_path_factory)
    nproc, overrides = LAYOUTS[layout]
    rank = 1 if layout.startswith("pp2") else 0  # the last stage logs the loss
    rows = layout_rows(tmp_path, nproc, seed, {**ARCHS[arch], **overrides}, rank=rank)
    assert_rows_close(rows, expected)
    # The balance loss is the whole batch's, the statistics count every rank's tokens and cover
    # every MoE layer: under PP the logging (last) stage reports the first stage's layers too.
    keys = sorted(k for k in expected[0] if k.startswith("moe/"))
    first_moe = ARCHS[arch]["model.overrides"].get("n_dense_layers", 1)
    assert f"moe/layer{first_moe}/imbalance" in keys and "moe/aux_loss" in keys
    assert sorted(k for k in rows[0] if k.startswith("moe/")) == keys
    for key in keys:
        got, want = [r[key] for r in rows], [r[key] for r in expected]
        assert got == pytest.approx(want, rel=1e-4), key


HYBRID_RECIPES = """
from titan_plugins_moe.recipes import deepseek_v3_debugmodel


def ds_pp2_fsdp2():
    config = deepseek_v3_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 4}
    config.parallelism.pp = 2
    config.parallelism.dp_shard = 2
    config.training.local_batch_size = 4
    config.training.seq_len = 32
    config.training.device = "cpu"
    config.debug.fake_tensors = "off"
    config.metrics.enable_tensorboard = False
    config.job.dump_folder = "./out"
    return config
"""


@pytest.mark.slow
def test_hybrid_mode_leaves_out_the_statistics_of_simulated_ranks(tmp_path: Path) -> None:
    """``real_pp_fake_spmd`` with FSDP 2 simulated: the logged balance loss was half the job's
    (divided by a rank that added nothing) and the token counts one rank's, as the batch's."""
    import json

    from tests.plugins.comm.test_fake import torchrun

    (tmp_path / "moe_hybrid.py").write_text(HYBRID_RECIPES)
    train = ["-m", "titan_core.train", "--module", "moe_hybrid", "--config", "ds_pp2_fsdp2"]
    result = torchrun(tmp_path, *train, "--comm-backend", "real_pp_fake_spmd", NGPU="4")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["loss"] > 0 for row in rows)
    assert not [key for row in rows for key in row if key.startswith("moe/")]
    assert "MoE router statistics, balance loss and bias are not logged" in result.stdout
