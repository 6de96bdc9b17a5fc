"""Bad values of the ``activation_checkpoint`` and ``compile`` sections, set in a recipe: each is
one ``titan: error:`` naming the field and what to change (exit 2), or accepted."""

from __future__ import annotations

import pytest

from tests.plugins.config_probes import ConfigProbe

SEL = {"activation_checkpoint.mode": "'selective'"}
FULL = {"activation_checkpoint.mode": "'full'"}
BUDGET = {"activation_checkpoint.mode": "'memory_budget'", "compile.enable": "True"}
COMPILE = {"compile.enable": "True"}
AC = "activation_checkpoint"

PROBES = [
    ({f"{AC}.mode": "'Full'"}, f"{AC}.mode: expected one of none, full, selective, memory_budget"),
    ({f"{AC}.mode": "''"}, f"{AC}.mode: expected one of"),
    ({f"{AC}.mode": "None"}, f"{AC}.mode: expected one of"),
    ({f"{AC}.mode": "True"}, f"{AC}.mode: expected one of"),
    ({**SEL, f"{AC}.selective_ac_option": "'0'"}, f"{AC}.selective_ac_option: expected 'op' or a positive"),
    ({**SEL, f"{AC}.selective_ac_option": "'-1'"}, f"{AC}.selective_ac_option: expected 'op' or a positive"),
    ({**SEL, f"{AC}.selective_ac_option": "'2.0'"}, f"{AC}.selective_ac_option: expected 'op' or a positive"),
    ({**SEL, f"{AC}.selective_ac_option": "'OP'"}, f"{AC}.selective_ac_option: expected 'op' or a positive"),
    ({**SEL, f"{AC}.selective_ac_option": "''"}, f"{AC}.selective_ac_option: expected 'op' or a positive"),
    ({**SEL, f"{AC}.selective_ac_option": "2"}, f"{AC}.selective_ac_option: expected str, got int"),
    ({**SEL, f"{AC}.selective_ac_option": "None"}, f"{AC}.selective_ac_option: expected str, got None"),
    ({**SEL, f"{AC}.selective_ac_option": "'02'"}, None),  # every 2nd block
    ({**SEL, f"{AC}.selective_ac_option": "'100'"}, None),  # the run warns that it wraps no block
    ({**FULL, f"{AC}.preserve_rng_state": "1"}, f"{AC}.preserve_rng_state: expected bool, got int"),
    ({**FULL, f"{AC}.determinism_check": "'Default'"}, f"{AC}.determinism_check: expected one of default"),
    ({**FULL, f"{AC}.debug": "0"}, f"{AC}.debug: expected bool, got int"),
    ({**BUDGET, f"{AC}.memory_budget": "1.5"}, f"{AC}.memory_budget: expected a value in [0.0, 1.0]"),
    ({**BUDGET, f"{AC}.memory_budget": "-0.1"}, f"{AC}.memory_budget: expected a value in [0.0, 1.0]"),
    ({**BUDGET, f"{AC}.memory_budget": "nan"}, f"{AC}.memory_budget: expected a value in [0.0, 1.0]"),
    ({**BUDGET, f"{AC}.memory_budget": "inf"}, f"{AC}.memory_budget: expected a value in [0.0, 1.0]"),
    ({**BUDGET, f"{AC}.memory_budget": "True"}, f"{AC}.memory_budget: expected float, got bool"),
    ({**BUDGET, f"{AC}.memory_budget": "'0.5'"}, f"{AC}.memory_budget: expected float, got str"),
    ({**BUDGET, f"{AC}.memory_budget": "0"}, None),
    ({**BUDGET, f"{AC}.memory_budget": "1"}, None),
    ({f"{AC}.mode": "'memory_budget'"}, f"{AC}.mode: 'memory_budget' is a compiler option"),
    ({f"{AC}.memory_budget": "0.3"}, f"{AC}.memory_budget: 0.3 does nothing with mode = 'none'"),
    ({"compile.enable": "1"}, "compile.enable: expected bool, got int"),
    ({"compile.enable": "None"}, "compile.enable: expected bool, got None"),
    ({**COMPILE, "compile.backend": "None"}, "compile.backend: expected str, got None"),
    ({**COMPILE, "compile.backend": "'tvm'"}, "compile.backend: 'tvm' compiles through the package"),
    ({**COMPILE, "compile.autotune": "0"}, "compile.autotune: expected bool, got int"),
    ({"compile.backend": "'aot_eager'"}, "compile.backend: 'aot_eager' does nothing with compile.enable"),
    # Resolved when the blocks compile (torch is not imported for --print-config): see below.
    ({**COMPILE, "compile.backend": "'inducter'"}, None),
]


@pytest.mark.parametrize(("settings", "expected"), PROBES, ids=lambda v: str(v)[:60])
def test_a_parallel_section_value(
    settings: dict[str, str], expected: str | None, config_probe: ConfigProbe
) -> None:
    config_probe(settings, expected)


@pytest.mark.parametrize("name", ["inducter", "", "aot_nonsense"])
def test_an_unknown_compile_backend_is_refused_naming_the_field(name: str) -> None:
    """A misspelt backend passes ``--print-config`` (listing backends imports torch) and is
    refused when the blocks compile, naming the field and the backends there are."""
    from types import SimpleNamespace

    from titan_core.errors import UsageError
    from titan_plugins_parallel import compile as compile_mod

    config = SimpleNamespace(
        compile=SimpleNamespace(backend=name), activation_checkpoint=SimpleNamespace(mode="memory_budget")
    )
    expected = rf"compile.backend = {name!r} is not a torch.compile backend; use one of"
    with pytest.raises(UsageError, match=expected):
        compile_mod.backend(config)
