"""What a third-party plugin gets wrong is found where it is returned, named by plugin and
distribution, and never takes down runs that do not use it, nor the core's own commands.

Each case here was found by writing plugins from the outside (docs/plugins.md): section classes
with string annotations or without defaults, checks that raise or return ``None``, strategy
records of the wrong types, ``apply`` returning nothing, callbacks raising in the loop, command
names and run-option flags two plugins (or a plugin and the core) share, a core field whose
implementing plugin is missing.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest

from tests.conftest import plugin_module, tiny_llama3
from titan_core import Callback, Command, ConfigSection, RunOption, Strategy, _registry
from titan_core._registry import Registry
from titan_core.config import ConfigError, section, validate
from titan_core.errors import PluginError, UsageError
from titan_core.trainer import Trainer


def _with(monkeypatch: pytest.MonkeyPatch, *plugins: tuple[str, types.ModuleType]) -> Registry:
    """The process-wide registry: titan's plugins plus ``plugins`` (name, module)."""
    registry = Registry().load_entry_points()
    for name, module in plugins:
        registry.register(module, name, f"dist-{name}", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    return registry


# -- config sections -----------------------------------------------------------------------------


def test_a_section_in_a_module_with_string_annotations_is_still_type_checked(tmp_path: Path) -> None:
    source = textwrap.dedent(
        """
        from __future__ import annotations
        from typing import Literal
        from titan_core.config import section

        @section
        class Fut:
            mode: Literal["a", "b"] = "a"
            rate: float = 1.0
            names: list[str] = []
        """
    )
    path = tmp_path / "fut_section.py"
    path.write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        import fut_section  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    cls = fut_section.Fut
    assert isinstance(attrs_type(cls, "mode"), str)  # what attrs holds under the future import
    fut = cls()
    with pytest.raises(ConfigError, match=r"mode: expected one of a, b, got 'zzz'"):
        fut.mode = "zzz"
    with pytest.raises(ConfigError, match=r"rate: expected float, got str 'fast'"):
        fut.rate = "fast"
    with pytest.raises(ConfigError, match=r"names\[1\]: expected str, got int 5"):
        fut.names = ["a", 5]
    fut.mode, fut.rate, fut.names = "b", 2, ["x"]
    assert (fut.mode, fut.rate, fut.names) == ("b", 2, ["x"])


def attrs_type(cls: type, name: str) -> Any:
    import attrs

    return attrs.fields_dict(cls)[name].type


@section
class Lists:
    layers: list[int] = [0]
    pair: tuple[int, str] = (1, "a")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("layers", "not a list", r"layers: expected a list, got str 'not a list'"),
        ("layers", [1, "2"], r"layers\[1\]: expected int, got str '2'"),
        ("pair", (1, 2), r"pair\[1\]: expected str, got int 2"),
        ("pair", (1,), r"pair: expected 2 items, got 1"),
    ],
)
def test_list_and_tuple_fields_are_checked_item_by_item(field: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        setattr(Lists(), field, value)


def test_list_fields_print_as_toml_arrays_and_load_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    from titan_core.config import TrainerConfig, from_dict, render

    _with(monkeypatch, ("lst", plugin_module("lst", titan_config_sections=[ConfigSection("lst", Lists)])))
    config = TrainerConfig()
    config.lst.layers, config.lst.pair = [1, 2], (3, "b")
    data = tomllib.loads(render(config, "toml"))
    assert data["lst"] == {"layers": [1, 2], "pair": [3, "b"]}  # arrays, not the strings "[1, 2]"
    assert from_dict(data).lst.layers == [1, 2]


def test_a_list_changed_in_place_is_checked_after_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_core.config import TrainerConfig

    _with(monkeypatch, ("lst", plugin_module("lst", titan_config_sections=[ConfigSection("lst", Lists)])))
    config = TrainerConfig()
    config.lst.layers.append("3")  # no setattr: the field's check did not run
    with pytest.raises(ConfigError, match=r"lst\.layers\[1\]: expected int, got str '3'"):
        validate(config)


@section
class _Inner:
    kind: Literal["a", "b"] = "a"


@section
class _Outer:
    inner: _Inner = attrs.Factory(_Inner)


def test_an_error_in_a_nested_section_class_names_its_whole_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A nested attrs class's field was named by the class alone (``_inner.kind``), not where it
    sits in the config (``outer.inner.kind``)."""
    from titan_core.config import TrainerConfig

    _with(
        monkeypatch, ("outer", plugin_module("outer", titan_config_sections=[ConfigSection("outer", _Outer)]))
    )
    config = TrainerConfig()
    expected = r"invalid config: outer\.inner\.kind: expected one of a, b, got 'zz'"
    with pytest.raises(ConfigError, match=expected):
        config.outer.inner.kind = "zz"


def test_a_mutable_default_is_not_shared_between_configs() -> None:
    first = Lists()
    first.layers.append(5)
    assert Lists().layers == [0]


@section
class NoDefault:
    value: int


@section
class Good:
    value: int = 1


@section
class BadDefault:
    value: int = "one"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (ConfigSection("nodef", NoDefault), "cannot be built with its defaults"),
        # Recipes write config.<name>: a name that is no identifier could never be set.
        (ConfigSection("my-sec", Good), "must be a Python identifier not starting with '_' (e.g. 'my_sec')"),
        (ConfigSection("class", Good), "must be a Python identifier"),
        (ConfigSection("badres", Good, results=("nope",)), "results name 'nope', not fields of it"),
        # The section's own name in the path, not the class's (``baddefault.value``).
        (
            ConfigSection("plug", BadDefault),
            "cannot be built with its defaults (ConfigError: invalid config: plug.value: expected int",
        ),
    ],
)
def test_a_section_record_that_would_fail_every_run_fails_only_its_plugin(record: Any, problem: str) -> None:
    registry = Registry()
    info = registry.register(plugin_module("bad", titan_config_sections=[record]), "bad", "dist-bad", "1.0")
    registry.register(plugin_module("ok", titan_config_sections=[ConfigSection("ok", Good)]), "ok")
    assert set(registry.config_sections()) == {"ok"}  # every other config still builds
    assert info.status == "failed" and problem in (info.error or "")


@section
class _OptionalInner:
    label: str | None = None
    n: int = 1


@section
class _Optionals:
    freq: int | None = None
    inner: _OptionalInner = attrs.Factory(_OptionalInner)


def test_none_in_a_nested_section_prints_as_unset_and_loads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A nested section was an inline table, where a None field was written as the string
    "None": config.toml and --print-config read back ``label = "None"``, exit 0."""
    import tomllib

    from titan_core.config import TrainerConfig, from_dict, render

    section_record = ConfigSection("opts", _Optionals)
    _with(monkeypatch, ("opts", plugin_module("opts", titan_config_sections=[section_record])))
    config = TrainerConfig()
    config.opts.inner.n = 4
    text = render(config, "toml")
    assert "[opts.inner]\n# label = (unset)\nn = 4\n" in text
    assert from_dict(tomllib.loads(text)).opts == config.opts
    config.opts.inner.label, config.opts.freq = "x", 3
    assert from_dict(tomllib.loads(render(config, "toml"))).opts == config.opts


@section
class _NoneNotDefault:
    freq: int | None = 5


@section
class _NoneItems:
    items: list[int | None] = [1]


@section
class _NoneValues:
    table: dict[str, str | None] = {}


@section
class _NestedNoneNotDefault:
    inner: _NoneNotDefault = attrs.Factory(_NoneNotDefault)


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        # None was written as ``# freq = (unset)``, which read back as 5: the run's config.toml
        # and --print-config gave another config than the recipe's, without a word.
        (_NoneNotDefault, "freq (int | None with default 5: TOML has no null, and a None left out"),
        (_NestedNoneNotDefault, "inner (_NoneNotDefault: freq (int | None with default 5"),
        # An item None was the string "None" in the array or inline table.
        (_NoneItems, "items (list[int | None])"),
        (_NoneValues, "table (dict[str, str | None])"),
    ],
)
def test_a_section_whose_none_toml_cannot_record_fails_only_its_plugin(cls: type, problem: str) -> None:
    registry = Registry()
    record = ConfigSection("nonesec", cls)
    info = registry.register(plugin_module("bad", titan_config_sections=[record]), "bad", "dist-bad", "1.0")
    assert set(registry.config_sections()) == set()
    assert info.status == "failed" and problem in (info.error or ""), info.error


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        (
            lambda config: None,
            r"the check of config section 'chk' \(plugin chk, dist-chk 1.0\) returned None",
        ),
        (
            lambda config: 1 / 0,
            r"the check of config section 'chk' \(plugin chk, dist-chk 1.0\) failed: Zero",
        ),
    ],
)
def test_a_section_check_that_raises_or_returns_none_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], check: Any, expected: str
) -> None:
    from titan_core.config import TrainerConfig

    _with(
        monkeypatch,
        ("chk", plugin_module("chk", titan_config_sections=[ConfigSection("chk", Good, check=check)])),
    )
    # A run that leaves the section at its defaults does not use the plugin: its broken check is
    # a warning naming it, not the end of every run of the installation.
    config = TrainerConfig()
    assert validate(config) is config
    assert re.search(
        expected + r".*; the section is at its defaults, so this run goes on", capsys.readouterr().out
    )
    config.chk.value = 2  # the recipe uses the section: its values must be checked, or refused
    with pytest.raises(PluginError, match=expected):
        validate(config)


