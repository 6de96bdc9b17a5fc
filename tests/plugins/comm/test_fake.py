"""The fake comm backends end to end: the spec's launch commands, the memory report, and the
per-rank parameter share of a logical job far larger than this machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, step_rows, titan_env
from tests.parallel_harness import log_records
from titan_plugins_llama3.flavors import FLAVORS, Llama3Args
from titan_plugins_memory.report import POINTS
from titan_plugins_parallel.pipeline import split_layers

RECIPES = '''
from titan_plugins_llama3.recipes import llama3_8b, llama3_debugmodel


def llama3_debugmodel_pp2_fsdp2():
    """The spec's example layout: PP 2 x FSDP 2 (a four-rank job)."""
    config = llama3_debugmodel()
    config.parallelism.pp = 2
    config.parallelism.dp_shard = 2
    config.training.local_batch_size = 4
    config.training.seq_len = 64
    config.training.device = "cpu"
    config.metrics.enable_tensorboard = False
    config.job.dump_folder = "./out"
    return config


def llama3_debugmodel_pp2_fsdp2_masked():
    """The same layout with document masking (the later stage masks from the token ids)."""
    config = llama3_debugmodel_pp2_fsdp2()
    config.model.overrides = {"document_mask": True}
    config.job.dump_folder = "./out_masked"
    return config


def llama3_debugmodel_pp2_fsdp2_masked_computed():
    """The masked layout with computed (not shape-only) steps."""
    config = llama3_debugmodel_pp2_fsdp2_masked()
    config.debug.fake_tensors = "off"
    return config


def pp2_fsdp2_tb(lr=3e-3):
    """The spec's layout computed, with TensorBoard, in its own folder."""
    config = llama3_debugmodel_pp2_fsdp2()
    config.debug.fake_tensors = "off"
    config.metrics.enable_tensorboard = True
    config.training.lr = lr
    config.job.dump_folder = "./out_tb"
    return config


def pp2_fsdp2_tb_other_lr():
    return pp2_fsdp2_tb(lr=1e-3)


def seeded(name="seeded", pp=1, seed=False):
    """Two short runs from one seed checkpoint (``seed``: the run that writes it)."""
    config = llama3_debugmodel_pp2_fsdp2()
    config.parallelism.pp, config.parallelism.dp_shard = pp, 1
    config.training.steps = 2
    config.job.dump_folder = f"./{name}"
    if seed:
        config.checkpoint.create_seed_checkpoint = True
    else:
        config.checkpoint.initial_load_path = "./seed/checkpoint/step-0"
    return config


def seed():
    return seeded("seed", seed=True)


def seeded_pp2():
    return seeded("seeded_pp2", pp=2)


def llama3_debugmodel_fsdp4():
    """FSDP over four ranks, no pipeline."""
    config = llama3_debugmodel_pp2_fsdp2()
    config.parallelism.pp = 1
    config.parallelism.dp_shard = 4
    return config


def llama3_8b_tp8_pp2_fsdp4():
    """Llama 3.1 8B as a 64-rank job, TP 8 x PP 2 x FSDP 4; a short sequence keeps one CPU step short."""
    config = llama3_8b()
    config.parallelism.tp = 8
    config.parallelism.pp = 2
    config.parallelism.dp_shard = 4
    config.parallelism.pp_schedule = "GPipe"
    config.parallelism.pp_microbatches = 1
    config.training.seq_len = 256
    config.training.local_batch_size = 1
    config.training.dtype = "float32"
    config.training.device = "cpu"
    config.metrics.enable_tensorboard = False
    config.job.dump_folder = "./out8b"
    return config
