"""Flight-recorder dumps of an earlier run or attempt never pass for this run's.

A run's dumps go to ``job.dump_folder/comm_traces/rank_<r>``; ``titan fr analyze`` reads every
``rank_<r>`` there. A rerun that does not hang (or whose hung ranks write nothing) used to leave
the earlier hang's dumps in place, so the analysis named a rank "behind" in a run where nothing
was behind, and ``--overwrite`` did not remove them either.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from tests.conftest import run_titan
from tests.parallel_harness import log_records, run_titan_train


def _gloo_dump(rank: int, last_seq: int, reason: str = "an earlier hang") -> dict:
    """A gloo dump of rank ``rank`` of 2, its last collective ``#last_seq`` of the default group."""
    entries = [
        {
            "process_group": ("0", "default_pg"),
            "collective_seq_id": seq,
            "profiling_name": "gloo:all_gather",
            "input_sizes": [[8]],
            "is_p2p": False,
        }
        for seq in range(1, last_seq + 1)
    ]
    titan = {
        "rank": rank,
        "ranks": [0, 1],
        "backend": "gloo",
        "reason": reason,
        "pg_ranks": {"0": [0, 1]},
    }
    return {"entries": entries, "pg_config": {}, "pg_status": {}, "titan": titan}


def _earlier_hang(dump_folder: Path) -> Path:
    """Dumps of a hang in which rank 1 fell behind, as an earlier run left them."""
    traces = dump_folder / "comm_traces"
    traces.mkdir(parents=True)
    (traces / "rank_0").write_bytes(pickle.dumps(_gloo_dump(0, 5)))
    (traces / "rank_1").write_bytes(pickle.dumps(_gloo_dump(1, 3)))
    analysis = run_titan("fr", "analyze", str(traces))
    assert analysis.stdout.splitlines()[1].startswith("rank 1 is behind"), analysis.stdout
    return traces


OVERRIDES = {"training.steps": 1}


def test_a_rerun_moves_the_earlier_dumps_aside(tmp_path: Path) -> None:
    first = run_titan_train(tmp_path, 1, OVERRIDES)
    assert first.returncode == 0, first.stderr[-2000:]
    traces = _earlier_hang(tmp_path / "out")
    # the same run again, one process: rank 0 retires its own dump and that of rank 1 (not launched)
    result = run_titan_train(tmp_path, 1, OVERRIDES)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in traces.iterdir()) == ["earlier"]
    (attempt,) = (traces / "earlier").iterdir()  # one folder per earlier attempt
    assert sorted(p.name for p in attempt.iterdir()) == ["rank_0", "rank_1"]
    moved = [
        r
        for r in log_records(result.stdout)
        if r.get("event") == "flight recorder: earlier dumps moved aside"
    ]
    assert moved and moved[0]["to"] == str(attempt), result.stdout[-2000:]
    # this run left no dump, and the earlier hang is still there to read
    analysis = run_titan("fr", "analyze", str(traces))
    assert analysis.returncode == 2 and "no flight-recorder dumps" in analysis.stderr, analysis.stdout
    assert f"titan fr analyze {attempt}" in analysis.stderr
    earlier = run_titan("fr", "analyze", str(attempt), "--json")
    assert json.loads(earlier.stdout)["process_groups"][0]["behind"] == [1]


def test_overwrite_removes_the_earlier_runs_dumps(tmp_path: Path) -> None:
    first = run_titan_train(tmp_path, 1, OVERRIDES)
    assert first.returncode == 0, first.stderr[-2000:]
    traces = _earlier_hang(tmp_path / "out")
    result = run_titan_train(tmp_path, 1, {"training.steps": 2}, extra_args=("--overwrite",))
    assert result.returncode == 0, result.stderr[-2000:]
    assert not traces.exists() or not list(traces.rglob("rank_*")), sorted(traces.rglob("*"))


def test_each_earlier_attempts_dumps_are_kept_apart(tmp_path: Path) -> None:
    """Every rerun moved the dumps into one ``earlier/``, replacing the dump an earlier attempt had
    left there under the same rank's name: the first hang's ``rank_0`` was lost, and the folder
    then held the second hang's rank 0 beside the first hang's rank 1, read as one hang."""
    first = run_titan_train(tmp_path, 1, OVERRIDES)
    assert first.returncode == 0, first.stderr[-2000:]
    traces = _earlier_hang(tmp_path / "out")  # hang A: rank_0 and rank_1
    assert run_titan_train(tmp_path, 1, OVERRIDES).returncode == 0
    (traces / "rank_0").write_bytes(pickle.dumps(_gloo_dump(0, 9, "a later hang")))  # hang B: rank 0
    result = run_titan_train(tmp_path, 1, OVERRIDES)
    assert result.returncode == 0, result.stderr[-2000:]
    kept: dict[Path, set[tuple[str, int]]] = {}
    for path in (traces / "earlier").rglob("rank_*"):
        titan = pickle.loads(path.read_bytes())["titan"]
        kept.setdefault(path.parent, set()).add((titan["reason"], titan["rank"]))
    # nothing lost, and each folder is one attempt's
    assert sorted(kept.values(), key=len) == [
        {("a later hang", 0)},
        {("an earlier hang", 0), ("an earlier hang", 1)},
    ], kept
    # in the order they were moved aside, newest last by name
    assert sorted(kept, key=lambda p: p.name)[-1] == next(p for p, v in kept.items() if len(v) == 1)
    for folder in kept:
        assert run_titan("fr", "analyze", str(folder)).returncode == 0


def test_the_processes_of_one_attempt_move_their_dumps_into_one_folder(tmp_path: Path) -> None:
    """Two processes each move their own rank's dump: they agree on the attempt's folder through
    the job's store, so the earlier hang stays one folder that ``titan fr analyze`` reads whole."""
    first = run_titan_train(tmp_path, 2, OVERRIDES)
    assert first.returncode == 0, first.stderr[-2000:]
    traces = _earlier_hang(tmp_path / "out")
    result = run_titan_train(tmp_path, 2, OVERRIDES)
    assert result.returncode == 0, result.stderr[-2000:]
    (attempt,) = (traces / "earlier").iterdir()
    assert sorted(p.name for p in attempt.iterdir()) == ["rank_0", "rank_1"]
    earlier = run_titan("fr", "analyze", str(attempt), "--json")
    assert json.loads(earlier.stdout)["process_groups"][0]["behind"] == [1]