def test_a_section_check_of_a_plugin_registered_as_an_object_is_named_like_its_other_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from titan_core.config import TrainerConfig

    registry = Registry().load_entry_points()
    module = plugin_module("obj", titan_config_sections=[ConfigSection("obj", Good, check=lambda c: 1 / 0)])
    registry.register(module, "obj")
    monkeypatch.setattr(_registry, "_default", registry)
    config = TrainerConfig()
    config.obj.value = 2
    # The same words as the registry's label for any record of a plugin with no distribution.
    with pytest.raises(PluginError, match=r"the check of config section 'obj' \(plugin obj\) failed: Zero"):
        validate(config)


@section
class Listing:
    #: Names.
    names: list[str] = attrs.field(factory=list)
    #: Layers.
    layers: list[int] = attrs.field(factory=list)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"names": "output"}, "lists.names: expected a list, got str 'output'"),  # not o, u, t, ...
        ({"layers": "12"}, "lists.layers: expected a list, got str '12'"),
        ({"names": ["a", 3]}, "lists.names[1]: expected a string, got int 3"),
        ("all", "lists: expected a table of its fields, got str 'all'"),
    ],
)
def test_from_dict_holds_a_plugin_sections_lists_to_their_types(
    monkeypatch: pytest.MonkeyPatch, given: Any, problem: str
) -> None:
    from titan_core.config import from_dict

    _with(
        monkeypatch,
        ("lists", plugin_module("lists", titan_config_sections=[ConfigSection("lists", Listing)])),
    )
    with pytest.raises(ConfigError) as info:
        from_dict({"lists": given})
    assert info.value.problems == [problem]
    assert from_dict({"lists": {"names": ["a", "b"]}}).lists.names == ["a", "b"]


