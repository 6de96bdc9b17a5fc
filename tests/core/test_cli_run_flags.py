"""``titan run`` flags given twice: argparse keeps the last value, so ``--module a ... --module b``
(a wrapper's flag and the user's) ran another recipe than one of them asked for without a word."""

from __future__ import annotations

import pytest

from tests.conftest import run_titan


@pytest.mark.parametrize(
    ("first", "second", "fragments"),
    [
        (["--module", "my_recipes"], ["--module=other_recipes"], ("--module", "my_recipes", "other_recipes")),
        (
            ["--config", "llama3_debugmodel"],
            ["--recipe", "other"],
            ("--recipe", "llama3_debugmodel", "other"),
        ),
        (["--comm-backend", "default"], ["--comm-backend", "fake"], ("--comm-backend", "default", "fake")),
        (["--dump-folder", "out/a"], ["--dump-folder", "out/b"], ("--dump-folder", "out/a", "out/b")),
        (["--print-config", "json"], ["--print-config"], ("--print-config", "json", "toml")),
    ],
)
def test_a_flag_given_twice_with_two_values_is_refused(
    first: list[str], second: list[str], fragments: tuple[str, ...]
) -> None:
    args = ["run", *first, *second]
    if "--config" not in first and "--recipe" not in second:
        args += ["--recipe", "llama3_debugmodel"]
    if "--print-config" not in first:
        args += ["--print-config"]
    result = run_titan(*args)
    assert result.returncode == 2, result.stdout[-500:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("titan: error: ") and "given twice" in lines[0], lines[0]
    for fragment in fragments:
        assert repr(fragment) in lines[0] or fragment in lines[0], lines[0]
    assert "[model]" not in result.stdout  # nothing printed


def test_a_flag_given_twice_with_one_value_is_one_choice() -> None:
    result = run_titan(
        "run",
        "--config",
        "llama3_debugmodel",
        "--recipe=llama3_debugmodel",
        "--print-config",
        "json",
        "--print-config=json",
    )
    assert result.returncode == 0, result.stderr
    assert '"model"' in result.stdout
