"""Where one pure fake step of a large recipe spends its time on the CPU, and what skipping the
garbage computes saves (issue: the debugging toolbox, item 6). CPU only; prints one line per mode.

    NGPU=64 python3 -m bench.fake_speed llama3_8b OUTDIR [MODE...]

Modes (each runs ``titan run --recipe R --comm-backend fake`` for one step in this process's
child, with the memory report):

- ``shipped``: as titan runs it today;
- ``synthetic_data``: the data loader replaced by batches of zeros of the same shape (under the
  fake backends the token values reach nothing that matters: received activations are garbage);
- ``fake_tensors``: synthetic data, and everything from materialisation on under PyTorch's
  ``FakeTensorMode`` (shapes, dtypes and sizes propagate, nothing is computed or allocated;
  ``init_weights`` is skipped, the loss and gradient norm are logged as NaN). The memory report's
  tracker counts fake tensors' storages, so its figures are those of a computed run.

This is a prototype of the core changes proposed in the issue's report (the patches below stand
for them); it monkeypatches titan in the child only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import math, os, sys
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

mode = os.environ["TITAN_FAKE_SPEED_MODE"]
if mode in ("synthetic_data", "fake_tensors"):
    from titan_core.data import loader

    def _zeros(self):
        while True:
            data = torch.zeros(self.batch_size, self.seq_len + 1, dtype=torch.long)
            yield data[:, :-1], data[:, 1:]

    loader.PackedBatches.__iter__ = _zeros
if mode == "fake_tensors":
    from titan_core import trainer as tr

    FAKE = FakeTensorMode(allow_non_fake_inputs=True)
    entered = []
    to_empty = torch.nn.Module.to_empty

    def _to_empty(self, *args, **kwargs):  # the mesh exists; from here on nothing is computed
        if not entered:
            FAKE.__enter__()
            entered.append(True)
        return to_empty(self, *args, **kwargs)

    torch.nn.Module.to_empty = _to_empty
    trunc_normal = torch.nn.init.trunc_normal_
    torch.nn.init.trunc_normal_ = lambda t, *a, **k: t if entered else trunc_normal(t, *a, **k)
    reduce_for_log = tr.Trainer._reduce_for_log

    def _reduce(self, loss, grad_norm):
        if isinstance(grad_norm, FakeTensor):
            return (None if loss is None else math.nan), math.nan
        return reduce_for_log(self, loss, grad_norm)

    tr.Trainer._reduce_for_log = _reduce
from titan_core.cli import main

sys.exit(main(sys.argv[1:]))
"""

MODES = ("shipped", "synthetic_data", "fake_tensors")


def run(recipe: str, out: Path, mode: str) -> dict[str, object]:
    folder = out / mode
    env = dict(os.environ, TITAN_FAKE_SPEED_MODE=mode, TITAN_DEFAULT_MAX_STEPS="1", TITAN_LOG_FORMAT="json")
    env.setdefault("NGPU", "64")
    started = time.perf_counter()
    command = [sys.executable, "-c", CHILD, "run", "--recipe", recipe, "--comm-backend", "fake"]
    result = subprocess.run(
        [*command, "--dump-folder", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    (out / f"{mode}.log").write_text(result.stdout + result.stderr)
    row: dict[str, object] = {"mode": mode, "rc": result.returncode, "seconds": round(elapsed, 1)}
    report = folder / "memory_report_rank0.json"
    if report.exists():
        data = json.loads(report.read_text())
        obs = {o["point"]: o for o in data["observations"]}
        row["steady_peak_gib"] = round(obs["steady_forward_backward"]["peak_bytes"] / 1024**3, 3)
        row["max_rss_gib"] = round(data["max_rss_bytes"] / 1024**3, 3)
    return row


def main(argv: list[str]) -> int:
    recipe, out, *modes = argv
    Path(out).mkdir(parents=True, exist_ok=True)
    for mode in modes or MODES:
        print(json.dumps(run(recipe, Path(out), mode)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
