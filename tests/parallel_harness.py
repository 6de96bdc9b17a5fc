"""Harness for multi-process tests: tiny configs, seed checkpoints, torchrun runs, step losses.

Parallel layouts are checked the way ``docs/debugging.md`` describes: every run starts from the
same seed checkpoint (``checkpoint.initial_load_path``), keeps the packing order
(``data.shuffle_buffer = 0``) so the global batch is the same for any DP degree, and its per-step
losses are compared with a one-process run of the same global batch.

Typical use in a test::

    from tests.parallel_harness import assert_losses_close, run_layout

    def test_fsdp(tmp_path, seed_checkpoint, reference_losses):
        losses = run_layout(tmp_path, nproc=2, seed=seed_checkpoint,
                            overrides={"parallelism.dp_shard": 2, "training.local_batch_size": 2})
        assert_losses_close(losses, reference_losses)

A run is described by *overrides*: dotted config paths (``"parallelism.tp"``) mapped to values,
applied on top of :func:`tiny_config`. The harness writes them into a recipe module in the test's
temporary folder and launches ``python -m titan_core.train --module <it>`` (under ``torchrun`` when
``nproc > 1``), so the subprocess goes through exactly the path a user's run takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: The tiny Llama 3 shape used by parallel tests: 4 query heads and 2 KV heads (so TP 2 shards
#: both and grouped-query attention is exercised), 4 blocks (PP 2 with 2 stages per rank fits).
TINY_MODEL = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}

#: Global batch (sequences per step over all DP ranks) of every comparison run.
GLOBAL_BATCH = 4
SEQ_LEN = 32
STEPS = 6


def tiny_config(**overrides: Any) -> Any:
    """The base config of parallel tests: tiny Llama 3, fp32, CPU, no shuffling, 6 steps.

    ``overrides`` maps dotted paths to values (``{"parallelism.tp": 2}``); unknown paths fail.
    Keyword names cannot hold dots, so pass a dict: ``tiny_config(**{"parallelism.tp": 2})``.
    """
    from titan_plugins_llama3.recipes import llama3_debugmodel

    config = llama3_debugmodel()
    config.model.overrides = dict(TINY_MODEL)
    config.training.steps = STEPS
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = GLOBAL_BATCH
    config.training.warmup_steps = 2
    config.training.device = "cpu"
    config.training.dtype = "float32"
    config.data.bundled_documents = 200
    config.data.shuffle_buffer = 0
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.debug.seed = 0
    apply_overrides(config, overrides)
    return config


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """Set each dotted path of ``overrides`` on ``config`` (in place); returns ``config``."""
    for path, value in overrides.items():
        *sections, leaf = path.split(".")
        target = config
        for name in sections:
            target = getattr(target, name)
        if not hasattr(target, leaf):
            raise AttributeError(f"config has no field {path!r}")
        setattr(target, leaf, value)
    return config


def write_seed_checkpoint(path: Path, **overrides: Any) -> Path:
    """Build the tiny model on CPU in this process, initialise it and ``torch.save`` its state dict.

    This is the seed every layout loads through ``checkpoint.initial_load_path``; the model
    shape comes from :func:`tiny_config` with ``overrides`` (e.g. ``{"model.overrides": {...}}``).
    """
    import torch

    from titan_core._registry import get_registry
    from titan_core.tied import retie, shared_parameters

    config = tiny_config(**overrides)
    spec = get_registry().get("models", config.model.name, what="model")
    args = spec.flavor(config.model.flavor, config.model.overrides)
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = spec.build(args)
    # A plain to_empty gives tied names two parameters (two different matrices in the seed,
    # which a tied model refuses to load); the trainer keeps the tie, and so does the seed.
    groups = shared_parameters(model)
    model.to_empty(device="cpu")
    retie([model], groups)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


def write_recipe_module(folder: Path, overrides: Mapping[str, Any], name: str = "layout_recipes") -> str:
    """Write ``folder/<name>.py`` with one recipe ``layout`` = :func:`tiny_config` + ``overrides``.

    Returns the module name; put ``folder`` on ``PYTHONPATH`` (``run_titan_train`` does).
    ``job.dump_folder`` defaults to ``folder/out``.
    """
    overrides = {"job.dump_folder": str(folder / "out"), **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(
        '"""Generated by tests/parallel_harness.py."""\n'
        "from tests.parallel_harness import tiny_config\n\n\n"
        "def layout():\n"
        f"    return tiny_config(**{dict(overrides)!r})\n"
    )
    return name


def child_env(folder: Path | None = None, **extra: str) -> dict[str, str]:
    """Environment of a training subprocess: JSON logs, repo (and ``folder``) importable, one thread.

    Torchrun's own variables from an enclosing launch are dropped so a nested run starts clean.
    """
    drop = {"TITAN_DISABLE_PLUGINS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [str(folder)] if folder is not None else []
    paths += [str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TITAN_LOG_FORMAT"] = "json"
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores in CI
    env.update(extra)
    return env


def torchrun_command(nproc: int, *train_args: str, log_ranks: str | None = None) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) running ``titan_core.train`` on one host.

    ``log_ranks`` is passed as ``--local-ranks-filter`` (with ``--tee 3``), as ``run_train.sh`` does;
    ``None`` lets every rank print.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--role=rank",
    ]
    if log_ranks is not None:
        cmd += ["--tee=3", f"--local-ranks-filter={log_ranks}"]
    return [*cmd, "-m", "titan_core.train", *train_args]


def run_titan_train(
    folder: Path,
    nproc: int,
    overrides: Mapping[str, Any],
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run the layout ``overrides`` with ``nproc`` processes (plain python when 1); no check.

    Returns the CompletedProcess (text). Use :func:`step_losses` on its ``stdout``.
    """
    module = write_recipe_module(folder, overrides)
    args = ["--module", module, "--config", "layout", *extra_args]
    single = [sys.executable, "-m", "titan_core.train", *args]
    cmd = single if nproc == 1 else torchrun_command(nproc, *args)
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=child_env(folder, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def log_records(stdout: str) -> list[dict[str, Any]]:
    """Every JSON log record of ``stdout`` as a dict, in order; other text is skipped.

    Ranks share one pipe and a record's newline is written separately, so two records can
    share a line; torchrun's ``--tee`` prefixes lines with ``[rank]:``. Records are therefore
    decoded wherever a ``{`` starts one.
    """
    decoder = json.JSONDecoder()
    records = []
    for line in stdout.splitlines():
        pos = line.find("{")
        while pos >= 0:
            try:
                record, end = decoder.raw_decode(line, pos)
            except json.JSONDecodeError:
                pos = line.find("{", pos + 1)
                continue
            if isinstance(record, dict):
                records.append(record)
            pos = line.find("{", end)
    return records


def step_losses(stdout: str, rank: int | None = 0) -> list[float]:
    """Losses of the ``step`` lines of ``rank`` (``None``: lines without a rank or any rank), in order."""
    losses = []
    for record in log_records(stdout):
        if record.get("event") != "step" or "loss" not in record:
            continue
        if rank is not None and record.get("rank", 0) != rank:
            continue
        losses.append(float(record["loss"]))
    return losses


def run_layout(
    folder: Path,
    nproc: int,
    seed: Path,
    overrides: Mapping[str, Any],
    *,
    rank: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> list[float]:
    """Run a layout from the seed checkpoint and return ``rank``'s per-step losses.

    Fails the test (with the subprocess's output tail) when the run fails or logs fewer than
    :data:`STEPS` losses.
    """
    overrides = {"checkpoint.initial_load_path": str(seed), **overrides}
    result = run_titan_train(folder, nproc, overrides, env=env, timeout=timeout)
    losses = step_losses(result.stdout, rank=rank)
    if result.returncode != 0 or len(losses) < STEPS:
        raise AssertionError(
            f"layout {dict(overrides)} on {nproc} processes failed (exit {result.returncode}, "
            f"{len(losses)} losses)\n--- stdout tail\n{result.stdout[-4000:]}\n"
            f"--- stderr tail\n{result.stderr[-6000:]}"
        )
    return losses


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float = 1e-4) -> None:
    """Per-step losses agree within ``rtol`` relative, over at least :data:`STEPS` steps."""
    assert len(actual) >= STEPS and len(expected) >= STEPS, (actual, expected)
    n = min(len(actual), len(expected))
    bad = [
        (i + 1, a, e)
        for i, (a, e) in enumerate(zip(actual[:n], expected[:n], strict=True))
        if abs(a - e) > rtol * abs(e)
    ]
    assert not bad, f"losses differ beyond {rtol} relative at (step, got, expected): {bad}"


__all__ = [
    "GLOBAL_BATCH",
    "REPO",
    "SEQ_LEN",
    "STEPS",
    "TINY_MODEL",
    "apply_overrides",
    "assert_losses_close",
    "child_env",
    "log_records",
    "run_layout",
    "run_titan_train",
    "step_losses",
    "tiny_config",
    "torchrun_command",
    "write_recipe_module",
    "write_seed_checkpoint",
]
