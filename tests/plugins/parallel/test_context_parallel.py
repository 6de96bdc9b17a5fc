"""Context parallel: load-balanced shards, the global causal mask, and losses equal to one process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.parallel_harness import GLOBAL_BATCH
from tests.plugins.parallel.rows import assert_rows_close, layout_rows, one_process_rows
from titan_core import blocks
from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_plugins_parallel import context_parallel as cp_module


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_cover_the_sequence_once_with_equal_causal_work(cp: int) -> None:
    seq = 8 * cp
    shards = [cp_module.chunk_positions(r, cp, seq) for r in range(cp)]
    assert sorted(p for shard in shards for p in shard) == list(range(seq))
    # Causal work of a query at position p is p + 1 keys: every rank does the same amount.
    work = {sum(p + 1 for p in shard) for shard in shards}
    assert len(work) == 1


def _ranks_outputs(
    monkeypatch: pytest.MonkeyPatch,
    cp: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: Any = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Size]]:
    """Each CP rank's ``GatheredKVAttention`` output for its queries, with the all-gather
    simulated (every rank's K/V shard in rank-major order, as the collective delivers them);
    ``masks(rank, local)`` gives the mask a model passes. Also the shapes the gather was given."""
    seq = q.shape[2]
    everyone = torch.tensor([p for r in range(cp) for p in cp_module.chunk_positions(r, cp, seq)])
    gathered: list[torch.Size] = []
    outs = []
    for rank in range(cp):
        local = torch.tensor(cp_module.chunk_positions(rank, cp, seq))
        shards = {"k": k[:, :, local], "v": v[:, :, local]}
        whole = {id(shards["k"]): k, id(shards["v"]): v}

        def gather(x: torch.Tensor, group: Any, order: torch.Tensor, whole: dict = whole) -> torch.Tensor:
            gathered.append(x.shape)
            return whole[id(x)][:, :, everyone].index_select(2, order)

        monkeypatch.setattr(cp_module, "_all_gather_seq", gather)
        attention = cp_module.GatheredKVAttention(local, everyone, group=None)
        mask = None if masks is None else masks(rank, local)
        out = blocks.call_attention(attention, q[:, :, local], shards["k"], shards["v"], mask)
        outs.append((local, out))
    return outs, gathered


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_each_rank_computes_its_rows_of_causal_attention_gathering_kv_with_their_own_heads(
    monkeypatch: pytest.MonkeyPatch, kv_heads: int
) -> None:
    """What one CP rank computes from the gathered K/V is its rows of full causal attention;
    grouped-query K/V are gathered with their n_kv_heads, not expanded to n_heads first."""
    cp, seq = 2, 16
    q = torch.randn(2, 4, seq, 8)
    k, v = torch.randn(2, kv_heads, seq, 8), torch.randn(2, kv_heads, seq, 8)
    full = blocks.attention(q, k, v)
    outs, gathered = _ranks_outputs(monkeypatch, cp, q, k, v)
    for local, out in outs:
        torch.testing.assert_close(out, full[:, :, local])
    assert {shape[1] for shape in gathered} == {kv_heads}


def test_document_masked_rows_over_the_gathered_kv_equal_document_masked_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CP rank's rows of document-masked attention: its queries against every rank's K/V (put
    back in sequence order), masked by the whole sequence's documents, a document starting on
    another rank's shard included; grouped-query K/V too."""
    cp, seq, bos = 2, 16, 1
    tokens = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 3, 4, 1, 2, 2, 7, 1, 6, 5], [1, *range(3, 18)]])
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    full = blocks.attention(q, k, v, mask=blocks.document_mask(tokens, bos))

    def rows(rank: int, local: torch.Tensor) -> torch.Tensor:
        mask = blocks.document_mask_rows(tokens, bos, local)
        assert mask.shape == (2, 1, local.numel(), seq)
        return mask

    outs, _ = _ranks_outputs(monkeypatch, cp, q, k, v, rows)
    for local, out in outs:
        torch.testing.assert_close(out, full[:, :, local])


@pytest.mark.parametrize("documents", [False, True])
def test_the_gradient_reaching_the_kv_all_gather_is_contiguous(
    monkeypatch: pytest.MonkeyPatch, documents: bool
) -> None:
    """The all-gather's backward is a reduce-scatter, which refuses a strided gradient in torch
    2.11 (the GPU machine's): CP training stopped at step 1's backward there ("Expected
    input.is_contiguous()"). A one-rank gather records the gradients it is given."""
    import torch.distributed._functional_collectives as funcol

    contiguous: list[bool] = []

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            contiguous.append(grad.is_contiguous())
            return grad

    def gather(x: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
        return Gather.apply(x)

    for name in ("all_gather_single_autograd", "all_gather_tensor_autograd"):
        monkeypatch.setattr(funcol, name, gather, raising=False)
    seq, bos = 16, 1
    positions = torch.arange(seq)
    attention = cp_module.GatheredKVAttention(positions, positions, group=None)
    q, k, v = (torch.randn(2, 4, seq, 8, requires_grad=True) for _ in range(3))
    tokens = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 3, 4, 1, 2, 2, 7, 1, 6, 5]] * 2)
    mask = blocks.document_mask_rows(tokens, bos, positions) if documents else None
    attention(q, k, v, mask=mask).square().sum().backward()
    assert contiguous == [True, True]  # K and V


