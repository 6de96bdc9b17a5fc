"""The fake backends' launch contract: every violation is one message naming the variable, its
value, the valid range and the fix, raised before any process group or model exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_titan
from titan_core import get_registry
from titan_core.errors import UsageError
from titan_core.run import refuse_unread_env
from titan_plugins_comm.contract import hybrid_launch, pure_fake_launch


def test_logical_rank_is_pp_rank_times_spmd_size() -> None:
    launch = pure_fake_launch(2, {"NGPU": "4", "FAKE_PP_RANK": "1"})
    assert (launch.logical_rank, launch.spmd_size, launch.pp_line) == (2, 2, [0, 2])
    assert pure_fake_launch(4, {"NGPU": "64", "FAKE_PP_RANK": "3"}).logical_rank == 48
    assert pure_fake_launch(1, {"NGPU": "8"}).logical_rank == 0  # without PP: rank zero
    hybrid = hybrid_launch(2, {"NGPU": "64", "RANK": "1", "WORLD_SIZE": "2"})
    assert (hybrid.pp_rank, hybrid.logical_rank) == (1, 32)


@pytest.mark.parametrize(
    ("pp", "env", "expected"),
    [
        (2, {}, ["NGPU is not set", "divisible by parallelism.pp=2", "NGPU=8"]),
        (1, {"NGPU": "four"}, ["NGPU='four' is not a positive integer"]),
        (1, {"NGPU": "0"}, ["NGPU='0' is not a positive integer"]),
        (1, {"NGPU": "1_6"}, ["NGPU='1_6' is not a positive integer"]),  # Python's int() takes it
        (4, {"NGPU": "6", "FAKE_PP_RANK": "0"}, ["NGPU=6 is not divisible", "parallelism.pp=4", "4 or 8"]),
        (2, {"NGPU": "4"}, ["FAKE_PP_RANK is not set", "one of 0..1", "--all-pp-ranks"]),
        (2, {"NGPU": "4", "FAKE_PP_RANK": "2"}, ["FAKE_PP_RANK=2 is out of range", "0..1"]),
        (2, {"NGPU": "4", "FAKE_PP_RANK": "-1"}, ["FAKE_PP_RANK=-1 is out of range"]),
        (2, {"NGPU": "4", "FAKE_PP_RANK": "x"}, ["FAKE_PP_RANK='x' is not an integer", "0..1"]),
        (1, {"NGPU": "4", "FAKE_PP_RANK": "1"}, ["FAKE_PP_RANK=1 is out of range", "unset it"]),
    ],
)
def test_pure_fake_contract_errors(pp: int, env: dict[str, str], expected: list[str]) -> None:
    with pytest.raises(UsageError) as info:
        pure_fake_launch(pp, env)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message
    assert "docs/debugging.md" in message


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("value", ["", "  "])
def test_a_set_but_empty_fake_pp_rank_is_one_error_naming_it(pp: int, value: str) -> None:
    """Outside run_train.sh (which refuses it), ``FAKE_PP_RANK=""`` read as unset: with PP the
    error said "FAKE_PP_RANK is not set", and without PP the run went on as rank 0, unsaid."""
    with pytest.raises(UsageError) as info:
        pure_fake_launch(pp, {"NGPU": "4", "FAKE_PP_RANK": value})
    message = str(info.value)
    assert message.startswith(f"FAKE_PP_RANK is set but empty ({value!r})"), message
    assert "is not set" not in message and "unset it" in message and "docs/debugging.md" in message


@pytest.mark.parametrize("value", ["", "  "])
def test_a_set_but_empty_fake_pp_rank_is_refused_by_the_hybrid_backend_too(value: str) -> None:
    """real_pp_fake_spmd takes no FAKE_PP_RANK; set empty, run_train.sh refuses it, and so does
    the backend itself."""
    with pytest.raises(UsageError) as info:
        hybrid_launch(2, {"NGPU": "4", "FAKE_PP_RANK": value, "RANK": "0", "WORLD_SIZE": "2"})
    assert str(info.value).startswith(f"FAKE_PP_RANK={value!r} is set, but real_pp_fake_spmd")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"NGPU": "4", "FAKE_PP_RANK": "1", "RANK": "0", "WORLD_SIZE": "2"},
            ["FAKE_PP_RANK='1' is set", "torchrun's RANK", "Unset FAKE_PP_RANK"],
        ),
        ({"NGPU": "4", "RANK": "0", "WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "must equal parallelism.pp=2"]),
        ({"NGPU": "4", "RANK": "0", "WORLD_SIZE": "1"}, ["WORLD_SIZE=1", "--nproc_per_node=2"]),
        ({"NGPU": "4"}, ["WORLD_SIZE/RANK are not set", "torchrun --nproc_per_node=2"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["NGPU is not set"]),
        ({"NGPU": "5", "RANK": "0", "WORLD_SIZE": "2"}, ["NGPU=5 is not divisible"]),
    ],
)
def test_hybrid_contract_errors(env: dict[str, str], expected: list[str]) -> None:
    with pytest.raises(UsageError) as info:
        hybrid_launch(2, env)
    for fragment in expected:
        assert fragment in str(info.value)


RECIPES = """
from titan_plugins_llama3.recipes import llama3_debugmodel

