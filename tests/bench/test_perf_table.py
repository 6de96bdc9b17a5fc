"""``bench/perf_table.py``: the rows it builds from the logs ``bench/perf.sh`` leaves, memory-budget
variants included, and the log names ``perf.sh`` gives those variants."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench.perf_table import main, recompute_rows, table

REPO = Path(__file__).resolve().parents[2]
CONFIG = "bench_8b_l8_compile"


def _titan_log(path: Path, tps: list[float], reserved: float = 40.0) -> None:
    rows = [
        {"event": "step", "step": i, "loss": 8.0 - i * 0.1, "tps": t, "max_reserved_gib": reserved}
        for i, t in enumerate(tps, 1)
    ]
    path.write_text("".join("INFO " + json.dumps(r) + "\n" for r in rows))


def _peer_log(path: Path, tps: list[float], reserved: float = 46.9) -> None:
    path.parent.mkdir(exist_ok=True)
    lines = [
        f"[rank0]: step: {i:2}  loss:  {8.0 - i * 0.1:.4f}  grad_norm:  1.0  "
        f"memory: {reserved:.2f}GiB(33.3%)  tps: {int(t):,}  tflops: 1.0  mfu: 0.1%"
        for i, t in enumerate(tps, 1)
    ]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    slow = [1.0] * 5  # steps 1-5 (compilation) are left out of the means
    _titan_log(tmp_path / f"titan_{CONFIG}.log", slow + [100.0] * 5)
    _titan_log(tmp_path / f"titan_{CONFIG}_budget0.5_autocast.log", slow + [110.0] * 5, reserved=45.0)
    _titan_log(tmp_path / f"hand_{CONFIG}_budget0.5_autocast.log", slow + [100.0] * 5)
    _titan_log(tmp_path / f"titan_{CONFIG}_budget0.45_autocast.log", slow + [105.0] * 5)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile.log", slow + [80.0] * 5)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile_budget0.5.log", slow + [88.0] * 5)
    return tmp_path


def test_budget_variants_are_compared_with_torchtitan_at_the_same_budget_and_selective(logs: Path) -> None:
    rows = [r for r in table([logs]) if r["config"].startswith("8B") and not r.get("missing")]
    by = {(r["variant"], r["run"]): r for r in rows}
    assert by[("", "titan")]["ratio"] == "1.250 vs torchtitan"
    budget = by[("_budget0.5_autocast", "titan")]
    assert budget["tps"] == pytest.approx(110.0)
    assert budget["ratio"] == "1.250 vs torchtitan (same budget); 1.375 vs torchtitan selective"
    assert by[("_budget0.5_autocast", "hand loop")]["ratio"] == "titan/loop 1.100"
    # 0.45 has no torchtitan run of its own: only the selective comparison.
    assert by[("_budget0.45_autocast", "titan")]["ratio"] == "1.312 vs torchtitan selective"
    # variants come in budget order
    titan_variants = [r["variant"] for r in rows if r["run"] == "titan"]
    assert titan_variants == ["", "_budget0.45_autocast", "_budget0.5_autocast"]


def test_recompute_table_reads_the_same_logs(logs: Path) -> None:
    rows = recompute_rows([logs], CONFIG, 5)
    assert [r["change"] for r in rows] == [
        "selective AC, op policy, FSDP2",
        "memory budget 0.45, autocast",
        "memory budget 0.5, autocast",
    ]
    assert [round(r["tps"]) for r in rows] == [100, 105, 110]


def test_rendered_table_names_the_variant(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(logs)]) == 0
    out = capsys.readouterr().out
    assert "| 8B shape (8 layers), compiled, 8192x4, memory budget 0.5, autocast | titan | 110 |" in out
    assert "| 1B shape, eager, 4096x8 | titan | not measured |" in out


@pytest.mark.parametrize(
    ("env", "suffix"),
    [
        ({}, ""),
        ({"TITAN_BENCH_MIXED_PRECISION": "autocast"}, "_autocast"),
        ({"TITAN_BENCH_AC": "memory_budget", "TITAN_BENCH_MEMORY_BUDGET": "0.45"}, "_budget0.45"),
        (
            {
                "TITAN_BENCH_AC": "memory_budget",
                "TITAN_BENCH_MEMORY_BUDGET": "0.6",
                "TITAN_BENCH_MIXED_PRECISION": "autocast",
            },
            "_budget0.6_autocast",
        ),
        ({"TITAN_BENCH_AC": "full"}, "_full"),
        ({"TITAN_BENCH_RESHARD": "never"}, "_reshard_never"),
        ({"TITAN_BENCH_AC": "full", "TITAN_BENCH_RESHARD": "always"}, "_full_reshard_always"),
    ],
)
def test_perf_sh_names_variant_logs_as_the_table_reads_them(env: dict[str, str], suffix: str) -> None:
    script = (REPO / "bench" / "perf.sh").read_text()
    function = re.search(r"^variant\(\) \{.*?^\}$", script, re.S | re.M)
    assert function, "bench/perf.sh defines variant()"
    out = subprocess.run(
        ["bash", "-c", function[0] + "\nvariant"], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == suffix


def test_activation_checkpointing_variants_pair_with_torchtitan_in_the_same_mode(tmp_path: Path) -> None:
    slow = [1.0] * 5
    _titan_log(tmp_path / f"titan_{CONFIG}.log", slow + [100.0] * 5)
    _titan_log(tmp_path / f"titan_{CONFIG}_full.log", slow + [90.0] * 5)
    _titan_log(tmp_path / f"titan_{CONFIG}_none.log", slow + [120.0] * 5)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile.log", slow + [80.0] * 5)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile_full.log", slow + [75.0] * 5)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile_none.log", slow + [100.0] * 5)
    rows = [r for r in table([tmp_path]) if r["config"].startswith("8B") and not r.get("missing")]
    by = {(r["variant"], r["run"]): r for r in rows}
    assert by[("_full", "titan")]["ratio"] == "1.200 vs torchtitan (same AC); 1.125 vs torchtitan selective"
    assert by[("_none", "titan")]["ratio"].startswith("1.200 vs torchtitan (same AC)")
    assert by[("_full", "torchtitan 0.3.0")]["tps"] == pytest.approx(75.0)
    assert [r["variant"] for r in rows if r["run"] == "titan"] == ["", "_full", "_none"]
    assert main([str(tmp_path)]) == 0


def test_rendered_table_names_the_activation_checkpointing_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _titan_log(tmp_path / f"titan_{CONFIG}_full_autocast.log", [1.0] * 5 + [90.0] * 5)
    assert main([str(tmp_path)]) == 0
    row = "| 8B shape (8 layers), compiled, 8192x4, full AC, autocast | titan | 90 |"
    assert row in capsys.readouterr().out


def test_a_resharding_variant_pairs_with_torchtitans_selective_run_once(tmp_path: Path) -> None:
    """``TITAN_BENCH_RESHARD=never`` keeps selective AC: torchtitan's selective run is its peer,
    named once, and the row says what differs."""
    slow = [1.0] * 5
    _titan_log(tmp_path / f"titan_{CONFIG}.log", slow + [100.0] * 5)
    _titan_log(tmp_path / f"titan_{CONFIG}_reshard_never.log", slow + [102.0] * 5, reserved=43.0)
    _peer_log(tmp_path / "peer" / "r4_8b_l8_v2k_compile.log", slow + [80.0] * 5)
    rows = [r for r in table([tmp_path]) if r["config"].startswith("8B") and not r.get("missing")]
    by = {(r["variant"], r["run"]): r for r in rows}
    assert by[("_reshard_never", "titan")]["ratio"] == "1.275 vs torchtitan (same AC)"
    assert by[("", "titan")]["ratio"] == "1.250 vs torchtitan"
    assert [r["variant"] for r in rows if r["run"] == "titan"] == ["", "_reshard_never"]
    assert main([str(tmp_path)]) == 0