@pytest.mark.parametrize("documents", [False, True])
def test_the_cuda_block_masks_of_a_shard_equal_its_dense_rows(documents: bool) -> None:
    """On CUDA a shard's rows are flex-attention block masks (blocks above the diagonal skipped):
    built here on CPU and run through eager flex attention, they give what the dense rows give,
    with query chunks spanning several 128-blocks and documents crossing the chunks. (Eager
    create_block_mask: CUDA compiles it to Triton, bench/gpu_perf_check.py checks that; torch
    2.11's C++ inductor backend miscompiles the mask's position lookup on CPU.)"""
    from torch.nn.attention.flex_attention import flex_attention

    cp, seq, bos = 2, 512, 1
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 50, (2, seq), generator=generator)
    tokens[0, [0, 37, 200, 300, 301, 460]] = bos
    tokens[1, [130, 255]] = bos
    q = torch.randn(2, 4, seq, 16, generator=generator)
    k, v = torch.randn(2, 2, seq, 16, generator=generator), torch.randn(2, 2, seq, 16, generator=generator)
    for rank in range(cp):
        local = torch.tensor(cp_module.chunk_positions(rank, cp, seq))
        if documents:
            dense = blocks.document_mask_rows(tokens, bos, local)
            sparse = blocks._rows_block_mask(local, seq, blocks.document_ends(tokens, bos), compiled=False)
        else:
            dense = blocks.causal_mask_rows(local, seq)
            sparse = blocks._rows_block_mask(local, seq, compiled=False)
        expected = blocks.attention(q[:, :, local], k, v, mask=dense)
        got = flex_attention(q[:, :, local], k, v, block_mask=sparse, enable_gqa=True)
        torch.testing.assert_close(got, expected)
        if not documents:
            # Each shard skips what the whole sequence's causal mask skips: 6 of 16 pairs of
            # (query block, key block) of 128 lie above the diagonal, 3 of each shard's 8.
            assert sparse.sparsity() == pytest.approx(37.5)


def test_batch_sharder_passes_the_whole_sequences_for_the_document_mask() -> None:
    positions = torch.tensor(cp_module.chunk_positions(0, 2, 8))
    inputs = torch.arange(16).view(2, 8)
    _, _, kwargs = cp_module.BatchSharder(positions, whole_tokens=True)(inputs, inputs, {})
    assert kwargs["input_tokens"] is inputs
    assert "input_tokens" not in cp_module.BatchSharder(positions)(inputs, inputs, {})[2]


def test_a_shard_builds_its_rows_of_the_whole_sequences_mask() -> None:
    """Given the whole sequences (``input_tokens``) and its positions, a shard's forward masks
    its queries against every key; given as many positions as tokens, the sequence's own mask."""
    from types import SimpleNamespace

    from titan_core import blocks

    tokens = torch.tensor([[5, 1, 6, 7, 1, 8, 9, 3]])
    stage = SimpleNamespace(
        args=SimpleNamespace(document_mask=True, bos_id=1),
        tok_embeddings=torch.nn.Embedding(10, 4),
        freqs_cis=torch.arange(8.0),
    )
    local = torch.tensor(cp_module.chunk_positions(1, 2, 8))
    _, freqs, mask = blocks.stage_inputs(stage, tokens[:, local], local, input_tokens=tokens)
    assert freqs.tolist() == local.float().tolist()
    torch.testing.assert_close(mask, blocks.document_mask(tokens, 1)[:, :, local])


def test_batch_sharder_takes_this_ranks_positions() -> None:
    positions = torch.tensor(cp_module.chunk_positions(1, 2, 8))
    inputs = torch.arange(16).view(2, 8)
    x, y, kwargs = cp_module.BatchSharder(positions)(inputs, inputs + 100, {})
    assert x.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert y.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert kwargs["positions"].tolist() == [2, 3, 4, 5]


def test_seq_len_must_split_into_two_chunks_per_rank() -> None:
    """The strategy's ``Strategy.check``, run before anything is built."""
    config = TrainerConfig()
    config.training.seq_len = 30
    (problem,) = cp_module.check(config, SimpleNamespace(cp=4), None, None)
    assert "training.seq_len=30 is not a multiple of 8" in problem
    config.training.seq_len = 32
    assert cp_module.check(config, SimpleNamespace(cp=4), None, None) == []
    # apply refuses it too, for a caller that skipped the check (chunks would drop positions).
    config.training.seq_len = 30
    ctx = SimpleNamespace(config=config, parallel_dims=SimpleNamespace(cp=4), spec=None, model_args=None)
    with pytest.raises(UsageError, match=r"training\.seq_len=30 is not a multiple of 8"):
        cp_module.apply([], ctx)  # type: ignore[arg-type]