# -- strategies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: Strategy("s", "abc", lambda c, d: True, lambda p, x: p),
            r"Strategy.order: expected an int, got str",
        ),
        (
            lambda: Strategy("s", 10, lambda c, d: True, lambda p, x: p, handles=("sp",)),
            r"'sp' is not a parallel",
        ),
        (lambda: Strategy("s", 10, lambda c, d: True, lambda p, x: p, handles="tp"), r"expected a tuple"),
        (lambda: Strategy("s", 10, True, lambda p, x: p), r"Strategy.applies: expected a function"),
    ],
)
def test_a_strategy_record_of_the_wrong_types_is_refused_where_it_is_made(make: Any, expected: str) -> None:
    with pytest.raises((TypeError, ValueError), match=expected):
        make()


def test_the_failure_of_a_bad_record_points_at_the_plugins_line_not_the_core() -> None:
    module = types.ModuleType("third_party_order")

    def titan_strategies() -> list:
        return [Strategy("s", "abc", lambda c, d: True, lambda p, x: p)]

    from titan_core import hookimpl

    module.titan_strategies = hookimpl(titan_strategies)  # type: ignore[attr-defined]
    registry = Registry()
    info = registry.register(module, "order")
    registry.gather_all()
    assert info.status == "failed"
    assert f"(at {__file__}:" in (info.error or "")


def _strategy_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: Strategy) -> Any:
    registry = _with(monkeypatch, ("strat", plugin_module("strat", titan_strategies=[strategy])))
    return Trainer(tiny_llama3(tmp_path, 2), registry)


def test_a_strategy_whose_applies_raises_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def applies(config: Any, dims: Any) -> bool:
        raise KeyError("tp_degree")

    with pytest.raises(
        PluginError, match=r"strategy 'asks' \(plugin strat, dist-strat 1.0\) failed in applies"
    ):
        _strategy_run(tmp_path, monkeypatch, Strategy("asks", 45, applies, lambda p, x: p))


def test_a_strategy_whose_apply_returns_nothing_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def apply(parts: list, ctx: Any) -> None:
        for part in parts:
            part.train()  # forgot to return them

    with pytest.raises(
        PluginError, match=r"strategy 'noret' .* returned NoneType from apply; it must return"
    ):
        _strategy_run(tmp_path, monkeypatch, Strategy("noret", 45, lambda c, d: True, apply))


@pytest.mark.parametrize("answer", ["False", None, 0])
def test_a_strategy_whose_applies_answers_no_bool_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: Any
) -> None:
    """``applies`` returning the string ``"False"`` applied the strategy (truthiness), and a
    forgotten ``return`` (None) left it out, without a word either way."""
    applied: list[str] = []

    def apply(parts: Any, ctx: Any) -> Any:
        applied.append("maybe")
        return parts

    with pytest.raises(
        PluginError,
        match=rf"strategy 'maybe' .* returned {type(answer).__name__} {answer!r} from applies; it must "
        "return True or False",
    ):
        _strategy_run(tmp_path, monkeypatch, Strategy("maybe", 45, lambda c, d: answer, apply))
    assert applied == []