'''

CONTRACT_VARS = (
    "NGPU",
    "FAKE_PP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "COMM_BACKEND",
    "MODULE",
    "CONFIG",
)


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    (tmp_path / "my_debug_configs.py").write_text(RECIPES)
    return tmp_path


def env(**extra: str) -> dict[str, str]:
    """A child environment with no launch variable inherited from this one."""
    base = titan_env(**extra)
    for name in CONTRACT_VARS:
        if name not in extra:
            base.pop(name, None)
    return base


def local_param_share(args: Llama3Args, pp: int, pp_rank: int, tp: int, fsdp: int) -> int:
    """Parameters one rank of stage ``pp_rank`` holds: its stage's matrices split tp * fsdp ways,
    its RMSNorm weights (replicated over TP) split fsdp ways."""
    dim, hd = args.dim, args.head_dim
    attention = dim * args.n_heads * hd * 2 + dim * args.kv_heads * hd * 2
    ffn = 3 * dim * args.ffn_hidden_dim
    n_blocks = len(split_layers([str(i) for i in range(args.n_layers)], pp)[pp_rank])
    matrices = n_blocks * (attention + ffn)
    norms = n_blocks * 2 * dim
    if pp_rank == 0:
        matrices += args.vocab_size * dim  # token embedding
    if pp_rank == pp - 1:
        matrices += args.vocab_size * dim  # output projection
        norms += dim  # final norm
    assert matrices % (tp * fsdp) == 0 and norms % fsdp == 0  # no padding in these layouts
    return matrices // (tp * fsdp) + norms // fsdp


def test_analytic_share_adds_up_to_the_model() -> None:
    from titan_plugins_llama3.flavors import num_params

    args = FLAVORS["8B"]
    shares = [local_param_share(args, 2, r, 1, 1) for r in range(2)]
    assert sum(shares) == num_params(args)


@pytest.mark.slow
def test_pure_fake_example_is_logical_rank_2_and_reports_memory(recipes: Path) -> None:
    result = subprocess.run(
        [str(REPO / "run_train.sh")],
        cwd=recipes,
        env=env(
            NGPU="4",
            FAKE_PP_RANK="1",
            COMM_BACKEND="fake",
            MODULE="my_debug_configs",
            CONFIG="llama3_debugmodel_pp2_fsdp2",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = step_rows(result.stdout)
    assert [r["step"] for r in rows] == [1]  # run_train.sh limits pure fake to one step
    assert all(r["rank"] == 2 for r in rows)
    assert "memory report: llama3_debugmodel_pp2_fsdp2" in result.stdout  # the printed table

    report = json.loads((recipes / "out" / "memory_report_rank2.json").read_text())
    assert (report["logical_rank"], report["pp_rank"], report["world_size"]) == (2, 1, 4)
    assert report["physical_world_size"] == 1 and report["comm_backend"] == "fake"
    assert report["pp_group_backend"] is None
    assert report["recipe"] == "llama3_debugmodel_pp2_fsdp2"
    assert report["degrees"]["pp"] == 2 and report["degrees"]["dp_shard"] == 2
    assert sorted(o["point"] for o in report["observations"]) == sorted(POINTS)
    assert report["steady_step"] == 1

    share = local_param_share(FLAVORS["debugmodel"], pp=2, pp_rank=1, tp=1, fsdp=2)
    assert report["params_numel"] == share
    assert report["params_bytes"] == 4 * share  # float32
    built = next(r for r in log_records(result.stdout) if r.get("event") == "built")
    assert built["params_local"] == share  # the log line counts this rank's shards too
    by_point = {o["point"]: o for o in report["observations"]}
    assert by_point["after_init"]["grads_bytes"] == 0
    assert by_point["after_init"]["optimizer_state_bytes"] == 0
    after = by_point["after_optimizer_step"]
    assert after["grads_bytes"] == report["params_bytes"]
    assert after["optimizer_state_bytes"] >= 2 * report["params_bytes"]  # AdamW: exp_avg, exp_avg_sq
    fwd_bwd = by_point["steady_forward_backward"]
    assert fwd_bwd["step_allocations_peak_bytes"] > 0
    assert fwd_bwd["peak_bytes"] > report["params_bytes"] + fwd_bwd["grads_bytes"]


@pytest.mark.parametrize(
    "recipe", ["llama3_debugmodel_pp2_fsdp2_masked", "llama3_debugmodel_pp2_fsdp2_masked_computed"]
)
def test_pure_fake_pp_rank_1_takes_its_step_with_document_masking(recipes: Path, recipe: str) -> None:
    """The later stage of a simulated pipeline masks from the token ids the schedule passes it,
    in shape-only steps (``debug.fake_tensors = "auto"``) and in computed ones (``"off"``)."""
    result = fake_run(recipes, recipe, FAKE_PP_RANK="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [(r["step"], r["rank"]) for r in step_rows(result.stdout)] == [(1, 2), (2, 2)]
    report = json.loads((recipes / "out_masked" / "memory_report_rank2.json").read_text())
    assert (report["logical_rank"], report["pp_rank"]) == (2, 1)


def test_pure_fake_pp_rank_1_overwrite_replaces_the_earlier_runs_outputs(recipes: Path) -> None:
    """The one process of a FAKE_PP_RANK=1 run (logical rank 2) prepares the dump folder: its
    ``--overwrite`` removed nothing while saying it did, and the TensorBoard folder held both runs."""
    assert fake_run(recipes, "pp2_fsdp2_tb", FAKE_PP_RANK="1").returncode == 0
    second = fake_run(recipes, "pp2_fsdp2_tb_other_lr", args=("--overwrite",), FAKE_PP_RANK="1")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    out = recipes / "out_tb"
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "run.json").read_text())["identity"]["training"]["lr"] == 1e-3


@pytest.mark.slow
def test_pure_fake_without_pp_is_rank_0_and_ignores_detail_debug(recipes: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "titan_core.cli", "run", "--module", "my_debug_configs"),
            *("--recipe", "llama3_debugmodel_fsdp4", "--comm-backend", "fake"),
        ],
        cwd=recipes,
        env=env(NGPU="4", TORCH_DISTRIBUTED_DEBUG="DETAIL", TITAN_DEFAULT_MAX_STEPS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "cannot check collectives across simulated ranks" in result.stdout
    report = json.loads((recipes / "out" / "memory_report_rank0.json").read_text())
    assert (report["logical_rank"], report["pp_rank"], report["world_size"]) == (0, 0, 4)
    assert report["params_numel"] == local_param_share(FLAVORS["debugmodel"], pp=1, pp_rank=0, tp=1, fsdp=4)


@pytest.mark.slow
def test_hybrid_example_runs_real_pp_over_gloo(recipes: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--role=rank",
        "--tee=3",
        "-m",
        "titan_core.train",
        "--module",
        "my_debug_configs",
        "--config",
        "llama3_debugmodel_pp2_fsdp2",
        "--comm-backend",
        "real_pp_fake_spmd",
    ]
    result = subprocess.run(
        command,
        cwd=recipes,
        env=env(NGPU="4", TITAN_DEFAULT_MAX_STEPS="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses: dict[int, dict[int, float]] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"\[rank(\d)\]:(\{.*\})$", line)
        if match and '"event": "step"' in line:
            row = json.loads(match.group(2))
            losses.setdefault(row["rank"], {})[row["step"]] = row["loss"]
    # Physical ranks 0 and 1 stand for logical ranks 0 and 2 (pp_rank * NGPU / P).
    assert sorted(losses) == [0, 2]
    # Only the last stage computes the loss; the first stage logs it because it crossed the real
    # PP group (the step broadcasts it from the last stage).
    assert losses[0] == losses[2] and sorted(losses[0]) == [1, 2]
    # After step 1 the real PP group (the only real one) gets comm.train_timeout_seconds.
    timeouts = [r for r in log_records(result.stdout) if r.get("event") == "collective timeout set"]
    assert sorted(r["rank"] for r in timeouts) == [0, 2] and all(r["groups"] == 1 for r in timeouts)
    for logical, pp_rank in ((0, 0), (2, 1)):
        report = json.loads((recipes / "out" / f"memory_report_rank{logical}.json").read_text())
        assert report["comm_backend"] == "real_pp_fake_spmd"
        assert (report["pp_rank"], report["world_size"], report["physical_world_size"]) == (pp_rank, 4, 2)
        assert report["pp_group_backend"] == "gloo"
        assert report["steady_step"] == 2
        share = local_param_share(FLAVORS["debugmodel"], pp=2, pp_rank=pp_rank, tp=1, fsdp=2)
        assert report["params_numel"] == share


def torchrun(recipes: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Two processes of ``args`` (a script, or ``-m module ...``) under torchrun, in ``recipes``;
    two steps unless ``TITAN_DEFAULT_MAX_STEPS`` says otherwise."""
    launch = ["--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, *args],
        cwd=recipes,
        env=env(**{"TITAN_DEFAULT_MAX_STEPS": "2", **extra_env}),
        capture_output=True,
        text=True,
        timeout=300,
    )


#: ``titan_core.train`` with ``--overwrite``'s removal slowed down on the first process, as a
#: large earlier run's folder or a busy machine slow it.
SLOW_OVERWRITE = """
import time

from titan_core import run_folder
from titan_core.cli import exit_process, main

removal = run_folder.RunFolder._remove


def slowly(self, prior, *, checkpoints):
    time.sleep(2)
    return removal(self, prior, checkpoints=checkpoints)


run_folder.RunFolder._remove = slowly
args = ["--module", "my_debug_configs", "--recipe", "pp2_fsdp2_tb_other_lr", "--overwrite"]
exit_process(main(["run", *args, "--comm-backend", "real_pp_fake_spmd"]))
"""


@pytest.mark.slow
def test_hybrid_overwrite_removes_before_the_last_stage_writes(recipes: Path) -> None:
    """Under real PP with fake SPMD the first process removes what ``--overwrite`` replaces and
    the last stage writes the run's files: it waited for nothing (the default group is fake) and
    lost its log, metrics, config and run.json to the removal, exiting 0."""
    train = ["-m", "titan_core.train", "--module", "my_debug_configs", "--config", "pp2_fsdp2_tb"]
    first = torchrun(recipes, *train, "--comm-backend", "real_pp_fake_spmd", NGPU="4")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    (recipes / "slow_overwrite.py").write_text(SLOW_OVERWRITE)
    second = torchrun(recipes, "slow_overwrite.py", NGPU="4", PYTHONPATH=str(recipes))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    out = recipes / "out_tb"
    for name in ("train.log", "metrics.jsonl", "config.toml", "run.json"):
        assert (out / name).is_file(), name
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert json.loads((out / "run.json").read_text())["identity"]["training"]["lr"] == 1e-3


@pytest.mark.slow
def test_hybrid_loads_initial_weights_from_a_dcp_folder(recipes: Path) -> None:
    """DCP plans a load with collectives over the default group, which hybrid mode simulates:
    every process failed in ``scatter_object_list`` (EOFError). Each plans its own reads now, and
    a job with no simulated rank (NGPU = pp) trains as the one-process run from the same seed."""
    for recipe in ("seed", "seeded"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "titan_core.cli",
                "run",
                "--module",
                "my_debug_configs",
                "--recipe",
                recipe,
            ],
            cwd=recipes,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    train = ["-m", "titan_core.train", "--module", "my_debug_configs", "--config", "seeded_pp2"]
    hybrid = torchrun(
        recipes, *train, "--comm-backend", "real_pp_fake_spmd", NGPU="2", TITAN_DEFAULT_MAX_STEPS=""
    )
    assert hybrid.returncode == 0, hybrid.stdout[-2000:] + hybrid.stderr[-3000:]

    def losses(name: str) -> list[float]:
        return [
            json.loads(line)["loss"] for line in (recipes / name / "metrics.jsonl").read_text().splitlines()
        ]

    assert losses("seeded_pp2") == pytest.approx(losses("seeded"), rel=1e-5)


@pytest.mark.slow
def test_llama3_8b_as_a_64_rank_job_fits_this_machine(recipes: Path) -> None:
    """One rank of an 8B TP8 x PP2 x FSDP4 job: only its shards exist, on a 2-core CPU."""
    start = time.perf_counter()
    result = subprocess.run(
        [str(REPO / "run_train.sh")],
        cwd=recipes,
        env=env(
            NGPU="64",
            FAKE_PP_RANK="1",
            COMM_BACKEND="fake",
            MODULE="my_debug_configs",
            CONFIG="llama3_8b_tp8_pp2_fsdp4",
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((recipes / "out8b" / "memory_report_rank32.json").read_text())
    assert (report["logical_rank"], report["pp_rank"], report["world_size"]) == (32, 1, 64)
    share = local_param_share(FLAVORS["8B"], pp=2, pp_rank=1, tp=8, fsdp=4)
    assert report["params_numel"] == share
    assert report["params_bytes"] == 4 * share
    gib = 1024**3
    # the steady step: 0.5 GiB of parameters, their gradients, 0.9 GiB of AdamW state (allocated
    # before the first forward by the memory report) and the activations, about 5.4 GiB accounted
    assert report["max_rss_bytes"] < 7 * gib, report["max_rss_bytes"] / gib
    # The speed (under 2 minutes on 2 cores) is measured by bench/fake_speed.py, not asserted here:
    # a timing limit in a test fails whenever the machine is busy.
    print(f"one fake 8B step took {elapsed:.0f}s")


FAKE_TENSORS_OFF = '''

