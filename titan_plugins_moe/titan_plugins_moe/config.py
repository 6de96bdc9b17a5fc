"""The ``moe`` config section: load balancing and router statistics of a training run.

The model's architecture (experts, routing, scores) lives in the flavor's arguments
(``config.model.overrides``); how a run balances the experts and what it logs lives here, so a
recipe can change it without touching the architecture. Both balancing methods keep routing
dropless (every token reaches its ``top_k`` experts); they can be used together, as DeepSeek-V3.
"""

from typing import Any, Literal

import attrs

from titan_core.config import field, section

#: float32's smallest normal and largest finite numbers: the expert bias and the balance loss are
#: float32, where a smaller positive setting is 0 (or a subnormal, 0 where denormals flush) and a
#: larger one is inf.
_FLOAT32_TINY = 1.1754943508222875e-38
_FLOAT32_MAX = 3.4028234663852886e38


def _float32_setting(_inst: Any, _attr: Any, value: float) -> None:
    """Validator: 0 (off), or a positive number float32 holds. A rate of 1e-320 became 0 in the
    float32 bias (``moe/expert_bias_absmax`` 0.0: balancing off without a word), 1e300 became inf
    and the bias NaN (exit 0); a weight of 1e300 stopped the run as a divergence blamed on the
    learning rate. Comparisons only: ``math.isfinite`` raises OverflowError on a huge integer."""
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"expected a number >= 0, got {value!r}")
    if value == 0:
        return
    if value < _FLOAT32_TINY:
        raise ValueError(
            f"{value!r} is below float32's smallest normal number ({_FLOAT32_TINY:.3g}), where it is 0: "
            "nothing would change; use 0 to turn it off, or a value of at least 1.2e-38"
        )
    if value > _FLOAT32_MAX:
        raise ValueError(
            f"{value!r} is beyond float32's largest number ({_FLOAT32_MAX:.3g}), where it is inf and "
            "turns the run's values into NaN; use a smaller value (DeepSeek-V3: 0.001 and 0.0001)"
        )


@section
class MoEConfig:
    #: Auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step each expert's
    #: selection bias moves by this much, down when the expert got more than the mean number of
    #: tokens over the data-parallel ranks, up when fewer (the weights stay the unbiased scores).
    #: 0 turns it off; DeepSeek-V3 used 0.001.
    bias_update_rate: float = field(default=0.0, validator=_float32_setting)
    #: Weight of the sequence-wise balance loss (DeepSeek-V2/V3: ``sum_i f_i * P_i`` per sequence,
    #: averaged over sequences, 1 when balanced), added to the objective through its gradient; 0
    #: turns it off; DeepSeek-V3 used 0.0001.
    aux_loss_weight: float = field(default=0.0, validator=_float32_setting)
    #: Router statistics with the training metrics (log line, TensorBoard, metrics.jsonl):
    #: ``per_layer`` (imbalance = max/mean tokens per expert, and the fewest and most tokens an
    #: expert got, per step, for every MoE layer, plus the summary), ``summary`` (the worst and
    #: mean imbalance over layers) or ``off``.
    router_stats: Literal["off", "summary", "per_layer"] = "per_layer"


#: The models whose MoE layers these settings apply to.
MOE_MODELS = ("moe",)


def check(config: Any) -> list[str]:
    """Settings for a model without routed experts would silently do nothing; a bias rate that
    would take the float32 bias past its range within the run would make it NaN."""
    moe = config.moe
    if config.model.name in MOE_MODELS:
        return _bias_overflow(moe.bias_update_rate, config) if moe.bias_update_rate > 0 else []
    problems = [
        f"moe.{name}: set to {getattr(moe, name)}, but model.name = {config.model.name!r} has no routed "
        f"experts; set it to 0 or use a MoE model ({', '.join(MOE_MODELS)})"
        for name in ("bias_update_rate", "aux_loss_weight")
        if getattr(moe, name) > 0
    ]
    default = attrs.fields(type(moe)).router_stats.default
    if moe.router_stats != default:  # no router, no statistics: the setting changed nothing
        problems.append(
            f"moe.router_stats: {moe.router_stats!r} does nothing with model.name = {config.model.name!r}, "
            f"which has no routers; remove it from the recipe, or use a MoE model ({', '.join(MOE_MODELS)})"
        )
    return problems


def _bias_overflow(rate: float, config: Any) -> list[str]:
    # Each step moves a bias by at most 2 * rate (a sign step, less the layer's mean step), so
    # over training.steps it stays below 2 * rate * steps; past float32's range it is inf, and
    # inf - inf the next step NaN, with which the run routed on and exited 0.
    steps = config.training.steps
    if 2 * rate * steps <= _FLOAT32_MAX:
        return []
    return [
        f"moe.bias_update_rate: {rate:g} moves each expert bias by up to {2 * rate:g} a step, and over "
        f"training.steps = {steps} the float32 bias could pass float32's largest number "
        f"({_FLOAT32_MAX:.3g}) and become inf, then NaN; use a rate below "
        f"{_FLOAT32_MAX / (2 * steps):.3g} (DeepSeek-V3: 0.001)"
    ]
