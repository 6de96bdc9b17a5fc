"""SIGTERM reaching one rank of two (torchrun, gloo): the ranks agree on the step to stop at,
every rank saves that step, and a resume goes on from it. They agree every step: agreeing only
on logging steps, a run with a long log interval trained on past the signal (here to its end,
saving nothing of the step the signal came in) and could outlast a cluster's grace period."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, child_env, log_records, write_recipe_module

pytestmark = pytest.mark.slow

LAUNCH = """
import os
import signal

from titan_core import Callback, _registry, hookimpl
from titan_core.cli import exit_process, main


class SigtermOnRankZero:
    '''SIGTERM to rank 0 alone, during step 3: a cluster's signal never lands on every rank at once.'''

    @hookimpl
    def titan_callbacks(self):
        return [Callback("sigterm_rank0", lambda trainer: self)]

    def after_optimizer_step(self, step):
        if step == 3 and os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)


registry = _registry.Registry().load_entry_points()
registry.register(SigtermOnRankZero(), "sigterm_rank0")
_registry._default = registry
exit_process(main(["run", "--module", "sigterm_recipes", "--config", "layout"]))
"""


def test_sigterm_on_one_rank_stops_every_rank_at_one_step_with_its_checkpoint(tmp_path: Path) -> None:
    overrides = {
        "parallelism.dp_shard": 2,
        "training.local_batch_size": 2,
        "training.steps": 8,
        "checkpoint.enable": True,
        "checkpoint.interval": 100,  # only the SIGTERM save (and the last step)
        # No logging step before the end: the ranks agree after every step, so the flag step 3
        # posts stops the run after step 4.
        "metrics.log_freq": 100,
        "comm.train_timeout_seconds": 20,  # a rank left waiting fails fast, not in 10 minutes
    }
    write_recipe_module(tmp_path, overrides, name="sigterm_recipes")
    (tmp_path / "launch.py").write_text(LAUNCH)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"),
        *("--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", str(tmp_path / "launch.py")),
    ]
    result = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    output = result.stdout[-3000:] + result.stderr[-4000:]
    # torchrun ends the other rank once one exits (143): each rank that got to say so stopped at 4.
    errors = [line for line in result.stderr.splitlines() if "titan: error:" in line]
    assert errors and "Timed out" not in result.stdout + result.stderr, output
    assert all("stopped by SIGTERM at step 4 after saving a checkpoint" in line for line in errors), output
    stopped = [r for r in log_records(result.stdout) if r.get("event") == "training stopped"]
    assert stopped and all(r["step"] == 4 and r["reason"].startswith("Terminated") for r in stopped)
    steps = sorted(p.name for p in (tmp_path / "out" / "checkpoint").glob("step-*"))
    assert steps == ["step-4"]
    resumed = subprocess.run(
        [*command[:-1], "-m", "titan_core.train", "--module", "sigterm_recipes", "--config", "layout"],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    trained = sorted({r["step"] for r in log_records(resumed.stdout) if r.get("event") == "step"})
    assert trained == [8]  # resumed after step 4; the last step logs
    starts = [r for r in log_records(resumed.stdout) if r.get("event") == "training starts"]
    assert starts and all(r["first_step"] == 5 for r in starts)
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint").glob("step-*")) == ["step-4", "step-8"]
