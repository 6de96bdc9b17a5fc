"""Packing: empty documents, pass boundaries, DP shares (the token stream each rank trains on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from titan_core.data import corpus
from titan_core.data.loader import PackedBatches, load_tokenizer, read_text_files
from titan_core.errors import UsageError


def _framed(texts: list[str]) -> list[int]:
    """One pass's token stream as torchtitan/Megatron pack it: each non-empty document framed by
    BOS/EOS, an empty one left out."""
    tok = load_tokenizer(None)
    stream: list[int] = []
    for ids in tok.encode_batch(texts):
        if ids:
            stream += [tok.bos_id, *ids, tok.eos_id]
    return stream


def _rows(loader: PackedBatches, count: int) -> list[tuple[int, ...]]:
    """The first ``count`` rows (inputs and the last label: the whole window) the loader serves."""
    found: list[tuple[int, ...]] = []
    for inputs, labels in loader:
        found += [(*x.tolist(), int(y[-1])) for x, y in zip(inputs, labels, strict=True)]
        if len(found) >= count:
            return found[:count]
    raise AssertionError("the loader ended")


def _windows(stream: list[int], window: int) -> list[tuple[int, ...]]:
    return [tuple(stream[k * window : (k + 1) * window]) for k in range(len(stream) // window)]


def test_empty_documents_add_no_lone_bos_eos_and_are_counted_once() -> None:
    """An empty document (``{"text": ""}``, an empty ``.txt``) put BOS EOS alone into the
    stream: a two-token "document" the document mask treats as one, trained on as data."""
    texts = ["the rain falls on the valley.", "", "a bread bakes in the oven.", ""]
    kept = [t for t in texts if t]
    expected = _framed(kept)
    window = 5
    loader = PackedBatches(lambda: texts, load_tokenizer(None), window - 1, 1, shuffle_buffer=0, name="data")
    passes = 3
    with capture_logs() as logs:
        rows = _rows(loader, passes * len(expected) // window)
        _rows(loader, 2)  # a new iteration (a validation reads from the start each time)
    stream = [t for row in rows for t in row]
    assert stream == (expected * passes)[: len(stream)]
    skipped = [e for e in logs if "empty" in e["event"]]
    assert len(skipped) == 1, logs
    assert skipped[0]["log_level"] == "warning"
    assert skipped[0]["event"].startswith("data: skipped 2 empty documents of 4 in one pass")


def test_empty_documents_of_files_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(
        '{"text": "one doc about rain"}\n{"text": ""}\n{"text": "two doc about bread"}\n'
    )
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "c.txt").write_text("third doc\n\nwith a blank line inside")
    texts = list(read_text_files(str(tmp_path)))
    assert texts.count("") == 2
    expected = _framed(texts)
    loader = PackedBatches(
        lambda: read_text_files(str(tmp_path)), load_tokenizer(None), 4, 1, shuffle_buffer=0
    )
    rows = _rows(loader, len(expected) // 5)
    assert [t for row in rows for t in row] == expected[: len(rows) * 5]


def test_whitespace_only_documents_are_empty() -> None:
    """An editor saves an "empty" file as one newline: a document of no text but whitespace
    framed by BOS/EOS, trained on as data."""
    texts = ["the rain falls.", "\n", " \t\n\n", "a bread bakes."]
    kept = _framed([texts[0], texts[3]])
    loader = PackedBatches(lambda: texts, load_tokenizer(None), 2, 1, shuffle_buffer=0, name="data")
    with capture_logs() as logs:
        rows = _rows(loader, len(kept) // 3 + 1)  # into pass 2: pass 1's count is logged
    assert [t for row in rows for t in row] == (kept * 2)[: len(rows) * 3]
    assert any(e["event"].startswith("data: skipped 2 empty documents of 4") for e in logs)


def test_all_empty_documents_are_too_small_naming_them() -> None:
    loader = PackedBatches(lambda: ["", "", ""], load_tokenizer(None), 8, 1, name="data")
    with pytest.raises(UsageError, match=r"one pass gives 0 tokens \(3 documents, all empty\)"):
        loader.check_one_step()


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("buffer", [0, 1, 5, 13, 14, 40, 1000])
def test_pass_tails_carry_into_the_next_pass_and_ranks_share_the_stream(dp: int, buffer: int) -> None:
    """The tokens left at the end of a pass (fewer than one sequence) were dropped on every
    pass, so the corpus's last document was never trained on whole; torchtitan's
    HuggingFaceDataset and Megatron's GPTDataset go on packing across the re-loop. Rank r trains
    on windows k = r mod dp of the stream of pass after pass; every window of a pass is served
    before any of the next (the shuffle drains at each pass's end: a buffer larger than a pass,
    or one spanning a pass's end, refilled from the next pass before the current one was
    drained, so one pass served some sequences twice and others never)."""
    texts = list(corpus.documents(4))
    one = _framed(texts)
    window = 17
    assert len(one) % window, "the test needs a pass that is no whole number of windows"
    passes = 4
    windows = _windows(one * passes, window)
    tok = load_tokenizer(None)
    for rank in range(dp):
        loader = PackedBatches(lambda: texts, tok, window - 1, 2, rank, dp, seed=3, shuffle_buffer=buffer)
        mine = [w for k, w in enumerate(windows) if k % dp == rank]
        served = _rows(loader, len(mine))
        if buffer == 0:
            assert served == mine
        elif buffer > 1:
            assert served != mine  # still shuffled
        # Pass by pass: the windows completed while a pass was read, in some order.
        done = 0
        for p in range(1, passes + 1):
            upto = len(one) * p // window
            count = sum(1 for k in range(upto) if k % dp == rank)
            assert sorted(served[done:count]) == sorted(mine[done:count]), (rank, p)
            done = count


def test_no_two_rows_of_one_step_are_one_window_across_passes() -> None:
    """With the tail dropped, every pass cut the same windows: a step spanning a pass's end
    (with shuffling) could train on one window twice, on one rank or two."""
    texts = list(corpus.documents(4))
    one = _framed(texts)
    window = 17
    assert len(one) % window
    dp, bs, steps = 2, 3, 60  # several passes
    tok = load_tokenizer(None)
    ranks = [
        iter(PackedBatches(lambda: texts, tok, window - 1, bs, r, dp, seed=7, shuffle_buffer=1000))
        for r in range(dp)
    ]
    distinct = set(_windows(one * 10, window))
    assert len(distinct) == len(one) * 10 // window  # the stream has no repeated window
    for step in range(steps):
        rows = [tuple(x.tolist()) for it in ranks for x in next(it)[0]]
        assert len(set(rows)) == len(rows), step


def test_dp_shares_are_the_one_process_stream_over_passes(tmp_path: Path) -> None:
    """Pins what each rank trains on (unshuffled): rank r's rows are the one-process rows
    r, r + dp, ..., through several passes, so a change to how ranks read the data cannot
    change their sequences."""
    path = tmp_path / "d.jsonl"
    texts = [f"document {i} about the " + "rain " * (i % 7) for i in range(30)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(None)
    documents = lambda: read_text_files(str(path))
    one = _rows(PackedBatches(documents, tok, 12, 1, shuffle_buffer=0), 120)
    for dp in (2, 3):
        for rank in range(dp):
            got = _rows(PackedBatches(documents, tok, 12, 2, rank, dp, shuffle_buffer=0), 120 // dp)
            assert got == one[rank::dp], (dp, rank)


def test_check_one_step_counts_what_the_stream_holds() -> None:
    """The size check before the model counts the stream's tokens, none for an empty document:
    counted with BOS/EOS, 50 empty documents passed the check for a sequence the data lacks."""
    texts = ["a short document about rain.", *[""] * 50]
    tokens = len(_framed(texts))
    tok = load_tokenizer(None)
    fits = PackedBatches(lambda: texts, tok, tokens - 1, 1)
    fits.check_one_step()
    inputs, _ = next(iter(fits))  # what passed the check trains
    assert inputs.shape == (1, tokens - 1)
    expected = rf"one pass gives {tokens} tokens \(51 documents, 50 of them empty\)"
    with pytest.raises(UsageError, match=expected):
        PackedBatches(lambda: texts, tok, tokens, 1).check_one_step()


def test_a_document_with_an_unpaired_surrogate_names_the_dataset_not_the_tokenizer() -> None:
    """A plugin's text holding a lone surrogate (bytes decoded with ``surrogateescape``, a JSON
    ``\\ud800`` escape) failed inside the tokenizer, and the error said to replace the tokenizer."""
    from titan_core.errors import PluginError

    texts = ["good text here", "bad \udcff text"]
    loader = PackedBatches(lambda: texts, load_tokenizer(None), 4, 1, name="data.dataset 'gen'")
    with pytest.raises(PluginError) as info:
        next(iter(loader))
    message = str(info.value)
    assert message.startswith("data.dataset 'gen' yielded document 2 (pass 1) holding an unpaired surrogate")
    assert "tokenizer" not in message.split(";")[0]


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_tokenizer_path_is_refused_not_the_bundled_tokenizer(path: str) -> None:
    """``--data.tokenizer_path "$TOK"`` with TOK unset trained with titan's bundled tokenizer
    (a debug model's vocabulary fits it) as if no path were given, without a word."""
    with pytest.raises(UsageError, match=r"^data.tokenizer_path: .* is empty; give the path of a"):
        load_tokenizer(path)
