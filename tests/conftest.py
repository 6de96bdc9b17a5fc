"""Shared fixtures: run the ``titan`` CLI in a subprocess, install fixture plugins with pip."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.plugins.config_probes import ConfigProbe

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    # The Ctrl-C tests need Python's KeyboardInterrupt, here and in the runs they start: a suite
    # started with SIGINT ignored (nohup, a background job) passes the ignoring on to both.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def titan_env(**extra: str) -> dict[str, str]:
    """A child environment: JSON logs, no inherited plugin switches."""
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_DISABLE_PLUGINS",)}
    env["TITAN_LOG_FORMAT"] = "json"
    env.update(extra)
    return env


def run_titan(*args: str, cwd: Path | str | None = None, timeout: float = 300, **env: str):
    """Run ``python -m titan_core.cli ARGS``; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", "titan_core.cli", *args],
        cwd=cwd,
        env=titan_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def step_rows(stdout: str) -> list[dict]:
    """The per-step metric rows from JSON log lines."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == "step":
                rows.append(record)
    return rows


class LogWarnings:
    """Stands in for a module's structlog ``log``: records each ``warning`` as ``(event, fields)``
    and hands everything else to the real logger."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.records: list[tuple[str, dict]] = []

    @property
    def seen(self) -> list[str]:
        """The warnings' events (their messages)."""
        return [event for event, _ in self.records]

    def warning(self, event: str, **fields: object) -> None:
        self.records.append((event, fields))

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def record_warnings(monkeypatch: pytest.MonkeyPatch, *modules: types.ModuleType) -> LogWarnings:
    """One :class:`LogWarnings` put in place of the ``log`` of each of ``modules``."""
    recorder = LogWarnings(modules[0].log)
    for module in modules:
        monkeypatch.setattr(module, "log", recorder)
    return recorder


def pip_install(target: Path, *fixtures: str) -> Path:
    """Install the fixture plugins ``fixtures`` (folders of ``tests/fixtures``) really, with pip,
    into ``target`` (put it on PYTHONPATH); returns ``target``."""
    for name in fixtures:
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
                str(FIXTURES / name),
            ],
            check=True,
            capture_output=True,
        )
    return target


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where the fixture plugins are really installed by pip (put it on PYTHONPATH)."""
    return pip_install(
        tmp_path_factory.mktemp("site"),
        "titan_toy_plugin",
        "titan_broken_plugin",
        "titan_zloss_plugin",
        "titan_heavy_plugin",
    )


def tiny_llama3(dump_folder: Path | str, steps: int = 4) -> object:
    """The tiny Llama 3 config of one-process tests (2 blocks of dim 64, 32-token sequences)."""
    from titan_plugins_llama3.recipes import llama3_debugmodel

    config = llama3_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4}
    config.training.steps = steps
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.data.bundled_documents = 200
    config.job.dump_folder = str(dump_folder)
    config.metrics.enable_tensorboard = False
    return config


def assert_same_forward_backward(a: object, b: object, x: object, *args: object) -> None:
    """Two modules with the same parameters give the same output and the same gradients (of
    the input and of every parameter, in order) for ``module(x, *args)``."""
    import torch

    out_a, out_b = a(x, *args), b(x, *args)
    torch.testing.assert_close(out_a, out_b)
    grads_a = torch.autograd.grad(out_a.square().sum(), [x, *a.parameters()])
    grads_b = torch.autograd.grad(out_b.square().sum(), [x, *b.parameters()])
    for g_a, g_b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(g_a, g_b)


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a command wrote to stderr (no traceback): what a user sees of an error."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def saved_storage_bytes(module: object, *args: object, compiled: bool = False) -> int:
    """Bytes of the storages autograd keeps for backward over one ``module(*args)``; with
    ``compiled``, of ``torch.compile(module)`` after a first call that compiles it.

    Counted by storage, not by tensor: a saved view keeps its whole base alive (a slice of a fused
    projection holds the other slices too), which a count of the views' own sizes would miss."""
    import torch

    fn = torch.compile(module) if compiled else module
    if compiled:
        fn(*args)  # type: ignore[operator]
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)  # type: ignore[operator]
    return sum(storages.values())


def tiny_recipe_source(name: str, steps: int, extra: str = "") -> str:
    """A user recipe module (source text) defining ``name()``: the tiny Llama 3, ``steps`` steps."""
    return (
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n\n"
        f"def {name}():\n"
        "    c = llama3_debugmodel()\n"
        '    c.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4}\n'
        f"    c.training.steps, c.training.seq_len, c.training.local_batch_size = {steps}, 32, 2\n"
        "    c.data.bundled_documents, c.metrics.log_freq = 200, 1\n"
        f"{extra}"
        "    return c\n\n\n"
    )


def plugin_module(name: str, **hooks: object) -> types.ModuleType:
    """A third-party plugin module whose hook ``titan_<kind>`` returns exactly what is given
    (a list of records, or a wrong value to test how the registry takes it)."""
    from titan_core import hookimpl

    module = types.ModuleType(name)
    for hook, result in hooks.items():
        module.__dict__[hook] = hookimpl(lambda result=result: result)  # type: ignore[misc]
    return module


def recipe_record(name: str) -> object:
    """A ``Recipe`` record ``name`` that builds the default config."""
    from titan_core import Recipe, TrainerConfig

    return Recipe(name, TrainerConfig, "")


@pytest.fixture
def config_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> ConfigProbe:
    """``config_probe(settings, expected, base="llama3")``: set ``settings`` in a recipe built on
    ``base``, run ``--print-config`` and assert ``expected`` (``tests/plugins/config_probes.py``)."""
    from tests.plugins.config_probes import assert_probe, print_config

    def probe(settings: dict[str, str], expected: str | None, base: str = "llama3") -> None:
        assert_probe(*print_config(tmp_path, monkeypatch, capsys, settings, base), expected)

    return probe