def test_two_applied_strategies_of_one_order_are_refused_not_ordered_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ties were broken by name: a third party's strategy at fsdp's slot ran before FSDP when
    named `a...`, after it when named `z...`, without a word."""
    applied: list[str] = []

    def apply(name: str) -> Any:
        return lambda parts, ctx: applied.append(name) or parts

    registry = _with(
        monkeypatch,
        (
            "first",
            plugin_module("first", titan_strategies=[Strategy("zeta", 45, lambda c, d: True, apply("z"))]),
        ),
        (
            "second",
            plugin_module("second", titan_strategies=[Strategy("alpha", 45, lambda c, d: True, apply("a"))]),
        ),
    )
    with pytest.raises(PluginError) as raised:
        Trainer(tiny_llama3(tmp_path, 1), registry)
    message = str(raised.value)
    assert "strategy 'alpha' (plugin second, dist-second 1.0)" in message
    assert "strategy 'zeta' (plugin first, dist-first 1.0)" in message
    assert "both have order 45" in message and applied == []


# -- strategy checks before launch ------------------------------------------------------------------


def _preflight(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    recipe: Any,
    processes: int,
    *plugins: tuple[str, types.ModuleType],
    registry: Registry | None = None,
) -> tuple[int, str]:
    """``run_train.sh``'s check before torchrun (:func:`titan_core.run.preflight`) of ``recipe``
    for ``processes`` processes, with titan's plugins and ``plugins``: its exit status and stderr."""
    from titan_core import Recipe
    from titan_core.run import preflight

    registry = registry or Registry().load_entry_points()
    for name, module in (
        ("layouts", plugin_module("layouts", titan_recipes=[Recipe("layout_recipe", recipe)])),
        *plugins,
    ):
        registry.register(module, name, f"dist-{name}", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: _registry._default)
    status = preflight(["--recipe", "layout_recipe"], processes)
    return status, capsys.readouterr().err


#: Layouts that titan's strategies (and the trainer's batch arithmetic) refuse from the config, the
#: degrees and the model's arguments alone: each was refused only inside the torchrun workers,
#: after they started (torchrun's ChildFailedError report, exit 1, sometimes with no titan line).
LAYOUT_ERRORS = [
    pytest.param(
        2,
        {
            "training.local_batch_size": 4,
            "parallelism.dp_shard": 1,
            "parallelism.pp": 2,
            "parallelism.pp_microbatches": 3,
        },
        "parallelism.pp_microbatches=3 must divide training.local_batch_size=4; set pp_microbatches",
        id="pp_microbatches-not-dividing-the-batch",
    ),
    pytest.param(
        2,
        {
            "training.local_batch_size": 4,
            "parallelism.dp_shard": 1,
            "parallelism.pp": 2,
            "parallelism.pp_microbatches": 1,
        },
        "parallelism.pp_schedule=1F1B needs at least as many microbatches as stages (2), got "
        "parallelism.pp_microbatches=1",
        id="1F1B-fewer-microbatches-than-stages",
    ),
    pytest.param(
        2,
        {"parallelism.dp_shard": 1, "parallelism.pp": 2, "parallelism.pp_schedule": "Foo"},
        "parallelism.pp_schedule='Foo' is not a schedule of torch.distributed.pipelining; use GPipe",
        id="unknown-schedule",
    ),
    pytest.param(
        2,
        {
            "parallelism.dp_shard": 1,
            "parallelism.pp": 2,
            "parallelism.pp_stages_per_rank": 3,
            "parallelism.pp_schedule": "Interleaved1F1B",
            "training.local_batch_size": 6,
        },
        "pipeline parallel needs at least one block per stage: 4 blocks for pp=2 x 3 stages per "
        "rank = 6 stages",
        id="fewer-blocks-than-stages",
    ),
    pytest.param(
        2,
        {"training.seq_len": 66, "parallelism.dp_shard": 1, "parallelism.cp": 2},
        "context parallel with cp=2 cuts each sequence into 2*cp = 4 equal chunks, but "
        "training.seq_len=66 is not a multiple of 4",
        id="cp-seq_len",
    ),
    pytest.param(
        2,
        {"training.seq_len": 63, "parallelism.dp_shard": 1, "parallelism.tp": 2},
        "training.seq_len=63 is not divisible by parallelism.tp=2",
        id="tp-seq_len",
    ),
    pytest.param(
        2,
        {"training.local_batch_size": 2, "training.global_batch_size": 6},
        "training.global_batch_size=6 is not a multiple of training.local_batch_size x DP degree = 2 x 2 = 4",
        id="global-batch-not-a-multiple-of-local-x-dp",
    ),
    pytest.param(
        4,
        {
            "model.name": "moe",
            "model.flavor": "debugmodel",
            "model.overrides": {},
            "parallelism.ep": 2,
            "parallelism.tp": 2,
        },
        "expert parallel (ep=2) with tensor parallel (tp=2) is not supported; set parallelism.tp = 1",
        id="ep-with-tp",
    ),
]


