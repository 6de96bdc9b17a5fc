"""The flight recorder under gloo, end to end: rank 1 of a 2-process CPU run stalls past
``comm.train_timeout_seconds``; every rank dumps into ``comm_traces/`` and ``titan fr analyze``
names rank 1 and the collective rank 0 waited in."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_titan
from tests.parallel_harness import log_records, run_titan_train

FIXTURE = Path(__file__).parent / "fixtures" / "titan_stall_plugin"


@pytest.fixture(scope="module")
def stall_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stall plugin, really installed by pip (a third-party callback), for PYTHONPATH."""
    target = tmp_path_factory.mktemp("stall_site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(FIXTURE),
        ],
        check=True,
        capture_output=True,
    )
    return target


@pytest.mark.slow
def test_a_stalled_rank_is_named_by_fr_analyze(tmp_path: Path, stall_site: Path) -> None:
    import os

    env = {
        "TITAN_STALL_RANK": "1",
        "TITAN_STALL_STEP": "2",
        "TITAN_STALL_SECONDS": "12",  # four times the timeout
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(stall_site), str(Path(__file__).parents[3])]),
    }
    overrides = {"comm.train_timeout_seconds": 3, "training.steps": 3, "parallelism.dp_shard": 2}
    result = run_titan_train(tmp_path, 2, overrides, env=env, timeout=240)
    assert result.returncode != 0, result.stdout[-3000:]
    records = log_records(result.stdout)
    assert "stall plugin: rank 1 sleeps 12.0s before step 2" in result.stdout
    traces = tmp_path / "out" / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"], result.stderr[-3000:]
    dumps = {r: pickle.loads((traces / f"rank_{r}").read_bytes()) for r in (0, 1)}
    assert all(d["entries"] and d["titan"]["backend"] == "gloo" for d in dumps.values())
    assert "Timed out" in dumps[0]["titan"]["reason"]  # rank 0 waited and timed out
    assert dumps[1]["titan"]["reason"].startswith("requested: rank 0")  # rank 1 dumped while stalled
    written = [r for r in records if r.get("event") == "flight recorder trace written"]
    assert sorted(Path(r["path"]).name for r in written) == ["rank_0", "rank_1"]

    report = run_titan("fr", "analyze", str(traces))
    assert report.returncode == 0, report.stderr
    verdict = report.stdout.splitlines()[1]
    assert verdict.startswith("rank 1 is behind in process group"), report.stdout
    data = json.loads(run_titan("fr", "analyze", str(traces), "--json").stdout)
    group = data["process_groups"][0]
    assert group["behind"] == [1] and group["waiting"] == [0] and group["ranks"] == [0, 1]
    collective = group["collective"]
    # the collective rank 0 was in at step 2 and rank 1 never joined: FSDP's first all-gather
    assert collective["op"] in verdict and f"#{collective['seq']}" in verdict
    assert "all_gather" in collective["op"] or "allgather" in collective["op"]
    assert group["behind_last"]["1"]["seq"] < collective["seq"]
