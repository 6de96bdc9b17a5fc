"""The PP/CP/EP commands of docs/parallelism.md name recipes that exist and fit their NGPU."""

from __future__ import annotations

import re
import types

import pytest

from tests.parallel_harness import REPO
from titan_core.config import validate
from titan_core.parallel_dims import ParallelDims
from titan_plugins_parallel import pipeline


def _section() -> str:
    text = (REPO / "docs" / "parallelism.md").read_text()
    return text[text.index("## Running PP, CP and EP") :]


def _recipes() -> types.ModuleType:
    module = types.ModuleType("pp_cp_ep_recipes")
    exec(_section().split("```python\n", 1)[1].split("```", 1)[0], module.__dict__)
    return module


def _commands() -> list[tuple[int, str]]:
    block = _section().split("```bash\n", 1)[1].split("```", 1)[0]
    found = re.findall(r"NGPU=(\d+) MODULE=pp_cp_ep_recipes CONFIG=(\w+) \./run_train\.sh", block)
    assert len(found) == len(block.strip().splitlines()), block
    return [(int(n), name) for n, name in found]


@pytest.mark.parametrize(("ngpu", "recipe"), _commands())
def test_documented_layout_fits(ngpu: int, recipe: str) -> None:
    config = validate(getattr(_recipes(), recipe)(), source=recipe)
    dims = ParallelDims.from_config(config.parallelism, ngpu)  # the degree errors, if any
    assert dims.pp * dims.cp * dims.ep * dims.dp > 1, "a documented layout that parallelises nothing"
    if dims.pp > 1:
        cls = pipeline.schedule_class(config.parallelism.pp_schedule)
        per_rank = pipeline.stages_per_rank(cls, config.parallelism.pp_stages_per_rank)
        pipeline.microbatches(config, dims.pp * per_rank)
    if dims.cp > 1:
        assert config.training.seq_len % (2 * dims.cp) == 0
    if dims.ep > 1:
        from titan_plugins_moe.flavors import FLAVORS

        assert config.model.name == "moe"
        assert FLAVORS[config.model.flavor].n_experts % dims.ep == 0


def test_moe_doc_recipe_is_registered() -> None:
    from titan_core._registry import get_registry

    text = (REPO / "docs" / "moe.md").read_text()
    assert "titan run --recipe moe_debugmodel" in text
    assert "moe_debugmodel" in get_registry().records("recipes")