def llama3_debugmodel_fsdp4_computed():
    """The same rank, every kernel run (``debug.fake_tensors = "off"``)."""
    config = llama3_debugmodel_fsdp4()
    config.debug.fake_tensors = "off"
    config.job.dump_folder = "./computed"
    return config


def llama3_debugmodel_fake_tensors_on():
    """Fake tensors asked for where peers are real."""
    config = llama3_debugmodel_fsdp4()
    config.parallelism.dp_shard = -1
    config.debug.fake_tensors = "on"
    return config
'''


def fake_run(
    recipes: Path,
    recipe: str,
    backend: str = "fake",
    ngpu: str = "4",
    args: tuple[str, ...] = (),
    **extra_env: str,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "titan_core.cli", "run", "--module", "my_debug_configs"),
            *("--recipe", recipe, "--comm-backend", backend, *args),
        ],
        cwd=recipes,
        env=env(NGPU=ngpu, TITAN_DEFAULT_MAX_STEPS="2", **extra_env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_pure_fake_on_the_cpu_takes_shape_only_steps_with_the_computed_memory(recipes: Path) -> None:
    (recipes / "my_debug_configs.py").write_text(RECIPES + FAKE_TENSORS_OFF)
    shapes = fake_run(recipes, "llama3_debugmodel_fsdp4")
    assert shapes.returncode == 0, shapes.stdout[-3000:] + shapes.stderr[-3000:]
    rows = step_rows(shapes.stdout)
    assert [r["step"] for r in rows] == [1, 2]
    # Nothing was computed: no loss, no gradient norm, no throughput figure pretending otherwise.
    assert all(r["loss"] is None and r["grad_norm"] is None for r in rows)  # NaN, written as null
    assert not any("tps" in r or "tflops" in r for r in rows)
    summary = next(r for r in log_records(shapes.stdout) if r.get("event") == "run summary")
    assert summary["final_loss"].startswith("n/a (fake tensors")

    computed = fake_run(recipes, "llama3_debugmodel_fsdp4_computed")
    assert computed.returncode == 0, computed.stdout[-3000:] + computed.stderr[-3000:]
    assert all(r["loss"] == r["loss"] for r in step_rows(computed.stdout))  # computed: finite values

    fake = json.loads((recipes / "out" / "memory_report_rank0.json").read_text())
    real = json.loads((recipes / "computed" / "memory_report_rank0.json").read_text())
    for point in ("after_init", "after_optimizer_warmup"):  # the same tensors, to the byte
        by = (
            {o["point"]: o["accounted_bytes"] for o in fake["observations"]},
            {o["point"]: o["accounted_bytes"] for o in real["observations"]},
        )
        assert by[0][point] == by[1][point], point
    assert fake["params_bytes"] == real["params_bytes"]
    assert fake["optimizer_state_bytes"] == real["optimizer_state_bytes"]
    # The step's peak too: FSDP's gathered parameters and every activation live as long.
    assert fake["peak_bytes"] == real["peak_bytes"]


def test_fake_tensors_on_with_real_peers_is_one_error(recipes: Path) -> None:
    (recipes / "my_debug_configs.py").write_text(RECIPES + FAKE_TENSORS_OFF)
    result = fake_run(recipes, "llama3_debugmodel_fake_tensors_on", backend="default", ngpu="1")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "titan: error: debug.fake_tensors = 'on' needs a comm backend that simulates its peers "
        "(this run's 'default' backend has real ones, so values matter); set "
        "debug.fake_tensors = 'auto' or use --comm-backend fake"
    ]


MOE_RECIPES = '''
from titan_plugins_moe.recipes import qwen3_moe_debugmodel