def test_a_model_whose_forward_takes_no_positions_is_refused() -> None:
    """CP passes each rank's global ``positions``; a forward without them would fail at step 1
    inside torchrun with a bare TypeError (or, ignoring them, train on wrong positions)."""

    class NoPositions(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return tokens

    class TakesThem(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
            return tokens

    config = TrainerConfig()
    config.training.seq_len = 32
    ctx = SimpleNamespace(
        config=config, parallel_dims=SimpleNamespace(cp=2), spec=SimpleNamespace(name="gpt2"), model_args=None
    )
    expected = r"model 'gpt2'.*forward does not take a named `positions` argument.*parallelism.cp = 1"
    with pytest.raises(UsageError, match=expected):
        cp_module.apply([NoPositions()], ctx)  # type: ignore[arg-type]
    assert cp_module.forward_takes_positions(TakesThem())
    assert not cp_module.forward_takes_positions(NoPositions())


def test_a_forward_that_takes_positions_only_through_kwargs_is_refused() -> None:
    """``**kwargs`` swallows ``positions`` and the forward may never read them: RoPE would then
    use positions 0..n-1 of the shard on every CP rank, and training would go on, silently wrong."""

    class Swallows(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return tokens

    class KeywordOnly(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None) -> torch.Tensor:
            return tokens

    class NamedAndKwargs(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, positions: object = None, **kwargs: object) -> torch.Tensor:
            return tokens

    class PositionalOnly(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, positions: object = None, /) -> torch.Tensor:
            return tokens  # CP passes positions as a keyword: this one cannot take it

    config = TrainerConfig()
    config.training.seq_len = 32
    ctx = SimpleNamespace(
        config=config, parallel_dims=SimpleNamespace(cp=2), spec=SimpleNamespace(name="gpt2"), model_args=None
    )
    expected = r"model 'gpt2'.*named `positions` argument.*\*\*kwargs.*shards the sequence.*RoPE.*global"
    with pytest.raises(UsageError, match=expected):
        cp_module.apply([Swallows()], ctx)  # type: ignore[arg-type]
    assert not cp_module.forward_takes_positions(Swallows())
    assert not cp_module.forward_takes_positions(PositionalOnly())
    assert cp_module.forward_takes_positions(KeywordOnly())
    assert cp_module.forward_takes_positions(NamedAndKwargs())


@pytest.fixture
def reference_rows(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> list[dict]:
    """Step records (loss, grad norm) of one process from the seed checkpoint."""
    return one_process_rows(tmp_path_factory, seed_checkpoint)


@pytest.mark.slow
def test_cp2_matches_one_process(tmp_path: Path, seed_checkpoint: Path, reference_rows: list[dict]) -> None:
    rows = layout_rows(tmp_path, 2, seed_checkpoint, {"parallelism.cp": 2})
    assert_rows_close(rows, reference_rows)


@pytest.mark.slow
def test_cp2_with_fsdp2_matches_one_process(
    tmp_path: Path, seed_checkpoint: Path, reference_rows: list[dict]
) -> None:
    overrides = {
        "parallelism.cp": 2,
        "parallelism.dp_shard": 2,
        "training.local_batch_size": GLOBAL_BATCH // 2,
    }
    assert_rows_close(layout_rows(tmp_path, 4, seed_checkpoint, overrides), reference_rows)


@pytest.mark.slow
def test_cp2_with_the_document_mask_matches_one_process(tmp_path: Path, seed_checkpoint: Path) -> None:
    """Context parallel refused the document mask: packed-document training could not use CP.
    (Qwen3-MoE: ``tests/moe/test_parallel.py``, qwen3_masked on cp2.)"""
    from tests.parallel_harness import TINY_MODEL

    masked = {"model.overrides": {**TINY_MODEL, "document_mask": True}}
    reference = layout_rows(tmp_path / "one", 1, seed_checkpoint, masked)
    causal = layout_rows(tmp_path / "causal", 1, seed_checkpoint, {})
    assert [r["loss"] for r in causal] != [r["loss"] for r in reference]  # the mask is in effect
    assert_rows_close(
        layout_rows(tmp_path / "cp2", 2, seed_checkpoint, {**masked, "parallelism.cp": 2}), reference
    )


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document_mask"])
def test_cp2_with_pp2_matches_one_process(tmp_path: Path, seed_checkpoint: Path, masked: bool) -> None:
    """CP inside pipeline stages: each stage's attention gathers its CP peers' K/V, and with the
    document mask every stage builds its shard's rows from the whole sequences' token ids of its
    microbatch (the pipeline schedule splits them like the batch). Losses and gradient norms are
    one process's, read on the last stage's rank."""
    from tests.parallel_harness import TINY_MODEL

    model = {"model.overrides": {**TINY_MODEL, "document_mask": True}} if masked else {}
    reference = layout_rows(tmp_path / "one", 1, seed_checkpoint, model)
    overrides = {**model, "parallelism.cp": 2, "parallelism.pp": 2}
    # Ranks are laid out pp-major: the last stage's first rank is 2.
    assert_rows_close(layout_rows(tmp_path / "cp2_pp2", 4, seed_checkpoint, overrides, rank=2), reference)
