"""``checkpoint.initial_load_path`` through the trainer: which sources need the checkpointer, and
path fields left blank (an unset variable in a recipe) refused instead of read as unset."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import tiny_config, write_seed_checkpoint
from titan_core._registry import Registry, get_registry
from titan_core.config import ConfigError, TrainerConfig, from_dict, to_dict
from titan_core.errors import UsageError
from titan_core.trainer import train

_INITIAL = "checkpoint.initial_load_path"


def _config(folder: Path, **overrides: Any) -> Any:
    return tiny_config(**{"job.dump_folder": str(folder), "training.steps": 1, **overrides})


def _without_dcp() -> Registry:
    """The plugins as ``--disable-plugin dcp`` loads them: no checkpointer named ``dcp``."""
    return Registry(disabled={"dcp"}).load_entry_points()


# -- sources that need no checkpointer ---------------------------------------------------------


def test_a_pt_file_loads_with_checkpointing_off_and_the_checkpointer_absent(tmp_path: Path) -> None:
    """It failed with ``unknown checkpoint.backend 'dcp'; known: (none)``: the backend was looked up
    before the path was seen to be a file, which no checkpointer wrote or vouches for."""
    seed = write_seed_checkpoint(tmp_path / "seed.pt")
    rows = train(_config(tmp_path / "run", **{_INITIAL: str(seed)}), _without_dcp())
    assert [int(r["step"]) for r in rows] == [1]


def test_a_pt_file_loads_beside_a_third_party_backend_that_is_not_installed(tmp_path: Path) -> None:
    seed = write_seed_checkpoint(tmp_path / "seed.pt")
    config = _config(tmp_path / "run", **{_INITIAL: str(seed), "checkpoint.backend": "somebody_elses"})
    rows = train(config, get_registry())
    assert [int(r["step"]) for r in rows] == [1]


def test_a_hugging_face_folder_loads_with_the_checkpointer_absent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.hf.conftest import TITAN_OVERRIDES, save_hf

    save_hf(tmp_path / "hf")
    config = _config(tmp_path / "run", **{_INITIAL: str(tmp_path / "hf"), "model.overrides": TITAN_OVERRIDES})
    rows = train(config, _without_dcp())
    assert [int(r["step"]) for r in rows] == [1]


@pytest.fixture(scope="module")
def dcp_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run's DCP checkpoint ``step-1`` (titan's, with its meta.json)."""
    folder = tmp_path_factory.mktemp("source")
    train(_config(folder, **{"checkpoint.enable": True}), get_registry())
    return folder / "checkpoint" / "step-1"


def test_a_checkpoint_folder_without_its_checkpointer_says_why_the_backend_is_needed(
    dcp_step: Path, tmp_path: Path
) -> None:
    """A checkpoint folder is checked by the checkpointer before it is loaded (a damaged save
    would load without a word); without it the error says so, not only ``unknown backend``."""
    copy = tmp_path / "step-1"
    shutil.copytree(dcp_step, copy)
    with pytest.raises(UsageError) as info:
        train(_config(tmp_path / "run", **{_INITIAL: str(copy)}), _without_dcp())
    message = str(info.value)
    assert message.startswith(f"{_INITIAL}: {str(copy)!r} is a DCP checkpoint folder")
    assert "checkpoint.backend 'dcp'" in message and "unknown checkpoint.backend 'dcp'" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_checkpoint_folder_still_loads_through_its_checkpointer(dcp_step: Path, tmp_path: Path) -> None:
    rows = train(_config(tmp_path / "run", **{_INITIAL: str(dcp_step)}), get_registry())
    assert [int(r["step"]) for r in rows] == [1]


# -- blank paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_initial_load_path_is_refused_not_a_run_from_scratch(blank: str) -> None:
    """``os.environ.get("INIT", "")`` in a recipe trained from freshly initialised weights, as
    if the field were unset, without a word."""
    config = TrainerConfig()
    with pytest.raises(ConfigError) as info:
        config.checkpoint.initial_load_path = blank
    message = str(info.value)
    assert f"{_INITIAL}: {blank!r} is empty" in message
    assert "None" in message  # how to leave it unset
    config.checkpoint.initial_load_path = None  # unset: fine


#: The core's path fields (``titan_core.config.local_path``).
CORE_PATH_FIELDS = [
    "job.dump_folder",
    "data.path",
    "data.tokenizer_path",
    "validation.path",
    "metrics.save_tb_folder",
    "checkpoint.folder",
    "checkpoint.initial_load_path",
]


@pytest.mark.parametrize("field", CORE_PATH_FIELDS)
def test_every_core_path_field_refuses_a_blank_value_naming_it(field: str) -> None:
    """A blank path was read as unset (data.path, validation.path: the training data, unsaid), as
    the current folder (metrics.save_tb_folder: event files among the run's logs), or failed later
    in another words (job.dump_folder: ``cannot create ''``). One rule for all of them, from a
    recipe or a TOML file alike."""
    section, name = field.split(".")
    data = to_dict(TrainerConfig())
    data[section][name] = " "
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert f"{field}: ' ' is empty" in str(info.value)


@pytest.mark.parametrize("field", CORE_PATH_FIELDS)
def test_every_core_path_field_refuses_a_nul_character_naming_it(field: str) -> None:
    """No file name holds a NUL: ``job.dump_folder = "out\\x00"`` passed ``--print-config`` and
    the run ended in a 41-line ``ValueError: embedded null byte`` traceback."""
    section, name = field.split(".")
    data = to_dict(TrainerConfig())
    data[section][name] = "out\x00put"
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert f"{field}: 'out\\x00put' holds a NUL character" in str(info.value)
