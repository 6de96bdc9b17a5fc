"""``checkpoint.initial_load_path`` sources that are damaged or hold non-finite weights: one error
saying what is wrong with the source, never a pickle traceback or a divergence blamed on the LR."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parallel_harness import run_titan_train, tiny_config, write_seed_checkpoint
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import train

_INITIAL = "checkpoint.initial_load_path"


def _config(folder: Path, **overrides: Any) -> Any:
    return tiny_config(**{"job.dump_folder": str(folder), "training.steps": 2, **overrides})


@pytest.fixture(scope="module")
def dcp_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run's DCP checkpoint ``step-1``."""
    folder = tmp_path_factory.mktemp("source")
    train(_config(folder, **{"training.steps": 1, "checkpoint.enable": True}), get_registry())
    return folder / "checkpoint" / "step-1"


def _foreign_copy(step: Path, to: Path) -> Path:
    """The DCP folder without titan's meta.json: another tool's checkpoint, which titan's
    checkpointer does not judge (``Checkpointer.verify`` says nothing of it)."""
    shutil.copytree(step, to)
    os.remove(to / "meta.json")
    return to


def test_a_dcp_folder_whose_metadata_is_damaged_is_one_error(dcp_step: Path, tmp_path: Path) -> None:
    """It was an UnpicklingError traceback ("pickle data was truncated")."""
    folder = _foreign_copy(dcp_step, tmp_path / "foreign")
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError) as info:
        train(_config(tmp_path / "run", **{_INITIAL: str(folder)}), get_registry())
    message = str(info.value)
    assert message.startswith(f"{_INITIAL}: {str(folder)!r}")
    assert ".metadata cannot be read" in message and "truncated or damaged" in message


def test_a_dcp_folder_whose_data_is_truncated_says_so_not_another_model(
    dcp_step: Path, tmp_path: Path
) -> None:
    """The shapes were checked and fit: "was it saved from the same model and flavor?" sent the
    user after the recipe while a data file was cut short."""
    folder = _foreign_copy(dcp_step, tmp_path / "foreign")
    data = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(UsageError) as info:
        train(_config(tmp_path / "run", **{_INITIAL: str(folder)}), get_registry())
    message = str(info.value)
    assert "reading its tensors failed" in message and "truncated or damaged" in message
    assert "same model and flavor" not in message


def _with_nan(source: Path, to: Path) -> str:
    state = torch.load(source, weights_only=True)
    name = sorted(k for k in state if k.startswith("layers.1.") and k.endswith("weight"))[0]
    state[name].view(-1)[3] = float("nan")
    torch.save(state, to)
    return name


def test_initial_weights_holding_nan_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    """They trained, and step 1 stopped as a divergence: ``Lower training.lr, check the data``."""
    name = _with_nan(write_seed_checkpoint(tmp_path / "seed.pt"), tmp_path / "nan.pt")
    with pytest.raises(UsageError) as info:
        train(_config(tmp_path / "run", **{_INITIAL: str(tmp_path / "nan.pt")}), get_registry())
    message = str(info.value)
    assert message.startswith(f"{_INITIAL}: {str(tmp_path / 'nan.pt')!r}")
    assert f"non-finite values (NaN or inf) in {name}" in message
    assert "training.lr" not in message
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or not (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    )


def test_finite_initial_weights_load_as_before(tmp_path: Path) -> None:
    seed = write_seed_checkpoint(tmp_path / "seed.pt")
    rows = train(_config(tmp_path / "run", **{_INITIAL: str(seed)}), get_registry())
    assert [int(r["step"]) for r in rows] == [1, 2]


def test_nan_initial_weights_on_one_rank_of_two_stop_both(tmp_path: Path) -> None:
    """FSDP over 2 processes: the NaN lies in one rank's shard only; both refuse it (exit 2), as
    one, instead of one raising while the other waits in step 1's collectives."""
    name = _with_nan(write_seed_checkpoint(tmp_path / "seed.pt"), tmp_path / "nan.pt")
    result = run_titan_train(
        tmp_path / "two",
        2,
        {_INITIAL: str(tmp_path / "nan.pt"), "parallelism.dp_shard": 2},
        timeout=240,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    out = result.stdout + result.stderr
    # Both ranks' error (their lines share the pipes; torchrun's report repeats each rank's).
    assert out.count(f"holds non-finite values (NaN or inf) in {name}") >= 2, out[-4000:]
    assert "non-finite (NaN or inf) at step 1" not in out


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "meta.json"])
def test_a_file_of_a_dcp_checkpoint_names_its_folder(dcp_step: Path, tmp_path: Path, name: str) -> None:
    """It was ``cannot be read as a torch.save file of tensors (...)``, the folder to give unsaid."""
    with pytest.raises(UsageError) as info:
        train(_config(tmp_path, **{_INITIAL: str(dcp_step / name)}), get_registry())
    message = str(info.value)
    assert f"is a file of the DCP checkpoint {str(dcp_step)!r}; give that folder" in message
