"""``titan compare`` (loss curves of runs) and ``titan memory compare`` (two memory reports) on the
files runs write: metrics.jsonl and config.toml, memory_report_rank<r>.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import run_titan

LOSSES = [10.0, 8.0, 6.5, 5.75, 5.25]
NORMS = [2.0, 1.5, 1.25, 1.0, 0.9]


def write_run(folder: Path, losses: list[float], norms: list[float], *, warn_only: bool = False) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"step": i + 1, "loss": loss, "grad_norm": g, "lr": 1e-3}
        for i, (loss, g) in enumerate(zip(losses, norms, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.toml").write_text(
        f'recipe = "r"\n\n[debug]\ndeterministic = true\ndeterministic_warn_only = {str(warn_only).lower()}\n'
    )
    return folder


def test_equal_runs_pass_and_a_perturbed_one_fails_beyond_rtol(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    same = write_run(tmp_path / "fsdp2", [x * (1 + 1e-7) for x in LOSSES], NORMS)
    perturbed = [*LOSSES[:3], LOSSES[3] * 1.01, LOSSES[4]]
    off = write_run(tmp_path / "tp2", perturbed, NORMS)

    ok = run_titan("compare", str(ref), str(same), "--rtol", "1e-5")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: every step within rtol 1e-05, atol 0" in ok.stdout
    fail = run_titan("compare", str(ref), str(same), str(off), "--rtol", "1e-3")
    assert fail.returncode == 1, fail.stdout + fail.stderr
    assert "FAILED (rtol 0.001, atol 0): 1 value(s) beyond the tolerance" in fail.stdout
    assert "tp2: loss at step 4 is 5.8075, the reference ref has 5.75" in fail.stdout
    assert "tp2 loss: 0.0575 at step 4" in fail.stdout  # the largest difference
    # side by side: step 4's row has the three losses and the differences to the reference
    row = next(line for line in fail.stdout.splitlines() if line.split()[:1] == ["4"])
    assert "5.750000" in row and "5.807500 (+5.75e-02)" in row
    # without a tolerance it only shows the curves
    look = run_titan("compare", str(ref), str(off))
    assert look.returncode == 0 and "FAILED" not in look.stdout


def test_missing_steps_and_atol(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    short = write_run(tmp_path / "short", LOSSES[:3], NORMS[:3])
    result = run_titan("compare", str(ref), str(short), "--atol", "1")
    assert result.returncode == 1 and "short: no loss at step 4" in result.stdout
    close = write_run(tmp_path / "close", [x + 0.5 for x in LOSSES], NORMS)
    assert run_titan("compare", str(ref), str(close), "--atol", "0.6").returncode == 0
    assert run_titan("compare", str(ref), str(close), "--atol", "0.4").returncode == 1
    assert (
        run_titan("compare", str(ref), str(close), "--atol", "0.6", "--metrics", "grad_norm").returncode == 0
    )


def test_plot_is_a_png_with_a_line_per_run(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    other = write_run(tmp_path / "other", [x + 1 for x in LOSSES], NORMS)
    out = tmp_path / "curves.png"
    result = run_titan("compare", str(ref), str(other), "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert f"plot written: {out}" in result.stdout
    image = Image.open(out)
    assert image.format == "PNG" and image.size[0] >= 600
    colors = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (0x1F, 0x77, 0xB4) in colors and (0xFF, 0x7F, 0x0E) in colors  # the two runs' lines


def test_refuses_deterministic_warn_only_runs_when_asserting(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    loose = write_run(tmp_path / "loose", LOSSES, NORMS, warn_only=True)
    result = run_titan("compare", str(ref), str(loose), "--rtol", "1e-4")
    assert result.returncode == 2
    assert "made with debug.deterministic_warn_only = true" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert run_titan("compare", str(ref), str(loose)).returncode == 0  # looking is fine


@pytest.mark.parametrize("backend", ["fake", "real_pp_fake_spmd"])
def test_refuses_runs_of_simulated_peers_when_asserting(tmp_path: Path, backend: str) -> None:
    """A pure fake run logs NaN losses (fake tensors carry no numbers) or one simulated rank's:
    "nan against nan, |diff| inf" said nothing of why. A hybrid run's losses are numbers, but
    its data-parallel and tensor-parallel collectives moved nothing: no training values either."""
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    fake = write_run(tmp_path / "fake", [float("nan")] * 5, NORMS)
    with open(fake / "config.toml", "a") as f:
        f.write(f'\n[comm]\nbackend = "{backend}"\n')
    result = run_titan("compare", str(ref), str(fake), "--rtol", "1e-4")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{fake}: made under comm.backend = '{backend}', which simulates peers" in line
    assert "compare real runs" in line
    assert run_titan("compare", str(ref), str(fake)).returncode == 0  # looking is fine


def test_a_value_that_is_not_finite_fails_saying_so(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", [float("nan"), *LOSSES[1:]], NORMS)
    other = write_run(tmp_path / "other", [float("nan"), *LOSSES[1:]], NORMS)
    result = run_titan("compare", str(ref), str(other), "--rtol", "1e-4")
    assert result.returncode == 1
    assert (
        "loss at step 1 is nan, the reference ref has nan: a value that is not finite"
        in result.stdout + result.stderr
    )
    assert "|diff| inf" not in result.stdout + result.stderr


def test_bad_run_folder_is_one_line(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    result = run_titan("compare", str(ref), str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "nowhere: no such file or folder" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_titan("compare", str(ref), str(tmp_path / "empty"))
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr
    assert run_titan("compare", str(ref)).returncode == 2  # one run is nothing to compare


def _report(path: Path, dp_shard: int, pp: int, peak: int, optim: int) -> Path:
    def obs(point: str, step: int, grads: int) -> dict:
        return {
            "point": point,
            "step": step,
            "params_bytes": 1000,
            "grads_bytes": grads,
            "optimizer_state_bytes": optim,
            "peak_bytes": peak if point == "steady_forward_backward" else 3000,
        }

    data = {
        "recipe": "r",
        "model": "llama3/debugmodel",
        "degrees": {"pp": pp, "dp_shard": dp_shard, "tp": 1},
        "pp_schedule": "1F1B" if pp > 1 else None,
        "config_hash": f"h{dp_shard}{pp}",
        "peak_bytes": peak,
        "observations": [
            obs("after_init", 0, 0),
            obs("after_optimizer_warmup", 0, 0),
            obs("steady_forward_backward", 1, 1000),
            obs("after_optimizer_step", 1, 1000),
        ],
    }
    path.write_text(json.dumps(data))
    return path


def test_memory_compare_shows_points_side_by_side(tmp_path: Path) -> None:
    MiB = 1024**2
    a = _report(tmp_path / "fsdp4.json", 4, 1, 100 * MiB, 2 * MiB)
    b = _report(tmp_path / "pp2.json", 2, 2, 150 * MiB, 4 * MiB)
    result = run_titan("memory", "compare", str(a), str(b))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "configuration differences:" in out
    degrees = next(line for line in out.splitlines() if line.startswith("degrees"))
    assert "dp_shard=4" in degrees and "pp=2 dp_shard=2" in degrees
    assert next(line for line in out.splitlines() if line.startswith("pp_schedule")).split()[1:] == [
        "-",
        "1F1B",
    ]
    steady = next(line for line in out.splitlines() if line.startswith("steady_forward_backward"))
    assert steady.split()[-4:] == ["0.0", "0.0", "+0.0", "1.000"]  # its first figure: params
    peak = [line for line in out.splitlines() if " peak " in f" {line} " and "steady" not in line]
    assert any("100.0" in line and "150.0" in line and "+50.0" in line and "1.500" in line for line in peak)
    assert out.splitlines()[-1] == "peak: A 100.0 MiB, B 150.0 MiB (B - A = +50.0 MiB, +50.0%)"
    data = json.loads(run_titan("memory", "compare", str(a), str(b), "--json").stdout)
    assert [p["point"] for p in data["points"]] == [
        "after_init",
        "after_optimizer_warmup",
        "steady_forward_backward",
        "after_optimizer_step",
    ]
    optim = next(f for f in data["points"][1]["figures"] if f["figure"] == "optimizer_state_bytes")
    assert (optim["a"], optim["b"], optim["diff"], optim["ratio"]) == (2 * MiB, 4 * MiB, 2 * MiB, 2.0)
    bad = run_titan("memory", "compare", str(a), str(tmp_path / "none.json"))
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_a_metric_no_run_logs_is_an_error_not_an_empty_pass(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    off = write_run(tmp_path / "off", [x * 1.1 for x in LOSSES], NORMS)
    typo = run_titan("compare", str(ref), str(off), "--metrics", "losss", "--rtol", "1e-6")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert "--metrics losss: no run logs it; the runs log: grad_norm, loss, lr" in typo.stderr
    assert "OK" not in typo.stdout


def test_a_metric_only_the_other_run_logs_fails_a_tolerance_check(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    other = write_run(tmp_path / "other", LOSSES, NORMS)
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text("".join(json.dumps({**r, "tps": 100.0}) + "\n" for r in rows))
    checked = run_titan("compare", str(ref), str(other), "--metrics", "tps", "--rtol", "0")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "the reference run ref logs no tps, so nothing would be compared" in checked.stderr
    shown = run_titan("compare", str(ref), str(other), "--metrics", "tps")  # looking is fine
    assert shown.returncode == 0, shown.stdout + shown.stderr


def test_runs_logging_a_metric_as_null_compare_by_default(tmp_path: Path) -> None:
    """A pipeline stage that computes no loss logs ``loss: null``: the metric is known, shown as '-'."""
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    stage = write_run(tmp_path / "stage", LOSSES, NORMS)
    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    (stage / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": None}) + "\n" for r in rows))
    shown = run_titan("compare", str(ref), str(stage))
    assert shown.returncode == 0, shown.stdout + shown.stderr


@pytest.mark.parametrize(
    ("value", "kind"),
    [("[1]", "a list"), ('"NaN"', "a string"), ("true", "a boolean"), ('{"a": 1}', "an object")],
)
def test_a_metric_value_that_is_not_a_number_is_one_error(tmp_path: Path, value: str, kind: str) -> None:
    """It was a TypeError traceback ([1], "NaN"), and ``true`` was compared as 1."""
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    garbage = tmp_path / "garb"
    garbage.mkdir()
    (garbage / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 10.0}}\n\n{{"step": 2, "loss": {value}}}\n')
    for args in (["--rtol", "1e-3"], [], ["--json"]):
        result = run_titan("compare", str(ref), str(garbage), *args)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr  # no traceback
        assert lines[0].startswith(f"titan: error: {garbage / 'metrics.jsonl'}:3: loss at step 2 is ")
        assert f"({kind}), not a number" in lines[0]
        assert "OK" not in result.stdout


def test_a_step_that_is_not_an_integer_is_one_error(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": true, "loss": 10.0}\n')
    result = run_titan("compare", str(ref), str(bad), "--rtol", "1e-3")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{bad / 'metrics.jsonl'}:1: not a metrics row" in result.stderr


def test_a_plot_path_that_cannot_be_written_is_refused_before_comparing(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    off = write_run(tmp_path / "off", [x * 1.1 for x in LOSSES], NORMS)
    missing = tmp_path / "no" / "dir" / "x.png"
    for runs in ([ref, ref], [ref, off]):  # whatever the verdict would be: exit 2, not 0 or 1
        result = run_titan("compare", *map(str, runs), "--rtol", "1e-3", "--plot", str(missing))
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == [
            f"titan: error: --plot {missing}: the folder {missing.parent} does not exist; create it or "
            "give a .png path in an existing folder"
        ]
        assert "runs:" not in result.stdout and "OK" not in result.stdout  # nothing compared
    folder = tmp_path / "a.png"
    folder.mkdir()
    result = run_titan("compare", str(ref), str(off), "--plot", str(folder))
    assert result.returncode == 2 and f"--plot {folder}: is a folder" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_titan("compare", str(ref), str(off), "--plot", str(tmp_path / "x.jpg"))
    assert result.returncode == 2 and "expected a .png file name" in result.stderr


def test_asserting_on_a_run_without_config_toml_says_its_determinism_is_unchecked(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    nocfg = write_run(tmp_path / "nocfg", LOSSES, NORMS, warn_only=True)
    (nocfg / "config.toml").unlink()  # e.g. metrics.jsonl copied alone
    result = run_titan("compare", str(ref), str(nocfg), "--rtol", "1e-4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: every step within" in result.stdout
    assert result.stderr.strip().splitlines() == [
        f"titan: warning: {nocfg}: no config.toml, so whether it was made with "
        "debug.deterministic_warn_only = true (unfit for numerical validation) cannot be checked; "
        "compare the run's own job.dump_folder"
    ]
    assert run_titan("compare", str(ref), str(nocfg)).stderr == ""  # only looking: nothing to check


def test_a_config_toml_that_is_not_toml_is_one_error(tmp_path: Path) -> None:
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    broken = write_run(tmp_path / "broken", LOSSES, NORMS)
    (broken / "config.toml").write_bytes(b"[debug\n\xff")
    result = run_titan("compare", str(ref), str(broken), "--rtol", "1e-4")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"titan: error: {broken / 'config.toml'}: cannot be read")


def test_memory_compare_says_a_report_is_of_a_failed_run(tmp_path: Path) -> None:
    """A run that failed in its steady step wrote the points it reached: its peak is that of the
    step's start, not the step's, and compared as if complete it looked like the smaller layout."""
    MiB = 1024**2
    a = _report(tmp_path / "fsdp4.json", 4, 1, 100 * MiB, 2 * MiB)
    b = _report(tmp_path / "pp2.json", 2, 2, 150 * MiB, 4 * MiB)
    data = json.loads(b.read_text())
    data["observations"] = data["observations"][:2]  # it failed before the steady point
    data["peak_bytes"] = 3000
    data["error"] = "step 1: RuntimeError: out of memory"
    b.write_text(json.dumps(data))
    result = run_titan("memory", "compare", str(a), str(b))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        "B failed (step 1: RuntimeError: out of memory): its figures stop at the last point it "
        "reached (after_optimizer_warmup), and its peak is not the step's" in lines
    ), result.stdout
    assert lines[-1].startswith("peak: A 100.0 MiB, B 0.0 MiB (B failed: not its peak)"), lines[-1]
    as_json = json.loads(run_titan("memory", "compare", str(a), str(b), "--json").stdout)
    assert as_json["errors"] == {"a": None, "b": "step 1: RuntimeError: out of memory"}
    assert as_json["peak"]["diff"] is None


@pytest.mark.parametrize(
    ("observations", "why"),
    [
        ([1], "observation 1 is a int, not an object"),
        ([{"step": 1}], "observation 1 has no 'point'"),
        ([{"point": "after_init", "params_bytes": "12"}], "after_init: params_bytes is '12', not a number"),
    ],
)
def test_a_malformed_memory_report_is_one_error(tmp_path: Path, observations: list, why: str) -> None:
    a = _report(tmp_path / "a.json", 4, 1, 100, 2)
    b = tmp_path / "b.json"
    b.write_text(json.dumps({**json.loads(a.read_text()), "observations": observations}))
    result = run_titan("memory", "compare", str(a), str(b))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == f"titan: error: {b}: not a memory report ({why}); give a memory_report_rank<r>.json"
    )


def test_a_snapshot_pickle_given_as_a_report_is_one_error(tmp_path: Path) -> None:
    """A memory snapshot (``.pickle``) is the file beside the reports a user is likeliest to pass
    by mistake; its bytes are no UTF-8, and the command ended in a UnicodeDecodeError traceback."""
    import pickle

    a = _report(tmp_path / "a.json", 4, 1, 100, 2)
    snapshot = tmp_path / "rank0_memory_snapshot.pickle"
    snapshot.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    result = run_titan("memory", "compare", str(a), str(snapshot))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"titan: error: {snapshot}: not a readable JSON memory report (not text: a memory snapshot "
        "pickle? view it with titan memory view); give a memory_report_rank<r>.json"
    )


def test_a_report_whose_peak_is_not_a_number_is_one_error(tmp_path: Path) -> None:
    a = _report(tmp_path / "a.json", 4, 1, 100, 2)
    b = tmp_path / "b.json"
    b.write_text(json.dumps({**json.loads(a.read_text()), "peak_bytes": "100 MiB"}))
    result = run_titan("memory", "compare", str(a), str(b))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"titan: error: {b}: not a memory report (peak_bytes is '100 MiB', not a number); "
        "give a memory_report_rank<r>.json"
    )


def test_compare_given_memory_reports_points_to_titan_memory_compare(tmp_path: Path) -> None:
    """A memory report (or the snapshot beside it) handed to ``titan compare`` was "not a metrics
    row"; the error now names the command that compares what was given."""
    ref = write_run(tmp_path / "ref", LOSSES, NORMS)
    report = tmp_path / "memory_report_rank0.json"
    report.write_text(json.dumps({"observations": [], "config": {}}, indent=2))
    snapshot = tmp_path / "rank0_memory_snapshot.pickle"
    snapshot.write_bytes(b"\x80\x04\x95\x00\xff\xfe")
    for given, tool in ((report, "titan memory compare"), (snapshot, "titan memory view")):
        result = run_titan("compare", str(ref), str(given))
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"titan: error: {given}: "), lines[0]
        assert tool in lines[0], lines[0]
