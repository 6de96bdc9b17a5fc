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


@pytest.mark.parametrize("page", [page for page in DOC_PAGES if _modules_written(page)])
def test_a_pages_recipe_modules_have_names_no_other_page_gives_other_contents(page: str) -> None:
    """``my_recipes.py`` held checkpointing.md's recipes in one page and profiling.md's in
    another: a reader following both in one folder replaced the first (or ``titan recipes copy``
    refused the existing file); parallelism.md's ``my_recipes.py`` was profiling.md's too. Every
    page that has its reader write a module is checked."""
    mine = _modules_written(page)
    assert mine, page
    for other in DOC_PAGES:
        if other != page:
            assert not mine & _modules_written(other) - {"my_project/recipes.py"}, (page, other)


# -- what the docs name exists: commands and flags, config fields, links, modules, variables -----------


def _fenced_and_prose(page: str) -> tuple[list[str], str]:
    """The lines of a page's fenced blocks (a ``\\``-continued line joined to the next) and the
    text outside them."""
    blocks, prose, fence = [], [], None
    for line in (REPO / page).read_text().splitlines():
        if line.lstrip().startswith("```"):
            if fence is None:
                fence = []
            else:
                blocks += "\n".join(fence).replace("\\\n", " ").splitlines()
                fence = None
            continue
        (prose if fence is None else fence).append(line)
    return blocks, "\n".join(prose)