@pytest.mark.parametrize(("processes", "layout", "expected"), LAYOUT_ERRORS)
def test_preflight_refuses_what_the_strategies_refuse_from_the_config_alone(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    processes: int,
    layout: dict[str, Any],
    expected: str,
) -> None:
    """run_train.sh's check before torchrun runs the strategies' checks (``Strategy.check``) and
    the global-batch arithmetic, from the same functions the trainer calls: one line, exit 2."""
    from tests.parallel_harness import tiny_config

    status, err = _preflight(
        monkeypatch,
        capsys,
        lambda: tiny_config(**{"job.dump_folder": str(tmp_path / "out"), **layout}),
        processes,
    )
    assert status == UsageError.exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan: error: "), err
    assert expected in lines[0]
    assert not (tmp_path / "out").exists()


class _EvenSeqLen:
    """A third party's ``Strategy.check`` given as an object (a callable instance)."""

    def __init__(self, raises: bool = False, returns: Any = ()) -> None:
        self.raises, self.returns = raises, returns
        self.calls: list[tuple[int, str, Any]] = []

    def __call__(self, config: Any, dims: Any, spec: Any, args: Any) -> Any:
        from titan_core.layout import model_arg

        self.calls.append((dims.world_size, spec.name, model_arg(args, "n_layers")))
        if self.raises:
            raise ValueError("looked for a field that is not there")
        if self.returns != ():
            return self.returns
        seq_len = config.training.seq_len
        return (
            [f"training.seq_len: {seq_len} is odd; the halves strategy needs an even seq_len"]
            if seq_len % 2
            else []
        )


def _halves(check: Any, applies: Any = lambda config, dims: True) -> Strategy:
    return Strategy(
        "halves", 45, applies, lambda parts, ctx: parts, "splits sequences in halves", check=check
    )


def test_a_third_party_strategy_check_refuses_in_preflight_and_in_the_trainer_alike(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    check = _EvenSeqLen()
    plugin = ("halves", plugin_module("halves", titan_strategies=[_halves(check)]))

    def recipe() -> Any:
        config = tiny_llama3(tmp_path / "out", 1)
        config.training.seq_len = 31
        return config

    status, err = _preflight(monkeypatch, capsys, recipe, 1, plugin)
    assert status == UsageError.exit_code
    assert err.splitlines() == [
        "titan: error: training.seq_len: 31 is odd; the halves strategy needs an even seq_len"
    ]
    assert check.calls == [(1, "llama3", 2)]  # the degrees, the spec and the model's arguments
    with pytest.raises(UsageError) as info:
        Trainer(recipe(), _registry._default)
    assert f"titan: error: {info.value}" == err.strip()
    assert not (tmp_path / "out").exists()  # refused before anything is written or built
    assert len(check.calls) == 2


def test_a_strategy_check_is_asked_only_when_the_strategy_applies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    check = _EvenSeqLen()
    plugin = ("halves", plugin_module("halves", titan_strategies=[_halves(check, lambda c, d: False)]))

    def recipe() -> Any:
        config = tiny_llama3(tmp_path / "out", 1)
        config.training.seq_len = 31
        return config

    assert _preflight(monkeypatch, capsys, recipe, 1, plugin) == (0, "")
    assert check.calls == []


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        (
            _EvenSeqLen(raises=True),
            "strategy 'halves' (plugin halves, dist-halves 1.0) failed in check: "
            "ValueError: looked for a field that is not there",
        ),
        (
            _EvenSeqLen(returns=None),
            "strategy 'halves' (plugin halves, dist-halves 1.0): its check returned None; it must "
            "return a list of problems",
        ),
    ],
    ids=["raises", "returns-None"],
)
def test_a_strategy_check_that_raises_or_returns_no_list_is_one_error_naming_its_plugin(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    check: Any,
    expected: str,
) -> None:
    plugin = ("halves", plugin_module("halves", titan_strategies=[_halves(check)]))
    status, err = _preflight(monkeypatch, capsys, lambda: tiny_llama3(tmp_path / "out", 1), 1, plugin)
    assert status == PluginError.exit_code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"titan: error: {expected}"), err
    with pytest.raises(PluginError) as info:
        Trainer(tiny_llama3(tmp_path / "out", 1), _registry._default)
    assert str(info.value).startswith(expected)


def test_a_strategy_check_must_be_a_function() -> None:
    with pytest.raises(TypeError, match=r"Strategy.check: expected a function, got int 3"):
        Strategy("s", 10, lambda c, d: True, lambda p, x: p, check=3)


