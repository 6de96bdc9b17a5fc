"""The ``moe`` config section: load balancing and router statistics of a training run.

The model's architecture (experts, routing, scores) lives in the flavor's arguments
(``config.model.overrides``); how a run balances the experts and what it logs lives here, so a
recipe can change it without touching the architecture. Both balancing methods keep routing
dropless (every token reaches its ``top_k`` experts); they can be used together, as DeepSeek-V3.
"""

from typing import Any, Literal

from titan_core.config import field, finite, non_negative, section


@section
class MoEConfig:
    #: Auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step each expert's
    #: selection bias moves by this much, down when the expert got more than the mean number of
    #: tokens over the data-parallel ranks, up when fewer (the weights stay the unbiased scores).
    #: 0 turns it off; DeepSeek-V3 used 0.001.
    bias_update_rate: float = field(default=0.0, validator=[finite, non_negative])
    #: Weight of the sequence-wise balance loss (DeepSeek-V2/V3: ``sum_i f_i * P_i`` per sequence,
    #: averaged over sequences, 1 when balanced), added to the objective through its gradient; 0
    #: turns it off; DeepSeek-V3 used 0.0001.
    aux_loss_weight: float = field(default=0.0, validator=[finite, non_negative])
    #: Router statistics with the training metrics (log line, TensorBoard, metrics.jsonl):
    #: ``per_layer`` (imbalance = max/mean tokens per expert, and the fewest and most tokens an
    #: expert got, per step, for every MoE layer, plus the summary), ``summary`` (the worst and
    #: mean imbalance over layers) or ``off``.
    router_stats: Literal["off", "summary", "per_layer"] = "per_layer"


#: The models whose MoE layers these settings apply to.
MOE_MODELS = ("moe",)


def check(config: Any) -> list[str]:
    """Balancing settings for a model without routed experts would silently do nothing."""
    moe = config.moe
    if config.model.name in MOE_MODELS:
        return []
    return [
        f"moe.{name}: set to {getattr(moe, name)}, but model.name = {config.model.name!r} has no routed "
        f"experts; set it to 0 or use a MoE model ({', '.join(MOE_MODELS)})"
        for name in ("bias_update_rate", "aux_loss_weight")
        if getattr(moe, name) > 0
    ]
