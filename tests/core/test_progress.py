"""A run a person can follow: readable step lines, the end-of-run summary, train.log, run_train.sh."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, tiny_llama3, tiny_recipe_source
from titan_core._registry import get_registry
from titan_core.log import _for_console
from titan_core.trainer import train


def test_console_step_line_shows_progress_and_eta() -> None:
    row = {"event": "step", "step": 12, "of": 30, "loss": 3.21, "lr": 0.0008, "grad_norm": 1.5}
    row.update({"tps": 12345.6, "mfu_pct": 41.25, "max_reserved_gib": 7.5, "step_time_s": 0.25})
    line = _for_console({**row, "eta": "0:04", "custom": 1})["event"]
    assert line == (
        "step 12/30 | loss 3.2100 | lr 8.00e-04 | gnorm 1.500 | 12.3k tok/s | mfu 41.2% | mem 7.50GiB"
        " | 0.250s/step | eta 0:04"
    )
    assert _for_console({**row, "custom": 1})["custom"] == 1  # other values stay key=value


def test_log_file_in_console_format_with_summary(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 3)
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = True
    train(config, get_registry())
    text = (tmp_path / "train.log").read_text()
    assert '"event"' not in text  # console format, not JSON
    for step in (1, 2, 3):
        assert f"step {step}/3 | loss " in text
    assert "| eta 0:00" in text
    summary = text[text.index("run summary (rank 0)") :]
    for expected in ("wall time", "tokens/s", "mfu", "final loss", f"outputs        {tmp_path} (train.log"):
        assert expected in summary, expected
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in summary
    # The build line comes first: lines before the file was opened are kept for it.
    assert text.index("built") < text.index("step 1/3")


def test_run_train_sh_renders_console_format_on_a_terminal(tmp_path: Path) -> None:
    (tmp_path / "progress_recipes.py").write_text(tiny_recipe_source("tiny", 2))
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_LOG_FORMAT", "TITAN_DISABLE_PLUGINS")}
    env.update(
        NGPU="1",
        MODULE="progress_recipes",
        CONFIG="tiny",
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
        OMP_NUM_THREADS="1",
    )
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [str(REPO / "run_train.sh"), "--dump-folder", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        stdout=follower,
        stderr=subprocess.STDOUT,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    output = b"".join(chunks).decode(errors="replace")
    assert "step 2/2 | loss " in output, output[-3000:]
    assert '"event": "step"' not in output
    assert "run summary" in output
    assert sys.executable  # the launcher used the environment's python
