"""``titan fr analyze`` on NCCL-format dumps (pickle and JSON): behind, mismatched and missing ranks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_titan


def _entry(pg: tuple[str, str], seq: int, op: str, sizes: list[list[int]], state: str) -> dict[str, Any]:
    return {
        "process_group": pg,
        "pg_id": int(pg[0]),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": f"nccl:{op}",
        "input_sizes": sizes,
        "input_dtypes": ["Float"],
        "state": state,
        "is_p2p": False,
        "time_created_ns": 1_000 * seq,
        "frames": [{"name": "clip_grad_norm", "filename": "/work/titan_core/grad_norm.py", "line": 40}],
    }


def nccl_dump(rank: int, last_seq: int, op_at_last: str = "all_reduce", completed: int | None = None) -> dict:
    """Rank ``rank`` of 4 in the world group '0' and a dp group '1' (ranks 0-3)."""
    world = ("0", "default_pg")
    dp = ("1", "dp_shard")
    entries = [_entry(world, 1, "barrier", [[1]], "completed")]
    entries += [_entry(dp, s, "_allgather_base", [[64]], "completed") for s in range(1, last_seq)]
    entries.append(_entry(dp, last_seq, op_at_last, [[64]], "started"))
    done = last_seq - 1 if completed is None else completed
    return {
        "version": "2.10",
        "nccl_version": "2.27.5",
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
            "1": {"name": "1", "desc": "dp_shard", "ranks": "[0, 1, 2, 3]"},
        },
        "pg_status": {
            "0": {
                "last_enqueued_collective": 1,
                "last_started_collective": 1,
                "last_completed_collective": 1,
            },
            "1": {
                "last_enqueued_collective": last_seq,
                "last_started_collective": last_seq,
                "last_completed_collective": done,
            },
        },
        "entries": entries,
    }


def _write(folder: Path, dumps: dict[int, dict], as_json: tuple[int, ...] = ()) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, d in dumps.items():
        path = folder / f"rank_{rank}"
        path.write_bytes(json.dumps(d).encode() if rank in as_json else pickle.dumps(d))


def test_nccl_dumps_name_the_rank_behind_and_the_collective(tmp_path: Path) -> None:
    # ranks 0, 1 and 3 wait in seq 6 of the dp group; rank 2 never got past seq 5
    dumps = {r: nccl_dump(r, 6) for r in (0, 1, 3)}
    dumps[2] = nccl_dump(2, 5, op_at_last="_allgather_base")
    _write(tmp_path, dumps, as_json=(3,))
    result = run_titan("fr", "analyze", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("flight recorder: 4 dump(s)") and "nccl" in lines[0]
    assert lines[1] == (
        "rank 2 is behind in process group 1 (dp_shard): never joined collective #6 all_reduce [[64]] "
        "that rank(s) 0, 1, 3 waited in"
    )
    assert "at clip_grad_norm /work/titan_core/grad_norm.py:40" in result.stdout
    assert "BEHIND rank 2: last collective #5 _allgather_base [[64]]" in result.stdout
    data = json.loads(run_titan("fr", "analyze", str(tmp_path), "--json").stdout)
    dp = next(g for g in data["process_groups"] if g["name"] == "1")
    assert dp["behind"] == [2] and dp["waiting"] == [0, 1, 3] and dp["collective"]["seq"] == 6
    world = next(g for g in data["process_groups"] if g["name"] == "0")
    assert world["ok"] and not world["behind"]


def test_mismatch_stuck_and_missing_dumps(tmp_path: Path) -> None:
    mismatch = {r: nccl_dump(r, 4) for r in (0, 1, 2, 3)}
    mismatch[1] = nccl_dump(1, 4, op_at_last="reduce_scatter")
    _write(tmp_path / "mismatch", mismatch)
    result = run_titan("fr", "analyze", str(tmp_path / "mismatch"))
    assert "ranks [1] called a different collective at #4 all_reduce" in result.stdout.splitlines()[1]

    missing = {r: nccl_dump(r, 4) for r in (0, 1, 2)}  # rank 3 left no dump
    _write(tmp_path / "missing", missing)
    result = run_titan("fr", "analyze", str(tmp_path / "missing"))
    assert "never completed #4 all_reduce" in result.stdout.splitlines()[1]
    assert "no dump from ranks [3]" in result.stdout
    # The world group's barrier completed on the ranks that left a dump; rank 3 may be behind,
    # so they are not "all members".
    assert "all members at" not in result.stdout
    assert "ranks 0, 1, 2 (those with a dump) at #1 barrier [[1]]; rank 3 left none" in result.stdout
    data = json.loads(run_titan("fr", "analyze", str(tmp_path / "missing"), "--json").stdout)
    world = next(g for g in data["process_groups"] if g["name"] == "0")
    assert world["waiting"] == [0, 1, 2] and world["missing_dumps"] == [3] and not world["ok"]


def test_no_dumps_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("nothing here")
    result = run_titan("fr", "analyze", str(tmp_path))
    assert result.returncode == 2 and "no flight-recorder dumps" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


GARBAGE = {
    "random bytes": bytes(range(256)) * 4,
    "empty file": b"",
    "truncated pickle": pickle.dumps(nccl_dump(0, 4))[:100],
    "truncated json": json.dumps(nccl_dump(0, 4)).encode()[:100],
    "pickle of something else": pickle.dumps(["not", "a", "trace"]),
    "malformed trace": pickle.dumps({"entries": 5, "pg_status": "x"}),
}


@pytest.mark.parametrize("content", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_corrupt_rank_0_dump_is_named_and_the_others_are_analysed(tmp_path: Path, content: bytes) -> None:
    _write(
        tmp_path, {r: nccl_dump(r, 6) for r in (1, 3)} | {2: nccl_dump(2, 5, op_at_last="_allgather_base")}
    )
    (tmp_path / "rank_0").write_bytes(content)
    result = run_titan("fr", "analyze", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    path = str(tmp_path / "rank_0")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("flight recorder: 3 dump(s)")
    unreadable = [line for line in lines if line.startswith("rank 0:")]
    assert len(unreadable) == 1 and path in unreadable[0] and "unreadable" in unreadable[0], result.stdout
    assert "re-run the job" in unreadable[0] or "move it out of the folder" in unreadable[0]  # what to do
    assert "no dump from ranks [0]" not in result.stdout  # rank 0 did leave a dump: it is corrupt
    assert "rank 2 is behind in process group 1 (dp_shard)" in result.stdout  # the rest is analysed
    data = json.loads(run_titan("fr", "analyze", str(tmp_path), "--json").stdout)
    assert data["unreadable"]["0"]["path"] == path and data["unreadable"]["0"]["reason"]
    dp = next(g for g in data["process_groups"] if g["name"] == "1")
    assert dp["unreadable_dumps"] == [0] and dp["missing_dumps"] == [] and not dp["ok"]


@pytest.mark.parametrize("content", GARBAGE.values(), ids=GARBAGE.keys())
def test_only_a_corrupt_dump_is_one_line_naming_it(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "rank_0").write_bytes(content)
    result = run_titan("fr", "analyze", str(tmp_path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("titan: error:") and str(tmp_path / "rank_0") in lines[0]
    assert "dump of rank 0" in lines[0] and "unreadable" in lines[0]
    assert "no flight-recorder dumps" not in lines[0]


def test_a_lone_corrupt_dump_with_every_other_rank_agreeing_is_not_ok(tmp_path: Path) -> None:
    _write(tmp_path, {r: nccl_dump(r, 4, completed=4) for r in (1, 2, 3)})
    (tmp_path / "rank_0").write_bytes(b"")
    result = run_titan("fr", "analyze", str(tmp_path))
    assert "every process group agrees" not in result.stdout
    assert "unreadable dump from ranks [0]" in result.stdout.splitlines()[1]


def _hybrid_dump(rank: int) -> dict:
    """A ``real_pp_fake_spmd`` dump of a 4-rank logical job, PP 2: processes are logical ranks 0
    and 2; the default group is fake (all four ranks), the real PP group holds 0 and 2."""
    pp = ("4314d7ee", "real_pp")
    entries = [{**_entry(("1", ""), 1, "barrier", [[1]], "completed"), "process_group": pp}]
    return {
        "version": "2.10",
        "pg_config": {},
        "pg_status": {"0": {"last_enqueued_collective": 14, "last_completed_collective": 14}},
        "entries": entries,
        "titan": {
            "rank": rank,
            "ranks": [0, 2],
            "backend": "gloo",
            "reason": "RuntimeError: Timed out",
            "pg_ranks": {"0": [0, 1, 2, 3], "4314d7ee": [0, 2], "7": [0, 1]},
        },
    }


def test_simulated_ranks_of_a_hybrid_run_are_not_missing_dumps(tmp_path: Path) -> None:
    """Under real_pp_fake_spmd only one process per PP rank exists: the logical ranks the fake
    groups simulate (1 and 3 here) never dump, and were reported as `no dump from ranks [1, 3]
    (hung hard or killed first?)`, sending the user after processes that never existed."""
    for rank in (0, 2):
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(_hybrid_dump(rank)))
    data = json.loads(run_titan("fr", "analyze", str(tmp_path), "--json").stdout)
    for group in data["process_groups"]:
        assert group["missing_dumps"] == [], group
    default = next(g for g in data["process_groups"] if g["name"] == "0")
    assert default["simulated"] == [1, 3]
    report = run_titan("fr", "analyze", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert "no dump from" not in report.stdout and "hung hard" not in report.stdout
    assert "simulated" in report.stdout


def test_the_run_folder_is_read_through_its_comm_traces(tmp_path: Path) -> None:
    """The spec points at the dump folder: ``titan fr analyze outputs/run`` reads its comm_traces/."""
    run = tmp_path / "run"
    _write(
        run / "comm_traces", {0: nccl_dump(0, 6), 1: nccl_dump(1, 6), 2: nccl_dump(2, 5), 3: nccl_dump(3, 6)}
    )
    (run / "config.toml").write_text('recipe = "r"\n')
    result = run_titan("fr", "analyze", str(run))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"flight recorder: 4 dump(s) in {run / 'comm_traces'}")
    assert result.stdout.splitlines()[1].startswith("rank 2 is behind")


def test_a_folder_with_only_earlier_dumps_points_at_them(tmp_path: Path) -> None:
    traces = tmp_path / "comm_traces"
    _write(traces / "earlier", {0: nccl_dump(0, 6), 1: nccl_dump(1, 5)})
    result = run_titan("fr", "analyze", str(traces))
    assert result.returncode == 2
    assert f"{traces}: no flight-recorder dumps of the last run" in result.stderr, result.stderr
    assert f"titan fr analyze {traces / 'earlier'}" in result.stderr


def test_earlier_attempts_folders_are_pointed_at_by_name(tmp_path: Path) -> None:
    """Each rerun moves the dumps it finds to ``earlier/<time>/``: the run's folder and ``earlier/``
    named no dumps at all ("they are written when a collective times out"), though they were one
    folder down."""
    traces = tmp_path / "comm_traces"
    older = traces / "earlier" / "20260101T000000.000001Z"
    newer = traces / "earlier" / "20260101T000500.000001Z"
    _write(older, {0: nccl_dump(0, 6), 1: nccl_dump(1, 5)})
    _write(newer, {0: nccl_dump(0, 4)})
    result = run_titan("fr", "analyze", str(traces))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{traces}: no flight-recorder dumps of the last run" in result.stderr, result.stderr
    assert f"titan fr analyze {newer}" in result.stderr and "2 earlier attempt(s)" in result.stderr
    result = run_titan("fr", "analyze", str(traces / "earlier"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{traces / 'earlier'}: holds the dumps of 2 earlier attempt(s), a folder each" in result.stderr
    assert f"titan fr analyze {newer}" in result.stderr, result.stderr
    assert run_titan("fr", "analyze", str(older)).returncode == 0
    # Only the attempts' folders count: a run's TensorBoard files end in digits too.
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events.out.tfevents.1764950000.host.4242.0").write_bytes(b"x")
    result = run_titan("fr", "analyze", str(run))
    assert result.returncode == 2 and "earlier attempt" not in result.stderr, result.stderr
    assert f"{run}: no flight-recorder dumps (rank_<r> files)" in result.stderr


def test_a_path_that_does_not_exist_or_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    """A mistyped folder was called "not a folder", as if something else were there."""
    missing = tmp_path / "comm_trace"
    result = run_titan("fr", "analyze", str(missing))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{missing}: does not exist; give the comm_traces folder of a run" in result.stderr
    dump = tmp_path / "rank_0"
    dump.write_bytes(b"x")
    result = run_titan("fr", "analyze", str(dump))
    assert f"{dump}: is a file, not a folder; give the folder that holds it ({tmp_path})" in result.stderr
