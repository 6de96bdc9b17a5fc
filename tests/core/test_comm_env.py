"""``CommBackend.env_vars``: a variable only other comm backends read, set for a run whose backend
would ignore it, is one error before anything starts (``titan_core.run.refuse_unread_env``);
``CommBackend.sets``; and ``CommBackend.launch_check`` (``titan_core.run.check_launch``). The
fake backends' own declarations are tested with them (``tests/plugins/comm/test_contract.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import plugin_module
from titan_core import CommBackend
from titan_core._registry import Registry
from titan_core.errors import UsageError
from titan_core.run import refuse_unread_env


def _registry(*backends: CommBackend) -> Registry:
    registry = Registry()
    registry.register(
        plugin_module("core", titan_comm_backends=[CommBackend("default", lambda c: None)]), "core"
    )
    registry.register(plugin_module("third", titan_comm_backends=list(backends)), "third")
    return registry


def test_a_third_party_backends_variable_is_refused_for_another_backend() -> None:
    registry = _registry(
        CommBackend("sim", lambda c: None, env_vars=("SIM_RANK", "SIM_WORLD")),
        CommBackend("sim2", lambda c: None, env_vars=("SIM_RANK",)),
    )
    with pytest.raises(UsageError) as info:
        refuse_unread_env(registry, "default", {"SIM_WORLD": "8"})
    message = str(info.value)
    assert message.startswith(
        "SIM_WORLD='8' is set, but comm backend 'default' does not read it (only 'sim' does)"
    )
    assert (
        "--comm-backend sim, COMM_BACKEND=sim with run_train.sh" in message and "unset SIM_WORLD" in message
    )
    with pytest.raises(UsageError, match=r"SIM_RANK='0' .* \(only 'sim', 'sim2' do\)"):
        refuse_unread_env(registry, "Default", {"SIM_RANK": "0"})
    # A backend that declares it reads it; blank is unset; undeclared variables are nobody's.
    refuse_unread_env(registry, "sim2", {"SIM_RANK": "3"})
    refuse_unread_env(registry, "default", {"SIM_RANK": "  ", "SIM_WORLD": "", "NGPU": "2"})
    with pytest.raises(UsageError, match="SIM_WORLD='8'"):
        refuse_unread_env(registry, "sim2", {"SIM_RANK": "3", "SIM_WORLD": "8"})


def test_env_vars_must_be_names() -> None:
    with pytest.raises(TypeError, match="expected a tuple of variable names, got 'SIM_RANK'"):
        CommBackend("sim", lambda c: None, env_vars="SIM_RANK")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="variable names"):
        CommBackend("sim", lambda c: None, env_vars=("",))


def test_a_backends_settings_are_applied_and_a_wrong_path_names_its_plugin() -> None:
    """``CommBackend.sets``: what every run of the backend has, set before validation (so
    ``--print-config`` shows it); a path that is no config field is the plugin's bug."""
    from titan_core.config import TrainerConfig
    from titan_core.errors import PluginError
    from titan_core.run import apply_backend_settings

    registry = _registry(
        CommBackend("sizer", lambda c: None, sets={"debug.memory_report": True, "training.steps": 3}),
        CommBackend("broken", lambda c: None, sets={"debug.memory_reprot": True}),
    )
    config = TrainerConfig()
    config.comm.backend = "sizer"
    apply_backend_settings(config, registry)
    assert config.debug.memory_report is True and config.training.steps == 3
    config = TrainerConfig()
    apply_backend_settings(config, registry)  # the default backend sets nothing
    assert config.debug.memory_report is False
    config.comm.backend = "broken"
    with pytest.raises(
        PluginError,
        match=r"backend .broken. sets .debug.memory_reprot., which is not a config field; plugin 'third'",
    ):
        apply_backend_settings(config, registry)


def test_a_third_party_backends_launch_check_runs_before_init_with_the_launched_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer calls the selected backend's ``launch_check(config, WORLD_SIZE)`` before its
    ``init``; ``check_launch`` (what ``run_train.sh`` calls with NGPU) does the same."""
    from tests.conftest import tiny_llama3
    from titan_core.run import check_launch
    from titan_core.trainer import Trainer

    calls: list[tuple[str, int]] = []

    def refuse_many(config: object, processes: int) -> None:
        calls.append(("check", processes))
        if processes > 2:
            raise UsageError(f"sim runs at most 2 processes, not {processes}")

    def init(config: object) -> None:
        calls.append(("init", 0))
        raise RuntimeError("init must not run after a refused launch")

    registry = _registry(CommBackend("sim", init, launch_check=refuse_many))
    config = tiny_llama3(tmp_path, steps=1)
    config.comm.backend = "sim"
    check_launch(config, registry, 2)
    with pytest.raises(UsageError, match="sim runs at most 2 processes, not 3"):
        check_launch(config, registry, 3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match="not 4"):
        Trainer(config, registry)
    assert calls == [("check", 2), ("check", 3), ("check", 4)]
    config.comm.backend = "default"
    check_launch(config, registry, 4)  # a backend without a launch check accepts any launch
