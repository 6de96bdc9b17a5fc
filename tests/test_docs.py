"""The docs keep up with the code: every config field and every hook is documented."""

from __future__ import annotations

import attrs

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
