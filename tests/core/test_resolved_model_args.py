"""Two spellings of one model compare equal on a resume (and in ``titan export``): a model that
declares ``ModelSpec.resolve_args`` has its arguments compared as it reads them, so a checkpoint
saved with ``n_kv_heads = None`` ("as many as n_heads") resumes under ``n_kv_heads = n_heads``
and the reverse, while a real change (``n_kv_heads = 2``) is still refused. Checked with a
third-party model plugin, as any plugin would declare it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.parallel_harness import tiny_config
from titan_core import ModelSpec, hookimpl
from titan_core._registry import Registry
from titan_core.errors import UsageError
from titan_core.resume import model_changes
from titan_core.trainer import Trainer, train


@dataclasses.dataclass(frozen=True)
class Args:
    dim: int = 8
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads
    window: int | None = None  # None: no sliding window, as a window of max_len
    max_len: int = 64


def _resolve(args: Args) -> Args:
    return dataclasses.replace(
        args, n_kv_heads=args.n_kv_heads or args.n_heads, window=args.window or args.max_len
    )


def _spec(**kw: Any) -> ModelSpec:
    return ModelSpec(
        "toy",
        {"small": Args()},
        build=lambda a: None,
        num_params=lambda a, e: 0,
        flops_per_token=lambda a, s: 0.0,
        **kw,
    )


def _record(**overrides: Any) -> dict[str, Any]:
    return {"name": "toy", "flavor": "small", "overrides": overrides}


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ({}, {"n_kv_heads": 4}),
        ({"n_kv_heads": 4}, {"n_kv_heads": None}),
        ({"window": 64}, {}),
        ({"n_kv_heads": None, "window": None}, {"n_kv_heads": 4, "window": 64}),
    ],
)
def test_arguments_of_the_same_meaning_are_the_same_model(saved: dict, now: dict) -> None:
    assert model_changes(_spec(resolve_args=_resolve), _record(**saved), _record(**now)) == []


def test_a_real_change_is_still_named_as_the_model_reads_it() -> None:
    changes = model_changes(_spec(resolve_args=_resolve), _record(), _record(n_kv_heads=2))
    assert changes and "n_kv_heads: 4 -> 2" in changes[-1], changes
    # Without the declaration the arguments are compared as given: another spelling differs.
    assert model_changes(_spec(), _record(), _record(n_kv_heads=4))


def test_resolve_args_must_be_a_function() -> None:
    with pytest.raises(TypeError, match=r"ModelSpec\.resolve_args: expected a function"):
        _spec(resolve_args="n_kv_heads")


# -- through a resume, with a plugin model built on Llama 3 -----------------------------------------


def _registry() -> Registry:
    registry = Registry().load_entry_points()
    llama3 = registry.get("models", "llama3")

    class Resolving:
        @hookimpl
        def titan_models(self) -> list:
            return [
                attrs.evolve(
                    llama3,
                    name="resolving",
                    resolve_args=lambda a: attrs.evolve(a, n_kv_heads=a.n_kv_heads or a.n_heads),
                )
            ]

    registry.register(Resolving(), "resolving")
    return registry


def _config(folder: Path, n_kv_heads: int | None, steps: int) -> Any:
    config = tiny_config(
        **{"job.dump_folder": str(folder), "checkpoint.enable": True, "debug.max_steps": steps}
    )
    config.model.name = "resolving"
    # None is the flavor's own value (an override cannot be None): left out of the overrides.
    overrides = {k: v for k, v in config.model.overrides.items() if k != "n_kv_heads"}
    config.model.overrides = overrides if n_kv_heads is None else {**overrides, "n_kv_heads": n_kv_heads}
    return config


@pytest.mark.parametrize(("saved", "now"), [(None, 4), (4, None)])
def test_a_resume_under_another_spelling_of_the_model_goes_on(
    tmp_path: Path, saved: int | None, now: int | None
) -> None:
    registry = _registry()
    whole = {int(r["step"]): r for r in train(_config(tmp_path / "whole", saved, 5), registry)}
    train(_config(tmp_path / "run", saved, 3), registry)
    resumed = {int(r["step"]): r for r in train(_config(tmp_path / "run", now, 5), registry)}
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5)


def test_a_resume_under_another_number_of_kv_heads_is_still_refused(tmp_path: Path) -> None:
    registry = _registry()
    train(_config(tmp_path, None, 3), registry)
    with pytest.raises(UsageError, match=r"does not fit the model: .*attention\.wk\.weight"):
        Trainer(_config(tmp_path, 2, 5), registry)


def test_a_seed_checkpoint_of_another_spelling_of_the_model_is_taken_over(tmp_path: Path) -> None:
    """The dump folder's record (run.json) compared the models as written: a seed checkpoint
    saved with n_kv_heads None was "a seed checkpoint of another model" to a run with
    n_kv_heads = n_heads, though the checkpoint itself loads."""
    registry = _registry()
    seed = _config(tmp_path, None, 1)
    seed.checkpoint.enable = False
    seed.checkpoint.create_seed_checkpoint = True
    train(seed, registry)
    rows = {int(r["step"]): r for r in train(_config(tmp_path, 4, 2), registry)}
    assert sorted(rows) == [1, 2]
    fresh = {int(r["step"]): r for r in train(_config(tmp_path / "fresh", None, 2), registry)}
    assert rows[2]["loss"] == pytest.approx(fresh[2]["loss"], rel=1e-5)  # from the seed's weights


def test_a_rerun_under_another_spelling_of_the_model_is_the_same_run(tmp_path: Path) -> None:
    registry = _registry()
    first = _config(tmp_path, None, 2)
    first.checkpoint.enable = False
    train(first, registry)
    again = _config(tmp_path, 4, 2)
    again.checkpoint.enable = False
    assert sorted(int(r["step"]) for r in train(again, registry)) == [1, 2]  # started over, not refused
