"""``titan memory view``: CUDA-format and CPU snapshots become one offline HTML page that a real
headless browser (Debian's chromium) renders, with the numbers of the snapshot in it."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_titan
from titan_plugins_memory.cpu_snapshot import build_snapshot, dump_snapshot
from titan_plugins_memory.tracker import AllocationTracker
from titan_plugins_memory.view import analyze, render_html

MiB = 1024**2
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install -y chromium)")


def _frame(name: str) -> list[dict[str, Any]]:
    return [
        {"filename": "train.py", "line": 7, "name": name},
        {"filename": "??", "line": 0, "name": "c10::alloc"},
    ]


def cuda_snapshot() -> dict[str, Any]:
    """A snapshot in the layout torch.cuda.memory._snapshot() returns, with known figures.

    Before the history: X (1 MiB, still live) and D (3 MiB, freed first). Then A (4 MiB), B
    (2 MiB), A freed (requested, then completed), C (1 MiB). Allocated: 4, 1, 5, 7, 3, 4 MiB:
    the peak, 7 MiB, is right after B, with X, A and B live.
    """
    blocks = [
        {
            "address": 0x1000000,
            "size": 1 * MiB,
            "requested_size": MiB,
            "state": "active_allocated",
            "frames": _frame("x"),
        },
        {
            "address": 0x2000000,
            "size": 2 * MiB,
            "requested_size": 2 * MiB,
            "state": "active_allocated",
            "frames": _frame("b"),
        },
        {
            "address": 0x3000000,
            "size": 1 * MiB,
            "requested_size": MiB,
            "state": "active_allocated",
            "frames": _frame("c"),
        },
        {"address": 0x4000000, "size": 8 * MiB, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    segment = {
        "device": 0,
        "address": 0x1000000,
        "total_size": 12 * MiB,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }

    def event(action: str, addr: int, size: int, name: str, t: int) -> dict[str, Any]:
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": 0,
            "frames": _frame(name),
            "time_us": t,
        }

    trace = [
        event("segment_alloc", 0x1000000, 12 * MiB, "seg", 900),
        event("free_requested", 0x5000000, 3 * MiB, "d", 1000),
        event("free_completed", 0x5000000, 3 * MiB, "d", 1001),
        event("alloc", 0x6000000, 4 * MiB, "make_a", 2000),
        event("alloc", 0x2000000, 2 * MiB, "make_b", 3000),
        event("free_requested", 0x6000000, 4 * MiB, "make_a", 4000),
        event("free_completed", 0x6000000, 4 * MiB, "make_a", 4500),
        event("alloc", 0x3000000, 1 * MiB, "c", 5000),
    ]
    return {"segments": [segment], "device_traces": [trace]}


def test_cuda_snapshot_peak_and_what_was_live_there() -> None:
    (d,) = analyze(cuda_snapshot())
    assert d["baseline_bytes"] == 4 * MiB  # X and D existed before the history
    assert d["peak_bytes"] == 7 * MiB and d["events"] == 5  # free_requested + free_completed: one free
    assert d["allocated_end_bytes"] == 4 * MiB and d["reserved_bytes"] == 12 * MiB
    assert [y for _, y in d["timeline"]] == [m * MiB for m in (4, 1, 5, 7, 3, 4)]
    assert [(a["size"], a["frames"][0]["name"]) for a in d["largest"]] == [
        (4 * MiB, "make_a"),
        (2 * MiB, "make_b"),
        (1 * MiB, "x"),
    ]
    assert d["peak_time_us"] == 3000 - 1000


def _chromium(page: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_chromium
def test_the_page_renders_offline_in_chromium_with_the_numbers(tmp_path: Path) -> None:
    snapshot = tmp_path / "rank0_memory_snapshot.pickle"
    snapshot.write_bytes(pickle.dumps(cuda_snapshot()))
    result = run_titan("memory", "view", str(snapshot), "-o", str(tmp_path / "page.html"))
    assert result.returncode == 0, result.stderr
    page = tmp_path / "page.html"
    assert result.stdout.strip() == str(page)
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=|https?://|@import|url\(", text)  # nothing to fetch
    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-rendered="yes"' in dom.stdout  # the page's own script ran in the browser
    assert f'class="peak" data-bytes="{7 * MiB}"' in dom.stdout and "7.00 MiB (7,340,032 bytes)" in dom.stdout
    assert "event 3 of 5 (2.0 ms after the first)" in dom.stdout
    largest = dom.stdout.split('class="largest"', 1)[1]
    assert largest.index("make_a") < largest.index("make_b") < largest.index(">x ")
    assert re.search(r'class="points">6<', dom.stdout)  # the polyline has the six points
    shot = tmp_path / "shot.png"
    result = _chromium(page, f"--screenshot={shot}", "--window-size=1000,900")
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    from PIL import Image

    colors = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    blue = [c for count, c in colors if c[2] > 150 and c[0] < 120]  # the timeline's stroke
    assert len(colors) > 20 and blue


def test_cpu_snapshot_from_a_tracker(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)  # 263,168 bytes of parameters, allocated before recording
    optimizer = torch.optim.AdamW(model.parameters())
    with AllocationTracker(history=1000) as tracker:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)  # peak: params + 3 MiB
        del a
        c = torch.empty(MiB // 2, dtype=torch.uint8)
        data = build_snapshot(tracker, [model], optimizer, rank=3, step=12)
    params = 4 * (256 * 256 + 256)
    (d,) = analyze(data)
    assert d["baseline_bytes"] == params  # the parameters are blocks, named by the account
    assert d["peak_bytes"] == params + 3 * MiB
    assert d["allocated_end_bytes"] == params + 2 * MiB + MiB // 2
    sizes = [x["size"] for x in d["largest"]]
    assert sizes[:2] == [2 * MiB, MiB]
    top = d["largest"][0]["frames"][0]
    assert top["filename"] == __file__ and top["name"] == "test_cpu_snapshot_from_a_tracker"
    named = [f["name"] for x in d["largest"] for f in x["frames"] if f["filename"] == "<tensor account>"]
    assert sorted(named) == ["parameter bias", "parameter weight"]
    assert data["titan"]["account"]["params_bytes"] == params
    html = render_html(data, "rank3.pickle")
    assert "Rank 3 at step 12" in html and f"{params + 3 * MiB:,} bytes" in html
    # PyTorch's own snapshot tools read the CPU layout too.
    from torch.cuda import _memory_viz

    assert "Summary of segments" in _memory_viz.segsum(data)
    assert "snapshot.pickle" in _memory_viz.trace_plot(data)
    path = tmp_path / "cpu.pickle"
    dump_snapshot(str(path), data)
    assert pickle.loads(path.read_bytes())["titan"]["step"] == 12
    del b, c


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    result = run_titan("memory", "view", str(tmp_path / "missing.pickle"))
    assert result.returncode == 2 and "titan: error: " in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "no such file" in result.stderr
    (tmp_path / "list.pickle").write_bytes(pickle.dumps({"nothing": 1}))
    result = run_titan("memory", "view", str(tmp_path / "list.pickle"))
    assert result.returncode == 2 and "not a memory snapshot" in result.stderr


def test_the_page_replaces_only_its_own_earlier_page(tmp_path: Path) -> None:
    """``-o my_recipe.py`` turned the recipe into HTML; ``-o /new/x.html`` made folders."""
    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(pickle.dumps(cuda_snapshot()))
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("def r(): ...\n")
    result = run_titan("memory", "view", str(snapshot), "-o", str(recipe))
    assert (
        result.returncode == 2
        and "the file exists and is not a page titan memory view wrote" in result.stderr
    )
    assert recipe.read_text() == "def r(): ...\n"
    result = run_titan("memory", "view", str(snapshot), "-o", str(tmp_path / "new" / "x.html"))
    assert result.returncode == 2 and "no folder" in result.stderr and not (tmp_path / "new").exists()
    for _ in range(2):  # its own page is rewritten
        assert run_titan("memory", "view", str(snapshot)).returncode == 0
    assert (tmp_path / "snap.html").read_text().startswith("<!doctype html>")
    # Without -o the page goes beside the snapshot: a user's file there is named as that page.
    (tmp_path / "snap.html").write_text("my notes\n")
    result = run_titan("memory", "view", str(snapshot))
    assert result.returncode == 2 and "titan: error: -o " not in result.stderr
    assert f"the page beside the snapshot, {tmp_path / 'snap.html'}, exists and is not" in result.stderr
    assert "give -o PATH" in result.stderr and (tmp_path / "snap.html").read_text() == "my notes\n"


@pytest.mark.parametrize(
    ("data", "what"),
    [
        ({"segments": 5}, "'segments' is an int, not a list"),
        ([1, 2], "segment 0 is an int, not a dict"),
        ({"segments": [{"blocks": 3}]}, "segment 0's 'blocks' is an int, not a list"),
        (
            {"segments": [{"blocks": [{"state": "active_allocated", "address": 1}]}]},
            "segment 0, block 0 has no integer 'size'",
        ),
        ({"segments": [{"device": "cuda"}]}, "segment 0's 'device' is a str, not an int"),
        ({"segments": [], "device_traces": {"a": 1}}, "'device_traces' is a dict, not a list"),
        (
            {"segments": [], "device_traces": [[{"action": "alloc"}]]},
            "device 0, event 0 has no integer 'addr'",
        ),
        ({"segments": [], "device_traces": [[7]]}, "device 0, event 0 is an int, not a dict"),
        ({"segments": [], "titan": "x"}, "'titan' is a str, not a dict"),
    ],
)
def test_a_pickle_that_is_not_a_snapshot_is_one_line(tmp_path: Path, data: object, what: str) -> None:
    """A pickle of another shape (a dict with 'segments' = 5, a list) was a TypeError traceback."""
    path = tmp_path / "other.pickle"
    path.write_bytes(pickle.dumps(data))
    result = run_titan("memory", "view", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback
    assert lines[0].startswith(f"titan: error: {path}: not a memory snapshot ({what}")
    assert "torch.cuda.memory._dump_snapshot" in lines[0]
    assert not (tmp_path / "other.html").exists()


def test_a_snapshot_with_frames_that_are_not_dicts_is_one_line(tmp_path: Path) -> None:
    """What the layout check leaves to the page (frames) is one error too, not a traceback."""
    data = cuda_snapshot()
    data["segments"][0]["blocks"][0]["frames"] = ["not a frame"]
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(data))
    result = run_titan("memory", "view", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "not a memory snapshot" in result.stderr


def test_a_page_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """``-o`` in a folder where no file can be made (procfs here; a read-only mount, a full disk)
    ended in a FileNotFoundError/PermissionError traceback."""
    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(pickle.dumps(cuda_snapshot()))
    result = run_titan("memory", "view", str(snapshot), "-o", "/proc/snap.html")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "titan: error: -o /proc/snap.html: cannot write the page (No such file or directory); give "
        "-o a path in a folder you can write"
    )


def test_a_rewrite_that_fails_keeps_the_earlier_page_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while the page is rewritten removed the earlier page (the file was written
    in place and deleted when the write failed); now the page is written beside it and renamed, so
    the earlier page stays as it was and no partial file is left."""
    import errno

    from titan_plugins_memory import view

    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(pickle.dumps(cuda_snapshot()))
    page = Path(view.write_html(str(snapshot)))
    earlier = page.read_text()
    real_open = open

    class FullDisk:
        """A file that takes a few bytes, then fails as a full disk does."""

        def __init__(self, path: str) -> None:
            self.file = real_open(path, "w")

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, text: str) -> int:
            self.file.write(text[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk_open(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return FullDisk(path) if "w" in mode else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(view, "open", full_disk_open, raising=False)
    with pytest.raises(view.UsageError, match=r"cannot write the page beside the snapshot, .*No space left"):
        view.write_html(str(snapshot))
    assert page.read_text() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.html", "snap.pickle"]


def test_an_empty_output_path_is_one_error(tmp_path: Path) -> None:
    """``-o "$OUT"`` with ``OUT`` unset wrote the page beside the snapshot, as if ``-o`` had not
    been given, where the user asked for another place."""
    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(pickle.dumps(cuda_snapshot()))
    result = run_titan("memory", "view", str(snapshot), "-o", "")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[0] == (
        "titan: error: -o: an empty path; give the page's path, e.g. -o snapshot.html, or leave -o out "
        "for the page beside the snapshot"
    )
    assert not (tmp_path / "snap.html").exists()
