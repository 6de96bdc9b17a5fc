"""The docs keep up with the code: every config field and every hook is documented."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from tests.conftest import REPO
from titan_core import hookspecs
from titan_core.config import TrainerConfig, field_docs, to_dict


def test_every_config_field_is_in_config_md() -> None:
    text = (REPO / "docs" / "config.md").read_text()
    for section, fields in to_dict(TrainerConfig()).items():
        if isinstance(fields, dict):
            for name in fields:
                assert f"`{section}.{name}`" in text, f"{section}.{name}: run python docs/gen_config.py"


def test_config_md_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config", REPO / "docs" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs" / "config.md").read_text() == module.render(), "run python docs/gen_config.py"


def test_every_field_has_a_doc_comment() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config", REPO / "docs" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checked = 0
    for name, (cls, _) in module.sections().items():
        docs = field_docs(cls)
        for field in attrs.fields(cls):
            assert docs.get(field.name), f"{name}.{field.name} has no #: comment"
            checked += 1
    assert checked > 50


def test_every_hook_is_documented_and_listed() -> None:
    hooks = [name for name in hookspecs.__all__ if name.startswith("titan_")]
    text = (REPO / "docs" / "plugins.md").read_text()
    for name in hooks:
        assert getattr(hookspecs, name).__doc__, name
        assert f"`{name}`" in text, name


def _examples() -> list[tuple[str, str]]:
    """Each hook's docstring example that defines the hook itself (the complete ones)."""
    import inspect
    import textwrap

    found = []
    for name in hookspecs.__all__:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        for block in doc.split("::")[1:]:
            lines = []
            for line in block.splitlines()[1:]:
                if line.strip() and not line.startswith("    "):
                    break
                lines.append(line)
            code = textwrap.dedent("\n".join(lines))
            if f"def {name}(" in code:
                found.append((name, code))
    return found


def test_the_hook_examples_that_define_a_hook_run_and_their_records_build() -> None:
    """A plugin author copies these: the z-loss section's default once failed its own validator."""
    examples = _examples()
    assert {"titan_config_sections", "titan_callbacks", "titan_commands"} <= {n for n, _ in examples}
    for name, code in examples:
        namespace: dict = {}
        exec(compile(code, f"hookspecs.{name}", "exec"), namespace)
        records = namespace[name]()
        assert isinstance(records, list) and records, name
        for record in records:
            if name == "titan_config_sections":
                assert attrs.has(record.cls) and record.cls() is not None  # its defaults validate


# -- the docs' recipes, followed one page after another in one folder ---------------------------------

DOC_PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def _python_blocks(page: str) -> list[str]:
    text = (REPO / page).read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def _recipe(page: str, name: str) -> object:
    """Recipe ``name`` from the python block of ``page`` that defines it."""
    (block,) = [b for b in _python_blocks(page) if f"def {name}(" in b]
    namespace: dict = {}
    exec(compile(block, f"{page}:{name}", "exec"), namespace)
    return namespace[name]


def _modules_written(page: str) -> set[str]:
    """The recipe module files a page has its reader write: a python block headed by the file's
    name (``# NAME.py`` or a docstring ``\"\"\"NAME.py: ...``), and ``titan recipes copy X NAME.py``."""
    import re

    names = set()
    for block in _python_blocks(page):
        if m := re.match(r'(?:# |""")([\w/]+\.py)\b', block.lstrip()):
            names.add(m.group(1))
    names |= set(re.findall(r"titan recipes copy \S+ (\S+\.py)", (REPO / page).read_text()))
    return names


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md"])
def test_the_debug_recipe_runs_after_the_quickstart_in_one_folder(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``my_debug_recipe`` kept the quickstart's dump folder: run after it, it was refused as
    another run's outputs (it trains 4 steps, not 30)."""
    from titan_core.run_folder import RunFolder
    from titan_plugins_llama3.recipes import llama3_debugmodel

    monkeypatch.chdir(tmp_path)
    quickstart = llama3_debugmodel()
    Path(quickstart.job.dump_folder).mkdir(parents=True)
    RunFolder(quickstart, dp=1, overwrite=False, is_writer=True).claim(is_logging_rank=True)
    config = _recipe(page, "my_debug_recipe")()
    RunFolder(config, dp=1, overwrite=False, is_writer=True)  # refused: UsageError
    assert config.job.dump_folder != quickstart.job.dump_folder


def test_the_seed_examples_runs_keep_their_own_metrics() -> None:
    """The seed example's two runs from the seed shared ./outputs/seed: the second (another
    layout, the same run) replaced the first one's metrics.jsonl."""
    page = "docs/checkpointing.md"
    names = ("llama3_seed", "llama3_from_seed", "llama3_from_seed_fsdp2")
    folders = [_recipe(page, name)().job.dump_folder for name in names]
    assert len(set(folders)) == 3, folders


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md", "docs/checkpointing.md"])
def test_a_pages_recipe_modules_have_names_no_other_page_gives_other_contents(page: str) -> None:
    """``my_recipes.py`` held checkpointing.md's recipes in one page and profiling.md's in
    another: a reader following both in one folder replaced the first (or ``titan recipes copy``
    refused the existing file)."""
    mine = _modules_written(page)
    assert mine, page
    for other in DOC_PAGES:
        if other != page:
            assert not mine & _modules_written(other) - {"my_project/recipes.py"}, (page, other)
