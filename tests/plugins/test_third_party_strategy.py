"""A third-party strategy plugin, installed by pip, changes the step and adds config and a command.

The fixture (tests/fixtures/titan_zloss_plugin) uses only titan's public contracts: a
``ConfigSection``, a ``Strategy`` wrapping ``ctx.loss_fn`` and a ``Command``; no core edit.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_titan, step_rows, tiny_recipe_source, titan_env

RECIPES = (
    tiny_recipe_source("base", 2)
    + tiny_recipe_source("with_z", 2, "    c.z_loss.weight = 0.01\n")
    + tiny_recipe_source("typo", 2, "    c.z_loss.wieght = 0.01\n")
    + tiny_recipe_source("negative", 2, "    c.z_loss.weight = -1.0\n")
)


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    (tmp_path / "zrecipes.py").write_text(RECIPES)
    return tmp_path


def test_config_section_is_shown_and_checked(plugin_site: Path, recipes: Path) -> None:
    env = {"PYTHONPATH": str(plugin_site)}
    shown = run_titan(
        "run", "--module", "zrecipes", "--recipe", "with_z", "--print-config", cwd=recipes, **env
    )
    assert shown.returncode == 0, shown.stderr
    assert "[z_loss]\nweight = 0.01" in shown.stdout
    typo = run_titan("run", "--module", "zrecipes", "--recipe", "typo", cwd=recipes, **env)
    assert typo.returncode == 2 and "z_loss.wieght: no such field; z_loss has weight" in typo.stderr
    negative = run_titan("run", "--module", "zrecipes", "--recipe", "negative", cwd=recipes, **env)
    assert negative.returncode == 2 and "z_loss.weight: expected a number >= 0, got -1.0" in negative.stderr
    missing = run_titan("run", "--module", "zrecipes", "--recipe", "with_z", cwd=recipes)
    assert missing.returncode == 2 and "z_loss: no config section of that name" in missing.stderr


@pytest.mark.slow
def test_strategy_changes_the_loss_by_the_z_term(plugin_site: Path, recipes: Path) -> None:
    env = {"PYTHONPATH": str(plugin_site)}
    plain = run_titan(
        "run", "--module", "zrecipes", "--recipe", "base", "--dump-folder", "a", cwd=recipes, **env
    )
    with_z = run_titan(
        "run", "--module", "zrecipes", "--recipe", "with_z", "--dump-folder", "b", cwd=recipes, **env
    )
    assert plain.returncode == 0 and with_z.returncode == 0, plain.stderr + with_z.stderr
    first_plain, first_z = step_rows(plain.stdout)[0], step_rows(with_z.stdout)[0]
    # Same weights at step 1; logsumexp of near-zero-mean logits is at least ln(vocab), and only
    # a little more at initialisation.
    floor = 0.01 * math.log(2048) ** 2
    assert floor * 0.95 < first_z["loss"] - first_plain["loss"] < floor * 1.3
    assert "z_loss" in next(r for r in _records(with_z.stdout) if r.get("event") == "built")["strategies"]


def test_plugin_command_is_listed_fast_and_runs(plugin_site: Path) -> None:
    titan = Path(sys.executable).parent / "titan"
    env = titan_env(PYTHONPATH=str(plugin_site), TITAN_DISABLE_PLUGINS="heavy")  # heavy imports torch
    # Fast means: listing commands imports no torch (timings belong in bench/, not in tests).
    probe = (
        "import sys\nfrom titan_core.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'"
    )
    top = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert top.returncode == 0 and "zloss-info" in top.stdout, top.stderr
    ran = subprocess.run(
        [str(titan), "zloss-info", "--weight", "0.5"], capture_output=True, text=True, env=env
    )
    assert ran.returncode == 0 and "z-loss weight 0.5" in ran.stdout


def _records(stdout: str) -> list[dict]:
    import json

    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
