"""Bad values of the ``float8`` section, set in a recipe: each is one ``titan: error:`` naming the
field and what to change (exit 2), or accepted."""

from __future__ import annotations

import pytest

from tests.plugins.config_probes import ConfigProbe

ON = {"float8.enable": "True"}

PROBES = [
    ({"float8.enable": "1"}, "float8.enable: expected bool, got int"),
    ({"float8.enable": "None"}, "float8.enable: expected bool, got None"),
    ({**ON, "float8.recipe": "'Tensorwise'"}, "float8.recipe: expected one of tensorwise, rowwise"),
    ({**ON, "float8.recipe": "'tensor_wise'"}, "float8.recipe: expected one of tensorwise, rowwise"),
    ({**ON, "float8.recipe": "'rowwise_with_gw_hp'"}, "float8.recipe: expected one of tensorwise, rowwise"),
    ({**ON, "float8.recipe": "''"}, "float8.recipe: expected one of"),
    ({**ON, "float8.recipe": "None"}, "float8.recipe: expected one of"),
    ({**ON, "float8.filter_fqns": "'output,'"}, "float8.filter_fqns: expected comma-separated module names"),
    ({**ON, "float8.filter_fqns": "',output'"}, "float8.filter_fqns: expected comma-separated module names"),
    ({**ON, "float8.filter_fqns": "'a,,b'"}, "float8.filter_fqns: expected comma-separated module names"),
    ({**ON, "float8.filter_fqns": "['output']"}, "float8.filter_fqns: expected str, got list"),
    ({**ON, "float8.filter_fqns": "None"}, "float8.filter_fqns: expected str, got None"),
    ({**ON, "float8.filter_fqns": "''"}, None),  # none kept: the run warns the output is converted
    ({**ON, "float8.emulate": "1"}, "float8.emulate: expected bool, got int"),
    ({"float8.recipe": "'rowwise'"}, "float8.recipe: 'rowwise' does nothing with float8.enable = False"),
    ({"float8.emulate": "True"}, "float8.emulate: True does nothing with float8.enable = False"),
    ({"float8.filter_fqns": "'output,router'"}, "float8.filter_fqns: 'output,router' does nothing with"),
]


@pytest.mark.parametrize(("settings", "expected"), PROBES, ids=lambda v: str(v)[:60])
def test_a_float8_value(settings: dict[str, str], expected: str | None, config_probe: ConfigProbe) -> None:
    config_probe(settings, expected)
