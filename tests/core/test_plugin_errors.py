"""Third-party plugin code that fails or returns bad values: one error naming the plugin.

Plugins are registered as objects on a :class:`Registry`, next to titan's own (the tiny Llama 3
of one-process tests provides the real model behind each probe).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import tiny_llama3
from titan_core import Callback, Recipe, Strategy, hookimpl
from titan_core._registry import Registry
from titan_core.errors import PluginError, UsageError
from titan_core.trainer import Trainer, train


class _Probe:
    """A plugin object providing the records it is given."""

    def __init__(self, **records: list[Any]) -> None:
        self.records = records

    @hookimpl
    def titan_models(self) -> list:
        return self.records.get("models", [])

    @hookimpl
    def titan_strategies(self) -> list:
        return self.records.get("strategies", [])

    @hookimpl
    def titan_callbacks(self) -> list:
        return self.records.get("callbacks", [])

    @hookimpl
    def titan_recipes(self) -> list:
        return self.records.get("recipes", [])


def _registry(probe: _Probe, **info: str) -> Registry:
    registry = Registry().load_entry_points()
    registry.register(probe, "probe_good", **info)
    return registry


def _llama3(registry: Registry) -> Any:
    return registry.get("models", "llama3")


def _probe_model(build: Any) -> _Probe:
    llama3 = _llama3(Registry().load_entry_points())
    return _Probe(
        models=[
            attrs.evolve(
                llama3, name="probe_tiny", flavors={"tiny": llama3.flavors["debugmodel"]}, build=build
            )
        ]
    )


def _config(tmp_path: Path, steps: int = 2, **overrides: Any) -> Any:
    config = tiny_llama3(tmp_path, steps)
    config.model.name, config.model.flavor = "probe_tiny", "tiny"
    config.model.overrides = {**config.model.overrides, **overrides}
    return config


def _refusing_build(args: Any) -> Any:
    if args.n_layers == 99:
        raise ValueError("n_layers=99 is not supported")
    from titan_plugins_llama3.model import build

    return build(args)


# -- 1. a model's build or a strategy's apply raises -------------------------------------------------


def test_a_model_build_error_is_one_line_naming_the_model_and_plugin(tmp_path: Path) -> None:
    registry = _registry(_probe_model(_refusing_build))
    with pytest.raises(PluginError) as caught:
        Trainer(_config(tmp_path, n_layers=99), registry)
    message = str(caught.value)
    assert message.startswith(
        "model 'probe_tiny' (plugin probe_good) failed to build: ValueError: n_layers=99 is not supported"
    )
    assert "\n" not in message
    assert caught.value.exit_code == 1
    # The original exception stays reachable: chained, and its traceback in the file named.
    assert isinstance(caught.value.__cause__, ValueError)
    where = tmp_path / "plugin_error.log"
    assert str(where) in message
    text = where.read_text()
    assert "Traceback (most recent call last)" in text and "_refusing_build" in text
    assert "ValueError: n_layers=99 is not supported" in text


@pytest.mark.parametrize("built", [None, "model"])
def test_a_model_build_that_returns_no_module_is_one_line_naming_the_model(
    tmp_path: Path, built: Any
) -> None:
    """A build that forgot its ``return`` ended in an AttributeError traceback from tied.py."""
    registry = _registry(_probe_model(lambda args: built))
    with pytest.raises(PluginError) as caught:
        Trainer(_config(tmp_path), registry)
    assert str(caught.value) == (
        f"model 'probe_tiny' (plugin probe_good) returned {type(built).__name__} from build; it must "
        "return the model, an nn.Module (built on the meta device)"
    )


def _counting_model(**spec_fields: Any) -> _Probe:
    probe = _probe_model(__import__("titan_plugins_llama3.model", fromlist=["build"]).build)
    probe.records["models"] = [attrs.evolve(probe.records["models"][0], **spec_fields)]
    return probe


def _raises(*args: Any) -> Any:
    raise ZeroDivisionError("division by zero")


@pytest.mark.parametrize(
    ("field", "fn", "expected"),
    [
        ("num_params", _raises, "failed in num_params: ZeroDivisionError: division by zero"),
        ("flops_per_token", _raises, "failed in flops_per_token: ZeroDivisionError: division by zero"),
        ("num_params", lambda args, emb: "6.2M", "returned str '6.2M' from num_params; it must return"),
        ("num_params", lambda args, emb: -1, "returned int -1 from num_params; it must return"),
        ("flops_per_token", lambda args, seq: math.nan, "returned float nan from flops_per_token;"),
        ("flops_per_token", lambda args, seq: None, "returned NoneType None from flops_per_token;"),
    ],
)
def test_a_models_count_that_fails_or_is_no_count_is_one_line_naming_the_model(
    tmp_path: Path, field: str, fn: Any, expected: str
) -> None:
    """``ModelSpec.num_params`` / ``flops_per_token`` raising ended in a traceback from init.py or
    the trainer; a string or NaN went on into the memory threshold and MFU."""
    with pytest.raises(PluginError) as caught:
        Trainer(_config(tmp_path), _registry(_counting_model(**{field: fn})))
    message = str(caught.value)
    assert message.startswith("model 'probe_tiny' (plugin probe_good) "), message
    assert expected in message, message


def test_the_cli_prints_one_error_line_with_the_plugin_error_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from titan_core import _registry as registry_module
    from titan_core.cli import main

    probe = _probe_model(_refusing_build)
    probe.records["recipes"] = [Recipe("probe_recipe", lambda: _config(tmp_path, n_layers=99), "probe")]
    monkeypatch.delenv(registry_module.DISABLE_ENV, raising=False)
    registry = _registry(probe, distribution="titan-probe", version="1.2")
    monkeypatch.setattr(registry_module, "_default", registry)
    code = main(["run", "--recipe", "probe_recipe", "--dump-folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == PluginError.exit_code == 1
    errors = [line for line in err.splitlines() if line.startswith("titan: error:")]
    assert errors == [
        "titan: error: model 'probe_tiny' (plugin probe_good, titan-probe 1.2) failed to build: "
        f"ValueError: n_layers=99 is not supported; the traceback is in {tmp_path / 'plugin_error.log'}"
    ]
    assert "Traceback" not in err


def test_the_distribution_providing_the_model_is_named(tmp_path: Path) -> None:
    registry = _registry(_probe_model(_refusing_build), distribution="titan-probe", version="1.2")
    with pytest.raises(
        PluginError, match=r"^model 'probe_tiny' \(plugin probe_good, titan-probe 1\.2\) failed"
    ):
        Trainer(_config(tmp_path, n_layers=99), registry)


def test_a_titan_error_of_the_plugin_keeps_its_own_message(tmp_path: Path) -> None:
    def build(args: Any) -> Any:
        raise UsageError("probe_tiny: n_layers must be even")

    with pytest.raises(UsageError) as caught:
        Trainer(_config(tmp_path), _registry(_probe_model(build)))
    assert str(caught.value) == "probe_tiny: n_layers must be even"
    assert caught.value.exit_code == 2


def test_a_strategy_apply_error_names_the_strategy_and_plugin(tmp_path: Path) -> None:
    def apply(parts: list, ctx: Any) -> list:
        raise RuntimeError("cannot wrap Llama3")

    strategy = Strategy("probe_strategy", order=500, applies=lambda config, dims: True, apply=apply)
    registry = _registry(_Probe(strategies=[strategy]))
    config = tiny_llama3(tmp_path, 2)
    with pytest.raises(PluginError) as caught:
        Trainer(config, registry)
    assert str(caught.value).startswith(
        "strategy 'probe_strategy' (plugin probe_good) failed to apply: RuntimeError: cannot wrap Llama3"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_model_that_builds_is_unaffected(tmp_path: Path) -> None:
    rows = train(_config(tmp_path), _registry(_probe_model(_refusing_build)))
    assert [r["step"] for r in rows] == [1, 2]
    assert not (tmp_path / "plugin_error.log").exists()


# -- 2. model arguments as a dict, attrs or dataclass -------------------------------------------------


@dataclasses.dataclass
class _DataArgs:
    vocab_size: int = 10
    bos_id: int | None = None


@attrs.define
class _AttrsArgs:
    vocab_size: int = 10
    bos_id: int | None = None


@pytest.mark.parametrize("args", [{"vocab_size": 10, "bos_id": None}, _DataArgs(), _AttrsArgs()])
def test_model_arguments_are_read_alike_from_dict_attrs_and_dataclass(args: Any) -> None:
    from titan_core.layout import model_arg

    assert model_arg(args, "vocab_size") == 10
    assert model_arg(args, "bos_id", "absent") is None
    assert model_arg(args, "max_seq_len") is None
    assert model_arg(args, "max_seq_len", "absent") == "absent"


def _dict_model() -> _Probe:
    """The tiny Llama 3 with its arguments as a plain dict (a form docs/plugins.md shows)."""
    from titan_plugins_llama3.flavors import Llama3Args

    llama3 = _llama3(Registry().load_entry_points())

    def typed(fn: Any) -> Any:
        return lambda args, *rest: fn(Llama3Args(**args), *rest)

    def build(args: dict) -> Any:
        from titan_plugins_llama3.model import build as build_llama3

        return build_llama3(Llama3Args(**args))

    spec = attrs.evolve(
        llama3,
        name="probe_tiny",
        flavors={"tiny": attrs.asdict(llama3.flavors["debugmodel"])},
        build=build,
        num_params=typed(llama3.num_params),
        flops_per_token=typed(llama3.flops_per_token),
        validate=typed(llama3.validate),
        state_dict_adapter=None,
    )
    return _Probe(models=[spec])


def test_dict_model_args_vocab_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    expected = "tokenizer has .* tokens but model probe_tiny/tiny has a vocabulary of 100"
    with pytest.raises(UsageError, match=expected):
        Trainer(_config(tmp_path, vocab_size=100), _registry(_dict_model()))


def test_dict_model_args_max_seq_len_is_checked(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"training\.seq_len=32 exceeds the model's max_seq_len=16"):
        Trainer(_config(tmp_path, max_seq_len=16), _registry(_dict_model()))


def test_dict_model_args_get_the_tokenizers_bos_id(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path), _registry(_dict_model()))
    try:
        assert trainer.model_args["bos_id"] == trainer.tokenizer.bos_id is not None
    finally:
        trainer.close()


# -- 3. a callback's metrics ------------------------------------------------------------------------


def _metrics_callback(values: Any) -> _Probe:
    class Reporter:
        def metrics(self, step: int) -> Any:
            return values

    return _Probe(callbacks=[Callback("probe_metrics", lambda trainer: Reporter())])


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"probe/name": "hello"}, r"'probe/name' = 'hello' \(str\)"),
        ({"probe/norm": None}, r"'probe/norm' = None \(NoneType\)"),
        ({"probe/list": [1.0]}, r"'probe/list' = \[1\.0\] \(list\)"),
        (None, r"returned NoneType, not a mapping"),
    ],
)
def test_a_non_numeric_callback_metric_is_refused(tmp_path: Path, values: Any, expected: str) -> None:
    registry = _registry(_metrics_callback(values))
    config = tiny_llama3(tmp_path, 2)
    with pytest.raises(PluginError, match=r"^callback 'probe_metrics' \(plugin probe_good\): .*" + expected):
        train(config, registry)
    assert not (tmp_path / "metrics.jsonl").read_text()  # the bad row is written nowhere


def test_a_tensor_callback_metric_is_refused_with_a_hint(tmp_path: Path) -> None:
    import torch

    registry = _registry(_metrics_callback({"probe/t": torch.tensor(1.0)}))
    with pytest.raises(PluginError, match=r"'probe/t' = .*\(Tensor\).*\.item\(\)"):
        train(tiny_llama3(tmp_path, 2), registry)


def test_numeric_callback_metrics_reach_the_metric_writers(tmp_path: Path) -> None:
    values = {
        "probe/flag": True,
        "probe/count": 3,
        "probe/ratio": 0.5,
        "probe/nan": math.nan,
        "probe/inf": -math.inf,
    }
    rows = train(tiny_llama3(tmp_path, 2), _registry(_metrics_callback(values)))
    assert rows[0]["probe/count"] == 3
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # A bool as the number 1, which titan compare reads (it refuses `true`).
    assert written[0]["probe/flag"] == 1 and written[0]["probe/flag"] is not True
    assert written[0]["probe/ratio"] == 0.5
    # JSON has no NaN or infinity: null in the file, the values themselves in the rows.
    assert written[0]["probe/nan"] is None and written[0]["probe/inf"] is None
    assert math.isnan(rows[0]["probe/nan"]) and rows[0]["probe/inf"] == -math.inf


# -- 4. a callback's metric names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["loss", "step", "grad_norm", "lr", "tps", "step_time_s", "eta", "event", "rank", "validation/loss"],
)
def test_a_callback_metric_named_like_titans_own_is_refused(tmp_path: Path, key: str) -> None:
    # "loss" replaced the trained loss in the log line, metrics.jsonl and the run summary without a
    # word; "eta" or "event" ended the run in a TypeError from inside structlog.
    registry = _registry(_metrics_callback({key: 123.0}))
    with pytest.raises(
        PluginError, match=rf"^callback 'probe_metrics' \(plugin probe_good\): .*{key!r}.*titan"
    ):
        train(tiny_llama3(tmp_path, 2), registry)
    assert not (tmp_path / "metrics.jsonl").read_text()  # no row with a replaced value


def test_every_name_of_titans_own_row_is_reserved(tmp_path: Path) -> None:
    from titan_core.callbacks import reserved_metric

    rows = train(tiny_llama3(tmp_path, 2), _registry(_Probe()))
    assert rows and all(reserved_metric(key) for key in rows[0])


def test_two_callbacks_reporting_one_metric_name_are_refused_naming_both(tmp_path: Path) -> None:
    class Sometimes:  # reports only on some steps: the clash is found when it first reports
        def metrics(self, step: int) -> dict[str, float]:
            return {"shared/x": 2.0} if step == 2 else {}

    class Always:
        def metrics(self, step: int) -> dict[str, float]:
            return {"shared/x": 1.0, "always/y": 0.5}

    probe = _Probe(
        callbacks=[Callback("always", lambda t: Always()), Callback("sometimes", lambda t: Sometimes())]
    )
    config = tiny_llama3(tmp_path, 3)
    config.metrics.log_freq = 1
    with pytest.raises(
        PluginError,
        match=r"^callback 'sometimes' \(plugin probe_good\): metrics\(step\) returned 'shared/x', which "
        r"callback 'always' \(plugin probe_good\) reports too",
    ):
        train(config, _registry(probe))
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["shared/x"] for row in written] == [1.0]  # step 1 only: step 2 never written


def test_a_callback_reporting_on_some_steps_only_keeps_its_name(tmp_path: Path) -> None:
    class Sometimes:
        def metrics(self, step: int) -> dict[str, float]:
            return {"some/x": float(step)} if step % 2 == 0 else {}

    config = tiny_llama3(tmp_path, 4)
    config.metrics.log_freq = 1
    rows = train(config, _registry(_Probe(callbacks=[Callback("sometimes", lambda t: Sometimes())])))
    assert [row.get("some/x") for row in rows] == [None, 2.0, None, 4.0]


def test_a_num_params_other_than_the_built_models_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model plugin whose ``num_params`` misses parameters (1000 for a model of 133K) went on
    without a word: the log's ``params_total``, ``--print-config``, ``titan models list`` and the
    initialisation's memory threshold took the plugin's figure."""
    import titan_core.trainer as trainer_module

    seen: list[str] = []
    real = trainer_module.log

    class Log:
        def warning(self, event: str, **fields: Any) -> None:
            seen.append(event)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(trainer_module, "log", Log())
    Trainer(_config(tmp_path), _registry(_counting_model(num_params=lambda args, emb: 1000))).close()
    warned = [w for w in seen if "num_params" in w]
    assert len(warned) == 1, seen
    assert warned[0].startswith("model 'probe_tiny' (plugin probe_good) counts 1000 parameters (num_params)")
    assert "the built model has " in warned[0] and "fix ModelSpec.num_params" in warned[0]
    seen.clear()
    Trainer(_config(tmp_path / "b"), _registry(_counting_model())).close()
    assert not [w for w in seen if "num_params" in w]