def test_preflight_refuses_degrees_no_installed_strategy_handles(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """tp = 2 without the parallelism plugin: the trainer refused it in every worker; the check
    before torchrun now does, with the trainer's message (one function for both)."""
    from tests.parallel_harness import tiny_config

    def recipe() -> Any:
        return tiny_config(
            **{"job.dump_folder": str(tmp_path / "out"), "parallelism.tp": 2, "parallelism.dp_shard": 1}
        )

    status, err = _preflight(
        monkeypatch, capsys, recipe, 2, registry=Registry(disabled={"parallel"}).load_entry_points()
    )
    assert status == PluginError.exit_code
    assert err.startswith("titan: error: this run needs strategies for tp (parallel degrees")


def _replicating(applies: Any = lambda config, dims: True) -> tuple[str, types.ModuleType]:
    """A third party's DDP: a strategy handling ``dp_replicate`` (its ``apply`` is never reached)."""
    ddp = Strategy("ddp", 65, applies, lambda parts, ctx: parts, "DDP", handles=("dp_replicate",))
    return ("replicator", plugin_module("replicator", titan_strategies=[ddp]))


def _replicated(tmp_path: Path) -> Any:
    from tests.parallel_harness import tiny_config

    return lambda: tiny_config(
        **{
            "job.dump_folder": str(tmp_path / "out"),
            "parallelism.dp_replicate": 2,
            "parallelism.dp_shard": 1,
            "training.local_batch_size": 2,
        }
    )


def test_two_applied_strategies_handling_one_dimension_are_refused_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A third party's DDP (handles dp_replicate) beside titan's FSDP (dp_shard and dp_replicate,
    whenever dp > 1): both applied, and every worker failed after building the mesh and the model,
    inside torch (``Cannot apply replicate() on a Module already managed by fully_shard``), or
    reduced the gradients twice with a strategy torch does not catch."""
    status, err = _preflight(monkeypatch, capsys, _replicated(tmp_path), 2, _replicating())
    assert status == PluginError.exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan: error: "), err
    assert "strategy 'ddp' (plugin replicator, dist-replicator 1.0)" in lines[0]
    assert "strategy 'fsdp' (plugin parallel, titan-plugins-parallel" in lines[0]
    assert "both handle dp_replicate" in lines[0] and "--disable-plugin" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_degree_whose_strategy_does_not_apply_names_the_strategy_not_a_missing_plugin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """dp_replicate = 2 with titan's parallel plugin disabled and the DDP plugin installed but not
    turned on: the error said no installed plugin provides dp_replicate and to install
    titan-plugins-parallel, which was installed (disabled) beside the plugin that does."""
    registry = Registry(disabled={"parallel"}).load_entry_points()
    status, err = _preflight(
        monkeypatch, capsys, _replicated(tmp_path), 2, _replicating(lambda c, d: False), registry=registry
    )
    assert status == UsageError.exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "this run needs a strategy for dp_replicate" in lines[0]
    assert "strategy 'ddp' (plugin replicator, dist-replicator 1.0) handles it but does not apply" in lines[0]
    assert "no installed plugin provides" not in lines[0]
    # With no provider at all, the disabled plugins are named beside the install hint.
    registry = Registry(disabled={"parallel"}).load_entry_points()
    status, err = _preflight(monkeypatch, capsys, _replicated(tmp_path), 2, registry=registry)
    assert status == PluginError.exit_code
    assert "which no loaded plugin provides" in err and "(disabled plugins: parallel)" in err


# -- callbacks ---------------------------------------------------------------------------------------


class _Raises:
    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        if step == 2:
            raise RuntimeError("report folder vanished")


def test_a_callback_raising_in_the_loop_is_one_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Callback("reporter", lambda trainer: _Raises())
    registry = _with(monkeypatch, ("cb", plugin_module("cb", titan_callbacks=[record])))
    trainer = Trainer(tiny_llama3(tmp_path, 3), registry)
    try:
        with pytest.raises(PluginError) as caught:
            trainer.train()
    finally:
        trainer.close()
    message = str(caught.value)
    assert message.startswith(
        "callback 'reporter' (plugin cb, dist-cb 1.0) failed in on_step_end: "
        "RuntimeError: report folder vanished"
    )
    assert trainer.step == 2
    assert "report folder vanished" in (tmp_path / "plugin_error.log").read_text()


def test_a_core_field_whose_plugin_is_not_loaded_is_refused_not_ignored(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 2)
    config.debug.memory_report = True
    registry = Registry(disabled={"memory"}).load_entry_points()
    with pytest.raises(UsageError, match=r"debug.memory_report = True: no loaded plugin implements it"):
        Trainer(config, registry)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_backend_setting_a_core_field_no_plugin_serves_is_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The fake backends turn the memory report on; with the memory plugin disabled the run goes
    on (it is the backend's setting, not the user's) but says it writes no report."""
    from titan_core.config import TrainerConfig
    from titan_core.run import apply_backend_settings, check_served

    config = TrainerConfig()
    config.comm.backend = "fake"
    registry = Registry(disabled={"memory"}).load_entry_points()
    apply_backend_settings(config, registry)
    check_served(config, registry)
    err = capsys.readouterr().err
    assert "titan: warning: comm backend 'fake' sets debug.memory_report = True, but no loaded plugin" in err
    check_served(config, Registry().load_entry_points())
    assert capsys.readouterr().err == ""


def test_a_third_party_callback_can_serve_a_core_field(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 1)
    config.debug.memory_report = True
    registry = Registry(disabled={"memory"}).load_entry_points()
    seen: list[bool] = []
    record = Callback(
        "my_memory",
        lambda trainer: seen.append(trainer.config.debug.memory_report),
        serves=("debug.memory_report",),
    )
    registry.register(plugin_module("mine", titan_callbacks=[record]), "mine")
    Trainer(config, registry).close()
    assert seen == [True]


def test_the_built_log_line_names_callbacks_as_plugins_list_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record name (``titan plugins list``), not the class the build returned."""
    import json

    class Anything:
        def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
            pass

    registry = Registry().load_entry_points()
    registry.register(
        plugin_module("mine", titan_callbacks=[Callback("tie_check", lambda t: Anything())]), "mine"
    )
    config = tiny_llama3(tmp_path, 1)
    Trainer(config, registry).close()
    built = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"event": "built"' in line]
    assert "tie_check" in built[0]["callbacks"] and "Anything" not in built[0]["callbacks"]


# -- commands and run options -----------------------------------------------------------------------


def _cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *argv: str,
    **plugins: types.ModuleType,
) -> tuple[int, str]:
    from titan_core.cli import main

    _with(monkeypatch, *plugins.items())
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: _registry._default)
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _command(name: str) -> Command:
    return Command(name, "a plugin's command", lambda parser: None, lambda args: 0)


def test_a_plugin_command_named_like_the_cores_fails_naming_both_and_leaves_the_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dup = plugin_module("dup", titan_commands=[_command("run"), _command("dup-info")])
    code, out = _cli(monkeypatch, capsys, "run", "--recipe", "llama3_debugmodel", "--print-config", dup=dup)
    assert code == PluginError.exit_code
    assert "command 'run' is provided twice" in out and "dist-dup 1.0" in out and "titan-core" in out
    code, out = _cli(monkeypatch, capsys, "--help", dup=dup)
    assert "run" in out and "dup-info" in out and "recipes" in out


def _option(name: str, flag: str) -> RunOption:
    return RunOption(name, flag, "a plugin's flag", lambda config, registry, args: 0)


def test_a_run_option_flag_two_plugins_share_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    one = plugin_module("one", titan_run_options=[_option("smooth_a", "--show-smooth")])
    two = plugin_module("two", titan_run_options=[_option("smooth_b", "--show-smooth")])
    code, out = _cli(
        monkeypatch, capsys, "run", "--recipe", "llama3_debugmodel", "--show-smooth", one=one, two=two
    )
    assert code == 2
    assert "--show-smooth is provided twice" in out and "dist-one 1.0" in out and "dist-two 1.0" in out


@pytest.mark.parametrize("flags", [("--smooth-a", "--smooth-b"), ("--smooth", "--smooth")])
def test_a_run_option_name_two_plugins_provide_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: tuple[str, str]
) -> None:
    """A record name two plugins provide, as the registry reports every such conflict: the flags
    (each plugin's) were both left out of titan run, so giving one was argparse's 'unrecognized
    arguments', naming neither plugin; now the flag is refused with the registry's error."""
    one = plugin_module("one", titan_run_options=[_option("smooth", flags[0])])
    two = plugin_module("two", titan_run_options=[_option("smooth", flags[1])])
    expected = (
        "run option 'smooth' is provided twice: by plugin 'one' (dist-one 1.0) and plugin 'two' "
        "(dist-two 1.0); uninstall or disable one of them (TITAN_DISABLE_PLUGINS=one (--disable-plugin one) "
        "or TITAN_DISABLE_PLUGINS=two (--disable-plugin two))"
    )
    for flag in flags:
        code, out = _cli(monkeypatch, capsys, "run", "--recipe", "llama3_debugmodel", flag, one=one, two=two)
        assert code == 2 and expected in out
        assert out.count("provided twice") == 1  # one flag of both: one message
    code, out = _cli(monkeypatch, capsys, "run", "--help", one=one, two=two)
    assert all(flag in out for flag in flags) and "(refused: provided twice)" in out
    # Only the runs that ask for the name fail.
    code, out = _cli(
        monkeypatch, capsys, "run", "--recipe", "llama3_debugmodel", "--print-config", one=one, two=two
    )
    assert code == 0 and 'recipe = "llama3_debugmodel"' in out


def test_a_run_option_with_a_flag_of_titan_run_is_left_out_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    taker = plugin_module(
        "taker", titan_run_options=[_option("mine", "--print-config"), _option("later", "--later")]
    )
    code, out = _cli(
        monkeypatch, capsys, "run", "--recipe", "llama3_debugmodel", "--print-config", taker=taker
    )
    assert code == 0 and 'recipe = "llama3_debugmodel"' in out  # titan run's own flag still works
    assert "run option 'mine' of plugin 'taker' (dist-taker 1.0) has flag --print-config" in out
    code, out = _cli(monkeypatch, capsys, "run", "--help", taker=taker)
    assert "--later" in out  # the options after it are still there


def test_a_run_option_flag_must_be_a_long_option() -> None:
    with pytest.raises(ValueError, match=r"RunOption.flag: expected a long option"):
        _option("pp", "no-dashes")


def test_disabling_an_unknown_plugin_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _cli(monkeypatch, capsys, "--disable-plugin", "paralel", "plugins", "list")
    assert code == 2 and "--disable-plugin paralel: no plugin of that name" in out


def test_a_fake_backend_run_without_the_memory_plugin_still_runs(tmp_path: Path) -> None:
    """The fake backends turn debug.memory_report on themselves: without a plugin serving it the
    run goes on (no report), as it did; only a recipe's own setting is refused."""
    from tests.conftest import run_titan, tiny_recipe_source

    (tmp_path / "fake_recipes.py").write_text(tiny_recipe_source("tiny", 1))
    args = (
        "run",
        "--module",
        "fake_recipes",
        "--recipe",
        "tiny",
        "--comm-backend",
        "fake",
        "--dump-folder",
        "out",
    )
    result = run_titan(*args, cwd=tmp_path, NGPU="2", TITAN_DISABLE_PLUGINS="memory")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not list((tmp_path / "out").glob("memory_report_rank*.json"))


def test_preflight_names_a_model_plugin_whose_validate_raises(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """run_train.sh's check before torchrun: a plugin's own exception is one line naming it."""
    import attrs

    from titan_core import Recipe
    from titan_core.run import preflight

    llama3 = Registry().load_entry_points().get("models", "llama3")

    def validate(args: Any, dims: Any) -> None:
        raise ValueError("heads do not divide")

    def recipe() -> Any:
        config = tiny_llama3(tmp_path, 1)
        config.model.name = "strict"
        return config

    module = plugin_module(
        "strict",
        titan_models=[attrs.evolve(llama3, name="strict", validate=validate)],
        titan_recipes=[Recipe("strict_recipe", recipe)],
    )
    _with(monkeypatch, ("strict", module))
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: _registry._default)
    assert preflight(["--recipe", "strict_recipe"], 1) == 1
    err = capsys.readouterr().err
    assert (
        "model 'strict' (plugin strict, dist-strict 1.0) failed to validate its arguments: ValueError" in err
    )


def test_preflight_refuses_a_core_field_whose_plugin_is_not_loaded_as_the_trainer_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """run_train.sh's check before torchrun: debug.memory_report with no callback serving it was
    refused only by each worker, after torchrun started them; now by the check, with the
    trainer's own message (one function checks for both)."""
    from titan_core import Recipe
    from titan_core.run import preflight

    def recipe() -> Any:
        config = tiny_llama3(tmp_path / "out", 1)
        config.debug.memory_report = True
        return config

    registry = Registry(disabled={"memory"}).load_entry_points()
    module = plugin_module("served", titan_recipes=[Recipe("served_recipe", recipe)])
    registry.register(module, "served", "dist-served", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: _registry._default)
    assert preflight(["--recipe", "served_recipe"], 1) == UsageError.exit_code
    err = capsys.readouterr().err
    assert err.startswith("titan: error: debug.memory_report = True: no loaded plugin implements it")
    with pytest.raises(UsageError) as info:
        Trainer(recipe(), registry)
    assert err.splitlines()[0] == f"titan: error: {info.value}"
    assert not (tmp_path / "out").exists()  # the trainer refuses it before writing anything too


def test_a_callback_serving_no_such_core_field_fails_its_plugin() -> None:
    record = Callback("typo", lambda trainer: None, serves=("debug.memory_reprot",))
    registry = Registry()
    info = registry.register(plugin_module("typo", titan_callbacks=[record]), "typo", "dist-typo", "1.0")
    registry.gather_all()
    assert info.status == "failed"
    assert (
        "serving 'debug.memory_reprot', not a core field a plugin implements; those are: debug.memory_report"
        in (info.error or "")
    )


# -- comm backends -------------------------------------------------------------------------------


def _refuse_to_start(config: Any) -> Any:
    raise RuntimeError("the fabric manager is down")


@pytest.mark.parametrize(
    ("init", "said"),
    [
        (_refuse_to_start, "failed to start: RuntimeError: the fabric manager is down"),
        (lambda config: None, "init returned None, not a titan_core.topology.Topology"),
    ],
    ids=["raises", "returns-none"],
)
def test_a_comm_backend_whose_init_fails_is_one_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, init: Any, said: str
) -> None:
    """Raised: a bare traceback from the trainer's _join; None: ``AttributeError: 'NoneType'
    object has no attribute 'rank'`` from the logging setup."""
    from tests.parallel_harness import tiny_config
    from titan_core import CommBackend

    _with(monkeypatch, ("fabric", plugin_module("fabric", titan_comm_backends=[CommBackend("fabric", init)])))
    config = tiny_config(**{"comm.backend": "fabric", "job.dump_folder": str(tmp_path)})
    with pytest.raises(PluginError) as info:
        Trainer(config, _registry.get_registry())
    text = str(info.value)
    assert text.startswith("comm backend 'fabric' (plugin fabric, dist-fabric 1.0)"), text
    assert said in text, text
