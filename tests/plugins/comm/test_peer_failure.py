"""A peer that dies or stalls in a 2-process gloo run ends the others with one titan line, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import child_env, torchrun_command

RECIPE = """
import os
import time

from titan_core import Callback, hookimpl
from titan_core._registry import get_registry
from tests.parallel_harness import tiny_config


class Fault:
    @hookimpl
    def titan_callbacks(self):
        return [Callback("fault", lambda trainer: self)]

    def after_forward_backward(self, step):
        if step == 2 and os.environ.get("RANK") == "1":
            if "{fault}" == "die":
                os._exit(3)
            time.sleep(600)


def layout():
    get_registry().register(Fault(), "fault")
    c = tiny_config(**{{"parallelism.dp_shard": 2, "training.local_batch_size": 2}})
    c.comm.train_timeout_seconds = 15
    c.job.dump_folder = "out"
    return c
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_a_failed_peer_ends_rank_0_with_one_line(tmp_path: Path, fault: str) -> None:
    import subprocess

    (tmp_path / "fault_recipe.py").write_text(RECIPE.format(fault=fault))
    result = subprocess.run(
        torchrun_command(2, "--module", "fault_recipe", "--recipe", "layout"),
        cwd=tmp_path,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,  # bounded: a hang fails the test (the collective timeout is 15 s)
    )
    assert result.returncode != 0
    if fault == "die":
        # The dead rank cannot speak; torchrun names it and ends the survivors (no hang).
        assert "exitcode: 3" in result.stderr and "local_rank: 1" in result.stderr
        return
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("titan: error:") or "]:titan: error:" in line
    ]
    # Rank 1 stalls after its backward: rank 0 waits in the next collective, the grad-norm's.
    expected = "rank 0: a collective with its peers failed in the gradient-norm all-reduce of step 2"
    assert any(expected in line for line in lines), result.stderr[-3000:]
    assert "Traceback (most recent call last)" not in "\n".join(
        line for line in result.stderr.splitlines() if line.startswith("[rank0]")
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "[.../unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete",
            "stalled past comm.init_timeout_seconds=8 (gloo's pipeline sends and receives keep",
        ),
        (
            "[.../gloo/transport/tcp/pair.cc:534] Timed out waiting 3000ms for allreduce",
            "stalled past comm.train_timeout_seconds=3 (",
        ),
    ],
)
def test_a_gloo_pipeline_transfer_that_timed_out_names_the_timeout_that_applied(
    monkeypatch: pytest.MonkeyPatch, text: str, named: str
) -> None:
    """torch shortens gloo's collectives to comm.train_timeout_seconds after step 1, not its sends
    and receives: a stalled pipeline peer was reported after the init timeout (8 s here) with a
    message naming the training timeout (3 s)."""
    from tests.parallel_harness import tiny_config
    from titan_core.run import peer_failure

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = tiny_config()
    config.comm.train_timeout_seconds, config.comm.init_timeout_seconds = 3, 8
    error = peer_failure(RuntimeError(text), config)
    assert error is not None and named in str(error)