def pp2():
    config = llama3_debugmodel()
    config.parallelism.pp = 2
    config.parallelism.dp_shard = 2
    return config
"""


@pytest.mark.parametrize(
    ("backend", "env", "fragment"),
    [
        ("fake", {"NGPU": "4"}, "FAKE_PP_RANK is not set"),
        ("fake", {"NGPU": "3", "FAKE_PP_RANK": "0"}, "NGPU=3 is not divisible"),
        ("real_pp_fake_spmd", {"NGPU": "4", "RANK": "0", "WORLD_SIZE": "3"}, "WORLD_SIZE=3"),
        (
            "real_pp_fake_spmd",
            {"NGPU": "4", "FAKE_PP_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"},
            "FAKE_PP_RANK",
        ),
    ],
)
def test_cli_reports_contract_errors_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, env: dict[str, str], fragment: str
) -> None:
    (tmp_path / "contract_recipes.py").write_text(RECIPES)
    monkeypatch.delenv("FAKE_PP_RANK", raising=False)  # set empty, it is an error of its own
    clean = {"NGPU": "", "RANK": "", "WORLD_SIZE": "", **env}
    result = run_titan(
        "run",
        "--module",
        "contract_recipes",
        "--recipe",
        "pp2",
        "--comm-backend",
        backend,
        cwd=tmp_path,
        **clean,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titan: error:") and fragment in lines[0], result.stderr
    assert '"event": "built"' not in result.stdout  # nothing was built


def test_fake_pp_rank_without_the_fake_backend_is_one_error(tmp_path: Path) -> None:
    """The outside review's case: the default backend would train a normal job and ignore it.
    Refused under --print-config too, which run_train.sh's launch check resolves first."""
    for extra in ((), ("--print-config",)):
        result = run_titan(
            "run",
            "--recipe",
            "llama3_debugmodel",
            "--dump-folder",
            str(tmp_path / "out"),
            *extra,
            FAKE_PP_RANK="1",
            NGPU="",
            TITAN_DEFAULT_MAX_STEPS="1",  # bounds the run the bug would start
        )
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, result.stderr
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("titan: error: FAKE_PP_RANK='1' is set, but comm backend 'default'")
        for fragment in ("--comm-backend fake", "COMM_BACKEND=fake", "unset FAKE_PP_RANK"):
            assert fragment in lines[0], lines[0]
        assert '"event": "step"' not in result.stdout  # refused before training
        assert not (tmp_path / "out").exists()  # and before the dump folder


@pytest.mark.parametrize(
    ("backend", "env", "refused"),
    [
        ("default", {"FAKE_PP_RANK": " 0 "}, True),
        ("default", {}, False),
        ("default", {"FAKE_PP_RANK": ""}, False),  # run_train.sh and test harnesses export it empty
        ("default", {"FAKE_PP_RANK": "  ", "NGPU": "2"}, False),  # NGPU is every backend's (run_train.sh)
        ("fake", {"FAKE_PP_RANK": "1"}, False),  # its own variable: checked by pure_fake_launch
        ("real_pp_fake_spmd", {"FAKE_PP_RANK": "1"}, False),  # refused by hybrid_launch, more precisely
    ],
)
def test_the_fake_backends_declare_fake_pp_rank(backend: str, env: dict[str, str], refused: bool) -> None:
    """Both fake backends list FAKE_PP_RANK in ``CommBackend.env_vars``; the core refuses it for
    any other backend (tests/core/test_comm_env.py tests the rule with a third party's backend)."""
    if not refused:
        refuse_unread_env(get_registry(), backend, env)
        return
    with pytest.raises(UsageError) as info:
        refuse_unread_env(get_registry(), backend, env)
    assert f"comm backend {backend!r}" in str(info.value) and "docs/debugging.md" in str(info.value)
    assert "only 'fake', 'real_pp_fake_spmd' do" in str(info.value)


def test_hybrid_advice_for_a_layout_larger_than_the_pipeline_is_torchrun_only() -> None:
    """run_train.sh's NGPU is both the processes and the job's ranks: for a PP 2 x FSDP 2 job it
    cannot launch hybrid mode, so the error must not send the user there (and back)."""
    from titan_plugins_comm.contract import hybrid_launch_check
    from titan_plugins_llama3.recipes import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.pp, config.parallelism.dp_shard = 2, 2
    with pytest.raises(UsageError) as info:
        hybrid_launch_check(config, 4)
    message = str(info.value)
    assert (
        "the layout needs more than 2 ranks, so launch with torchrun: "
        "NGPU=<the job's ranks> torchrun --nproc_per_node=2" in message
    )
    assert "run_train.sh NGPU=2" not in message
    config.parallelism.dp_shard = -1  # fits any world size: a 2-rank job through run_train.sh works
    with pytest.raises(UsageError, match=r"through run_train.sh NGPU=2 \(a job of 2 ranks\)"):
        hybrid_launch_check(config, 4)