def qwen3_ep2_fsdp4(fake_tensors="auto"):
    """Qwen3-MoE debug flavor, EP 2 inside FSDP 4: tokens cross ranks by all-to-all."""
    config = qwen3_moe_debugmodel()
    config.parallelism.dp_shard = 4
    config.parallelism.ep = 2
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.device = "cpu"
    config.metrics.enable_tensorboard = False
    config.debug.fake_tensors = fake_tensors
    config.job.dump_folder = "./moe_" + fake_tensors
    return config


def qwen3_ep2_fsdp4_computed():
    return qwen3_ep2_fsdp4("off")
'''


@pytest.mark.slow
def test_moe_shape_only_steps_route_evenly_and_account_like_the_computed_step(recipes: Path) -> None:
    """Tokens per expert and per rank are values: fake tensors take them as an even split."""
    (recipes / "my_debug_configs.py").write_text(MOE_RECIPES)
    shapes = fake_run(recipes, "qwen3_ep2_fsdp4")
    assert shapes.returncode == 0, shapes.stdout[-3000:] + shapes.stderr[-3000:]
    rows = step_rows(shapes.stdout)
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] is None for r in rows)  # NaN
    assert not any(key.startswith("moe/") for r in rows for key in r)  # no counts to report
    computed = fake_run(recipes, "qwen3_ep2_fsdp4_computed")
    assert computed.returncode == 0, computed.stdout[-3000:] + computed.stderr[-3000:]
    assert any(key.startswith("moe/imbalance") for key in step_rows(computed.stdout)[-1])
    fake = json.loads((recipes / "moe_auto" / "memory_report_rank0.json").read_text())
    real = json.loads((recipes / "moe_off" / "memory_report_rank0.json").read_text())
    assert fake["optimizer_state_bytes"] == real["optimizer_state_bytes"] > 0
    # The computed routing is not perfectly even, so the step's peak differs a little.
    assert abs(fake["peak_bytes"] - real["peak_bytes"]) <= 0.02 * real["peak_bytes"]


@pytest.mark.slow
def test_a_deepseek_v3_671b_rank_of_ep64_pp8_runs_its_step_on_this_machine(tmp_path: Path) -> None:
    """Rank 64 (stage 1: eight MoE layers) of the recipe's 512-rank job, shape-only on the CPU."""
    result = subprocess.run(
        [str(REPO / "run_train.sh"), "--dump-folder", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env(NGPU="512", FAKE_PP_RANK="1", COMM_BACKEND="fake", CONFIG="deepseek_v3_671b"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "memory_report_rank64.json").read_text())
    assert (report["pp_rank"], report["world_size"]) == (1, 512)
    assert report["degrees"]["pp"] == 8 and report["degrees"]["ep"] == 64
    # Eight MoE layers: 4 of 256 experts each (3 x 7168 x 2048 weights), 1/64 of the rest.
    assert report["params_numel"] >= 8 * 4 * 3 * 7168 * 2048
    after = {o["point"]: o for o in report["observations"]}["after_optimizer_step"]
    assert after["grads_bytes"] == report["params_bytes"] == 4 * report["params_numel"]
    assert after["optimizer_state_bytes"] >= 2 * report["params_bytes"]
    gib = 1024**3
    assert report["peak_bytes"] > 3 * report["params_bytes"]  # activations come on top
    assert report["max_rss_bytes"] < 2 * gib  # nothing of it was allocated


@pytest.mark.slow
def test_the_summary_names_only_what_a_rank_that_does_not_log_wrote(recipes: Path) -> None:
    """FAKE_PP_RANK=0 of a PP job (a rank that does not log): its summary listed train.log,
    metrics.jsonl and tb/ and a `tensorboard --logdir` command for files it never wrote."""
    out = recipes / "pp0"
    (recipes / "my_debug_configs.py").write_text(
        RECIPES
        + "\n\ndef with_tensorboard():\n    config = llama3_debugmodel_pp2_fsdp2()\n"
        + "    config.metrics.enable_tensorboard = True\n    config.job.dump_folder = './pp0'\n"
        + "    return config\n"
    )
    result = fake_run(recipes, "with_tensorboard", FAKE_PP_RANK="0")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = next(r for r in log_records(result.stdout + result.stderr) if r.get("event") == "run summary")
    listed = summary["outputs"].partition(" (")[2].rstrip(")")
    for name in filter(None, listed.split(", ")):
        assert (out / name.rstrip("/")).exists(), name
    if not (out / "tb").exists():
        assert "--logdir" not in summary["tensorboard"]