def _code(page: str) -> list[str]:
    """A page's code: its fenced blocks' lines and its inline code spans."""
    import re

    lines, prose = _fenced_and_prose(page)
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def _subcommands(parser: object) -> dict:
    import argparse

    for action in parser._actions:  # type: ignore[attr-defined]
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_titan_command_and_flag_the_docs_show_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command line of the docs (``titan ...``, ``python -m titan_core.train ...``,
    ``./run_train.sh ...``, in a fenced block or an inline span) names subcommands titan has and
    flags its parser takes (``run_train.sh`` passes its arguments to ``titan_core.train``, which
    are ``titan run``'s). Placeholders in capitals (``titan NAME``) and ``...`` are skipped."""
    import re

    from titan_core._registry import get_registry, reset_registry
    from titan_core.cli import build_parser

    monkeypatch.delenv("TITAN_DISABLE_PLUGINS", raising=False)
    reset_registry()
    parser = build_parser(get_registry())
    run = _subcommands(parser)["run"]
    command = re.compile(
        r"^(?:\$ )?(?:[A-Z_]+=\S* )*(titan|python -m titan_core\.train|\./run_train\.sh)(?: |$)([^#|;&]*)"
    )
    problems, checked = [], 0
    for page in DOC_PAGES:
        for line in _code(page):
            m = command.match(line.strip())
            if not m or ", " in m.group(2):  # a message quoting prose ("titan runs recipes (..., ...")
                continue
            checked += 1
            current, path = (parser, ["titan"]) if m.group(1) == "titan" else (run, ["run"])
            value_next = False
            for word in m.group(2).split():
                if value_next:
                    value_next = False
                elif word.startswith("-"):
                    flag = word.split("=")[0]
                    action = current._option_string_actions.get(flag) or parser._option_string_actions.get(
                        flag
                    )
                    if action is None:
                        problems.append(f"{page}: `{line.strip()}`: {' '.join(path)} has no {flag}")
                    else:
                        value_next = action.nargs not in (0, "?") and "=" not in word
                elif (subs := _subcommands(current)) and word != "..." and not word.isupper():
                    if word not in subs:
                        problems.append(f"{page}: `{line.strip()}`: {' '.join(path)} has no command {word!r}")
                        break
                    current = subs[word]
                    path.append(word)
    assert checked > 100, checked
    assert not problems, "\n".join(problems)


#: Names of the form ``section.name`` in the docs that are not config fields on purpose.
NOT_FIELDS = {
    "model.layers",  # the model's blocks (an nn.ModuleDict), not the config's model section
    "model.embed_tokens",  # a Hugging Face tensor's name (model.embed_tokens.weight)
    "training.stepz",  # reliability.md: a typo, to show its error
    "parallelism.typo",
    "debug.memory_reprot",
}


def test_every_config_field_the_docs_name_exists() -> None:
    """``training.lr``, ``config.float8.recipe``, ``model.overrides.document_mask``: the section
    and its field exist (plugin sections included; file names such as ``metrics.jsonl`` and
    ``model.py`` are not fields)."""
    import re

    fields = {s: v for s, v in to_dict(TrainerConfig()).items() if isinstance(v, dict)}
    files = r"(?:py|jsonl?|md|toml|txt|log|pickle|html|png|safetensors)\b"
    name = re.compile(
        rf"(?<![\w./-])(?:config\.)?({'|'.join(sorted(fields))})\.(?!{files})([A-Za-z_]\w*)(?![\w(/-])"
    )
    problems, checked = [], 0
    for page in DOC_PAGES:
        for m in name.finditer((REPO / page).read_text()):
            section, field = m.groups()
            checked += 1
            if field not in fields[section] and f"{section}.{field}" not in NOT_FIELDS:
                problems.append(f"{page}: {section}.{field} (sections' fields: docs/config.md)")
    assert checked > 500, checked
    assert not sorted(set(problems)), "\n".join(sorted(set(problems)))


def _anchors(page: str) -> set[str]:
    """The heading anchors of a page, as GitHub makes them."""
    import re

    seen: dict[str, int] = {}
    for line in _fenced_and_prose(page)[1].splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_every_link_of_the_docs_reaches_its_file_and_heading() -> None:
    import re

    problems = []
    for page in DOC_PAGES:
        prose = re.sub(r"`[^`]*`", "", _fenced_and_prose(page)[1])
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = ((REPO / page).parent / path).resolve() if path else REPO / page
            if not dest.exists():
                problems.append(f"{page}: ({target}): no such file")
            elif anchor and dest.suffix == ".md" and anchor not in set(_anchors(str(dest.relative_to(REPO)))):
                problems.append(f"{page}: ({target}): no such heading")
    assert not problems, "\n".join(problems)


def test_every_code_fence_is_closed_by_a_bare_fence() -> None:
    """A fence followed by text (```` ``` A source ````) does not close its block: the rest of the
    page renders as code."""
    problems = []
    for page in DOC_PAGES:
        opened = None
        for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                if opened is None:
                    opened = number
                elif line.strip() != "```":
                    problems.append(f"{page}:{number}: {line.strip()!r} closes the block of line {opened}")
                    opened = None
                else:
                    opened = None
        if opened is not None:
            problems.append(f"{page}:{opened}: a block never closed")
    assert not problems, "\n".join(problems)


def test_every_titan_module_attribute_and_file_the_docs_name_exists() -> None:
    """``titan_core.blocks.document_mask_rows`` imports; ``titan_core/parallelize.py``,
    ``tests/plugins/comm/test_fake.py`` and ``titan_plugins_llama3/plan.py`` (a package's file)
    are there."""
    import importlib
    import importlib.util
    import re

    problems = []
    for page in DOC_PAGES:
        text = (REPO / page).read_text()
        for dotted in sorted(set(re.findall(r"\b(titan_(?:core|plugins_\w+)(?:\.[A-Za-z_]\w*)+)", text))):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    problems.append(f"{page}: {dotted}: no {attr!r}")
                    break
                obj = getattr(obj, attr)
        paths = re.findall(r"`((?:titan_core|titan_plugins_\w+|plugins|tests|bench|docs)/[\w./*-]*)`", text)
        for path in sorted(set(paths)):
            path = path.split("::")[0]
            package = path.partition("/")[0]
            # A repository path, a test folder's (`plugins/profiler/`), or a distribution's package
            # file (`titan_plugins_llama3/plan.py` is titan_plugins_llama3/titan_plugins_llama3/plan.py).
            bases = [REPO, REPO / "tests", REPO / package, REPO / "plugins" / package]
            if not any(list(base.glob(path)) for base in bases):
                problems.append(f"{page}: {path}: no such file")
    assert not problems, "\n".join(problems)


def test_every_titan_environment_variable_the_docs_name_is_read() -> None:
    import re

    sources = [REPO / "run_train.sh"]
    for folder in ("titan_core", "titan_plugins_llama3", "titan_plugins_moe", "plugins", "bench"):
        sources += (REPO / folder).rglob("*.py")
    sources += (REPO / "bench").glob("*.sh")
    code = "\n".join(p.read_text() for p in sources)
    named = {
        v for page in DOC_PAGES for v in re.findall(r"\bTITAN_[A-Z][A-Z0-9_]*\b", (REPO / page).read_text())
    }
    assert named
    unread = sorted(v for v in named if v not in code)
    assert not unread, f"named in the docs, read nowhere in the code: {unread}"


def test_no_table_of_the_docs_is_cut_by_a_blank_line() -> None:
    """A blank line ends a Markdown table: the rows after it rendered as one paragraph of pipes
    (six places in reliability.md)."""
    cut = []
    for page in sorted((REPO / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        for i in range(1, len(lines) - 1):
            if not lines[i].strip() and lines[i - 1].startswith("|") and lines[i + 1].startswith("|"):
                cut.append(f"{page.name}:{i + 1}")
    assert not cut, cut


# -- every command that runs a recipe names one the page defines, and its config resolves -------------

#: Command lines whose recipe is not this page's to define (``(page, recipe)``), and why.
NOT_RUNNABLE_HERE = {
    ("docs/plugins.md", "my_recipe"): "a recipe of the plugin the page teaches to write",
    ("docs/getting_started.md", "llama3_9b"): "the page's example of an unknown recipe's error",
}
#: Modules a page has its reader make from a run's own folder, not from the page's text.
FROM_A_RUN_FOLDER = {"my_rerun"}


def _page_modules(page: str) -> dict[str, str]:
    """The recipe modules a page has its reader write (a python block headed by the file's name:
    ``# NAME.py`` or ``\"\"\"NAME.py: ...``), by file; several blocks of one file are one module."""
    import re
    import textwrap

    modules: dict[str, list[str]] = {}
    for block in map(textwrap.dedent, _python_blocks(page)):  # a block inside a list is indented
        if m := re.match(r'(?:# |""")([\w/]+\.py)\b', block.lstrip()):
            modules.setdefault(m.group(1), []).append(block)
    return {name: "\n\n".join(blocks) for name, blocks in modules.items()}


def _recipe_commands(page: str) -> list[tuple[str, list[str]]]:
    """The page's command lines that run or copy a recipe, each as ``titan`` arguments: ``titan
    run``, ``python -m titan_core.train`` and ``MODULE=M CONFIG=R ./run_train.sh`` (whose default
    recipe is ``llama3_debugmodel``) as ``run --recipe R [--module M]``, ``titan recipes copy``
    as it is."""
    import itertools
    import re
    import shlex

    command = re.compile(
        r"^(?:\$ )?((?:[A-Z_]+=\S* )*)"
        r"(titan run|python -m titan_core\.train|\./run_train\.sh|titan recipes copy)(?: |$)([^#|;&]*)"
    )
    found = []
    for line in _fenced_and_prose(page)[0]:
        m = command.match(line.strip())
        if not m:
            continue
        env = dict(word.split("=", 1) for word in m.group(1).split())
        words = shlex.split(m.group(3))
        if m.group(2) == "titan recipes copy":
            found.append((line.strip(), ["recipes", "copy", *words]))
            continue
        recipe, module = env.get("CONFIG"), env.get("MODULE")
        if m.group(2) == "./run_train.sh":
            recipe = recipe or "llama3_debugmodel"
        for flag, value in itertools.pairwise(words):
            if flag in ("--recipe", "--config"):
                recipe = value
            elif flag == "--module":
                module = value
        if recipe is None or recipe.isupper():  # a placeholder: `titan run --recipe R`
            continue
        found.append((line.strip(), ["run", "--recipe", recipe, *(["--module", module] if module else [])]))
    return found


@pytest.mark.parametrize("page", [page for page in DOC_PAGES if _recipe_commands(page)])
def test_every_command_of_a_page_runs_a_recipe_it_defines(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reader who writes a page's recipe modules into one folder can run each of its commands:
    the module exists, holds the recipe, and the recipe's config resolves (``--print-config``, no
    torch), in the page's order (``titan recipes copy`` first writes the module a later command
    runs). Checks what a typo or a renamed recipe would break, without training."""
    import importlib
    import sys

    from titan_core._registry import reset_registry
    from titan_core.cli import main

    monkeypatch.delenv("TITAN_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("FAKE_PP_RANK", raising=False)
    reset_registry()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    written = _page_modules(page)
    for name, source in written.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    modules = {name.removesuffix(".py").replace("/", ".") for name in written}
    importlib.invalidate_caches()
    problems, ran = [], 0
    try:
        for line, args in _recipe_commands(page):
            module = args[args.index("--module") + 1] if "--module" in args else None
            if (page, args[2]) in NOT_RUNNABLE_HERE or module in FROM_A_RUN_FOLDER:
                continue
            if args[0] == "recipes" and "/" in args[2]:  # a copy of a run folder: made by a run
                continue
            if module and module not in modules:
                problems.append(
                    f"`{line}`: the page writes no module {module!r} (it writes {sorted(modules)})"
                )
                continue
            code = main([*args, "--print-config"] if args[0] == "run" else args)
            err = capsys.readouterr().err
            ran += 1
            if code != 0:
                problems.append(f"`{line}`: exit {code}: {err.strip()[-500:]}")
            if args[0] == "recipes":
                modules.add(args[3].removesuffix(".py"))
                importlib.invalidate_caches()
    finally:
        for name in list(sys.modules):
            if name.partition(".")[0] in {m.partition(".")[0] for m in modules}:
                del sys.modules[name]
    assert not problems, "\n".join(problems)
