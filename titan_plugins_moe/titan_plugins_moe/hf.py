"""State-dict and config conversion to and from Hugging Face ``transformers``.

Three counterparts, chosen from the model arguments (:func:`hf_architecture`):

* ``Qwen3MoeForCausalLM`` (``qwen3_moe``): grouped-query attention with q/k norm, softmax
  scores, no shared expert, leading dense layers as ``mlp_only_layers``;
* ``DeepseekV3ForCausalLM`` (``deepseek_v3``): MLA with sigmoid scores, the selection bias
  (``e_score_correction_bias``), group-limited routing, routed scaling factor, shared experts;
* ``DeepseekV2ForCausalLM`` (``deepseek_v2``): MLA with softmax scores, greedy top-k, no
  renormalisation (DeepSeek-V2-Lite).

Multi-token-prediction modules go where DeepSeek's checkpoints keep them: module ``k`` is layer
``n_layers + k`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of the embedding
and output as ``embed_tokens`` and ``shared_head.head``, and a decoder layer); transformers skips
them when loading. :func:`args_from_hf` builds the main model (``n_mtp_layers = 0``); a run
loads as many MTP modules as it has (:func:`for_run`): with ``model.overrides.n_mtp_layers`` it
loads a checkpoint's MTP weights too, without it drops them.

Expert weights are written in the Hub layout (``mlp.experts.{j}.gate_proj.weight`` ...), the one
``from_pretrained`` of every transformers release reads; :func:`from_hf` also takes the fused
in-memory layout of transformers 5 (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
Qwen3's Hugging Face RoPE rotates the two halves of a head where titan rotates interleaved
pairs: the query/key rows and the q/k norm weights are permuted on the way (DeepSeek's MLA
rotates interleaved pairs in both, with ``rope_interleave = true``).

The functions work on ``{name: tensor}`` dicts of full tensors and import nothing heavy at
module level (the plugin module imports this one).
"""

from __future__ import annotations

from typing import Any

import attrs

from titan_core.errors import UsageError
from titan_plugins_moe.flavors import MoEArgs, yarn_attention_factor

_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


def hf_architecture(args: MoEArgs) -> str:
    """The Hugging Face ``model_type`` equal to ``args``; a :class:`UsageError` when none is."""
    mismatches: dict[str, tuple[Any, Any]]
    if args.attention == "gqa":
        mismatches = {
            "qk_norm": (args.qk_norm, True),
            "shared_expert_hidden_dim": (args.shared_expert_hidden_dim, 0),
            "score_func": (args.score_func, "softmax"),
            "route_scale": (args.route_scale, 1.0),
            "n_expert_groups": (args.n_expert_groups, 1),
        }
        kind = "qwen3_moe"
    elif args.score_func == "sigmoid":
        shared_ok = args.shared_expert_hidden_dim % args.expert_hidden_dim == 0
        mismatches = {"shared_expert_hidden_dim (a multiple of expert_hidden_dim)": (shared_ok, True)}
        if args.n_expert_groups > 1 and args.n_experts // args.n_expert_groups < 2:
            # titan scores a group of one expert by that expert; transformers sums each group's
            # two best experts and fails on its first forward: the folder would not run there.
            mismatches["n_expert_groups"] = (args.n_expert_groups, "at most n_experts / 2")
        kind = "deepseek_v3"
    else:
        shared_ok = args.shared_expert_hidden_dim % args.expert_hidden_dim == 0
        # Its greedy top-k scales the weights by routed_scaling_factor (any route_scale).
        mismatches = {
            "route_norm": (args.route_norm, False),
            "n_expert_groups": (args.n_expert_groups, 1),
            "shared_expert_hidden_dim (a multiple of expert_hidden_dim)": (shared_ok, True),
        }
        kind = "deepseek_v2"
    mismatches["rope_scaling ('none' or 'yarn')"] = (args.rope_scaling != "llama3", True)
    if kind != "deepseek_v3":
        mismatches["n_mtp_layers"] = (args.n_mtp_layers, 0)
    bad = [f"{name}={have!r} (needs {want!r})" for name, (have, want) in mismatches.items() if have != want]
    if bad:
        raise UsageError(
            f"model moe: these arguments have no Hugging Face {_ARCHITECTURES[kind]} counterpart: "
            f"{', '.join(bad)}; export a flavor that matches it (qwen3_*, deepseek_*)"
        )
    return kind


# -- Qwen3's RoPE layout: halves in Hugging Face, interleaved pairs in titan ------------------------


def _to_halves(w: Any, head_dim: int) -> Any:
    """Rows of each head from interleaved pairs ``(2i, 2i+1)`` to halves ``(i, i + hd/2)``."""
    shape = w.shape
    return w.reshape(-1, head_dim // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _to_pairs(w: Any, head_dim: int) -> Any:
    shape = w.shape
    return w.reshape(-1, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape)


# -- name maps -------------------------------------------------------------------------------------


def _attention_names(args: MoEArgs) -> dict[str, str]:
    """titan attention suffix -> Hugging Face ``self_attn`` suffix."""
    if args.attention == "gqa":
        names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
        if args.qk_norm:
            names.update({"q_norm": "q_norm", "k_norm": "k_norm"})
        return names
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    if args.q_lora_rank:
        names.update({"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"})
    else:
        names["wq"] = "q_proj"
    return names


_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _block_names(t: str, h: str, args: MoEArgs, kind: str, dense: bool) -> dict[str, str]:
    """One block's one-to-one tensors: titan prefix ``t`` (``layers.3.``), Hugging Face ``h``."""
    names = {t + "attention_norm.weight": h + "input_layernorm.weight"}
    names[t + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
    for ours, theirs in _attention_names(args).items():
        names[f"{t}attention.{ours}.weight"] = f"{h}self_attn.{theirs}.weight"
    if dense:
        for ours, theirs in _SWIGLU.items():
            names[f"{t}feed_forward.{ours}.weight"] = f"{h}mlp.{theirs}.weight"
        return names
    names[t + "feed_forward.router.gate.weight"] = h + "mlp.gate.weight"
    if kind == "deepseek_v3":
        names[t + "feed_forward.router.expert_bias"] = h + "mlp.gate.e_score_correction_bias"
    if args.shared_expert_hidden_dim:
        for ours, theirs in _SWIGLU.items():
            names[f"{t}feed_forward.shared_expert.{ours}.weight"] = f"{h}mlp.shared_experts.{theirs}.weight"
    return names


def _moe_blocks(args: MoEArgs) -> list[tuple[int, str, str]]:
    """``(block, titan prefix, Hugging Face prefix)`` of every MoE block, MTP modules' included
    (DeepSeek's checkpoints put MTP module ``k`` at layer ``n_layers + k``)."""
    blocks = [(i, f"layers.{i}.", f"model.layers.{i}.") for i in range(args.n_dense_layers, args.n_layers)]
    blocks += [
        (args.n_layers + k, f"mtp.{k}.block.", f"model.layers.{args.n_layers + k}.")
        for k in range(args.n_mtp_layers)
    ]
    return blocks


def _plain_names(args: MoEArgs, kind: str) -> dict[str, str]:
    """Every one-to-one tensor: titan name -> Hugging Face name."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        names.update(_block_names(f"layers.{i}.", f"model.layers.{i}.", args, kind, i < args.n_dense_layers))
    for k in range(args.n_mtp_layers):
        t, h = f"mtp.{k}.", f"model.layers.{args.n_layers + k}."
        names.update(_block_names(t + "block.", h, args, kind, dense=False))
        names.update(
            {
                t + "enorm.weight": h + "enorm.weight",
                t + "hnorm.weight": h + "hnorm.weight",
                t + "eh_proj.weight": h + "eh_proj.weight",
                t + "norm.weight": h + "shared_head.norm.weight",
            }
        )
    return names


def _permuted(args: MoEArgs, kind: str) -> set[str]:
    """titan names whose rows Qwen3's Hugging Face layout orders by RoPE halves."""
    if kind != "qwen3_moe":
        return set()
    suffixes = ["wq.weight", "wk.weight", *(["q_norm.weight", "k_norm.weight"] if args.qk_norm else [])]
    return {f"layers.{i}.attention.{s}" for i in range(args.n_layers) for s in suffixes}


def _missing(what: str, names: list[str]) -> UsageError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return UsageError(f"Hugging Face conversion: {what}: {shown}")


# -- the adapter ------------------------------------------------------------------------------------


def to_hf(state_dict: dict[str, Any], args: MoEArgs) -> dict[str, Any]:
    """titan state dict -> Hugging Face (Hub layout)."""
    kind = hf_architecture(args)
    names, permuted = _plain_names(args, kind), _permuted(args, kind)
    absent = [k for k in names if k not in state_dict]
    if absent:
        raise _missing("the state dict lacks", absent)
    out = {}
    for ours, theirs in names.items():
        value = state_dict[ours]
        out[theirs] = _to_halves(value, args.attn_head_dim) if ours in permuted else value
    for k in range(args.n_mtp_layers):  # DeepSeek's MTP layers carry their own copies of both
        h = f"model.layers.{args.n_layers + k}."
        out[h + "embed_tokens.weight"] = state_dict["tok_embeddings.weight"].clone()
        out[h + "shared_head.head.weight"] = state_dict["output.weight"].clone()
    for i, tb, hb in _moe_blocks(args):
        t, h = tb + "feed_forward.", hb + "mlp."
        bias = state_dict.get(t + "router.expert_bias")
        if kind != "deepseek_v3" and bias is not None and bool((bias != 0).any()):
            raise UsageError(
                f"Hugging Face conversion: layer {i} has a non-zero expert selection bias (trained "
                f"with moe.bias_update_rate > 0), which {_ARCHITECTURES[kind]} has no place for; "
                "exporting would change the routing"
            )
        for ours, theirs in _SWIGLU.items():
            stacked = state_dict[f"{t}experts.{ours}"]
            for j in range(args.n_experts):
                out[f"{h}experts.{j}.{theirs}.weight"] = stacked[j]
    return out


def _beyond_mtp(name: str, args: MoEArgs) -> bool:
    """Whether ``name`` is a tensor of a layer past the run's MTP modules."""
    parts = name.split(".")
    return (
        len(parts) > 2
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and (int(parts[2]) >= args.n_layers + args.n_mtp_layers)
    )


def for_run(hf_args: MoEArgs, run_args: MoEArgs) -> MoEArgs:
    """A folder's arguments as a run may load them: with the run's number of MTP modules.

    ``num_nextn_predict_layers`` cannot decide it: transformers writes 1 in every DeepSeek-V3
    folder and saves no MTP weights, DeepSeek's own checkpoints hold them. The tensors decide
    instead: MTP weights beyond the run's are dropped (:func:`from_hf`), and ones the run needs
    but the folder lacks are named as missing.
    """
    return attrs.evolve(hf_args, n_mtp_layers=run_args.n_mtp_layers)


def from_hf(state_dict: dict[str, Any], args: MoEArgs) -> dict[str, Any]:
    """Hugging Face state dict (Hub layout or transformers 5's fused experts) -> titan."""
    import torch

    kind = hf_architecture(args)
    # A checkpoint's MTP modules beyond the run's (layers n_layers + n_mtp_layers and up): the
    # run builds fewer of them, or only the main model, as transformers does.
    # Only the names are looked at (``keys()``): a caller may track which tensors were read.
    beyond = [k for k in state_dict.keys() if _beyond_mtp(k, args)]  # noqa: SIM118
    if beyond and len(beyond) == len(state_dict):
        return {}
    names, permuted = _plain_names(args, kind), _permuted(args, kind)
    absent = [theirs for theirs in names.values() if theirs not in state_dict]
    if absent:
        raise _missing("the Hugging Face state dict lacks", absent)
    out = {}
    for ours, theirs in names.items():
        value = state_dict[theirs]
        out[ours] = _to_pairs(value, args.attn_head_dim) if ours in permuted else value
    if args.tie_embeddings:  # the output projection is the embedding (a tied folder has no lm_head)
        out["output.weight"] = out["tok_embeddings.weight"]
        # Some tools store it anyway: transformers ties it when equal, and unties it (the lm_head
        # computes the logits) when it differs, which a tied model cannot hold.
        head = state_dict.get("lm_head.weight")
        if head is not None and not head.is_meta and not torch.equal(head, out["output.weight"]):
            raise UsageError(
                "Hugging Face conversion: config.json ties the embeddings (tie_word_embeddings = "
                "true), but the folder's lm_head.weight differs from model.embed_tokens.weight, so "
                "transformers unties them and computes the logits with lm_head.weight; set "
                "tie_word_embeddings = false in its config.json and load it into a model with "
                "tie_embeddings = False (model.overrides)"
            )
    for _, tb, hb in _moe_blocks(args):
        t, h = tb + "feed_forward.", hb + "mlp.experts."
        if kind != "deepseek_v3":
            out[t + "router.expert_bias"] = torch.zeros(args.n_experts, dtype=torch.float32)
        if h + "gate_up_proj" in state_dict:  # transformers 5's in-memory layout
            w1, w3 = state_dict[h + "gate_up_proj"].chunk(2, dim=1)
            out.update(
                {t + "experts.w1": w1, t + "experts.w3": w3, t + "experts.w2": state_dict[h + "down_proj"]}
            )
            continue
        for ours, theirs in _SWIGLU.items():
            keys = [f"{h}{j}.{theirs}.weight" for j in range(args.n_experts)]
            absent = [k for k in keys if k not in state_dict]
            if absent:
                raise _missing("the Hugging Face state dict lacks", absent)
            out[f"{t}experts.{ours}"] = torch.stack([state_dict[k] for k in keys])
    return out


def _rope_scaling(args: MoEArgs) -> dict[str, Any] | None:
    if args.rope_scaling != "yarn":
        return None
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": args.rope_scaling_factor,
        "original_max_position_embeddings": args.rope_original_max_len,
        "beta_fast": args.yarn_beta_fast,
        "beta_slow": args.yarn_beta_slow,
    }
    if args.yarn_mscale_all_dim:
        scaling.update({"mscale": args.yarn_mscale, "mscale_all_dim": args.yarn_mscale_all_dim})
    return scaling


def hf_config(args: MoEArgs) -> dict[str, Any]:
    """The ``config.json`` of the exported model."""
    kind = hf_architecture(args)
    common: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.expert_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_experts_per_tok": args.top_k,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling(args),
        "attention_bias": False,
    }
    if kind == "qwen3_moe":
        return {
            **common,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.attn_head_dim,
            "num_experts": args.n_experts,
            "norm_topk_prob": args.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(min(args.n_dense_layers, args.n_layers))),
        }
    deepseek = {
        **common,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.shared_expert_hidden_dim // args.expert_hidden_dim,
        "routed_scaling_factor": args.route_scale,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_group": args.n_expert_groups,
        "topk_group": args.n_limited_groups,
        "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": args.route_norm,
    }
    if kind == "deepseek_v3":
        return {
            **deepseek,
            "rope_interleave": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_nextn_predict_layers": args.n_mtp_layers,
        }
    return {**deepseek, "topk_method": "greedy", "scoring_func": "softmax"}


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE arguments from either ``rope_theta``/``rope_scaling`` or transformers 5's ``rope_parameters``,
    with the defaults transformers fills in (``original_max_position_embeddings``: the top-level
    field, else ``max_position_embeddings``; ``factor``: their ratio). YaRN settings titan does not
    compute (an ``attention_factor`` other than the one it derives, ``truncate = false``) are refused."""
    params = config.get("rope_parameters") or {}
    # transformers moves a top-level rope_theta into rope_parameters only where that has none.
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or params
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return fields
    if kind != "yarn":
        raise UsageError(f"Hugging Face config: rope scaling {kind!r} is not supported (only yarn)")
    original = (
        config.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or config.get("max_position_embeddings", 4096)
    )
    factor = scaling.get("factor") or config.get("max_position_embeddings", 4096) / original
    fields.update(
        rope_scaling="yarn",
        rope_scaling_factor=float(factor),
        rope_original_max_len=int(original),
        yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
        yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
        yarn_mscale=float(scaling.get("mscale") or 0.0),
        yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )
    if scaling.get("truncate", True) is not True:
        raise UsageError(
            f"Hugging Face config: rope_scaling.truncate = {scaling['truncate']!r} is not supported "
            "(titan rounds YaRN's ramp bounds to whole dimensions, as DeepSeek and Qwen: truncate = "
            "True); importing it would give other logits"
        )
    explicit = scaling.get("attention_factor")
    if explicit is not None:
        computed = yarn_attention_factor(MoEArgs(**fields))
        if abs(float(explicit) - computed) > 1e-6 * max(1.0, abs(computed)):
            raise UsageError(
                f"Hugging Face config: rope_scaling.attention_factor = {explicit!r} is not supported "
                f"(titan derives YaRN's cos/sin factor from factor, mscale and mscale_all_dim: "
                f"{computed:.6g}); importing it would give other logits"
            )
    return fields


#: Settings of a Hugging Face config that change what the model computes and that titan's MoE
#: model has no counterpart for: ``(field, the values titan computes, what it does instead)``.
#: Refused rather than dropped: the import would load and give other logits.
_UNSUPPORTED: dict[str, list[tuple[str, tuple[Any, ...], str]]] = {
    "all": [
        ("hidden_act", ("silu",), "SwiGLU experts (silu)"),
        ("attention_bias", (False,), "attention projections without bias"),
        ("mlp_bias", (False,), "expert projections without bias"),
    ],
    "qwen3_moe": [("use_sliding_window", (False,), "full attention in every layer")],
    "deepseek_v3": [
        ("scoring_func", ("sigmoid",), "sigmoid router scores"),
        ("topk_method", ("noaux_tc",), "group-limited top-k over bias-corrected sigmoid scores"),
    ],
    "deepseek_v2": [
        ("scoring_func", ("softmax",), "softmax router scores"),
        # group_limited_greedy scores a group by its best expert, titan's groups by their best two.
        ("topk_method", ("greedy",), "greedy top-k over all experts, without group-limited routing"),
    ],
}


def _refuse_unsupported(config: dict[str, Any], kind: str) -> None:
    for field, computed, what in [*_UNSUPPORTED["all"], *_UNSUPPORTED.get(kind, [])]:
        value = config.get(field, computed[0])
        if value not in computed:
            raise UsageError(
                f"Hugging Face config: {field} = {value!r} is not supported by titan's {kind} model "
                f"({what}: {field} = {computed[0]!r}); importing it would give other logits"
            )


#: transformers' defaults (its ``Qwen3MoeConfig``, ``DeepseekV3Config``, ``DeepseekV2Config``) of
#: the fields :func:`args_from_hf` reads, for a ``config.json`` that leaves some out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        # Not the query heads: a file without it has grouped-query attention with 4 K/V heads.
        "num_key_value_heads": 4,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 32768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "deepseek_v3": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
        "n_shared_experts": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "deepseek_v2": {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "moe_intermediate_size": 1407,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "n_shared_experts": 2,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "topk_method": "greedy",
    },
}

#: transformers' default number of routed experts (``num_experts`` / ``n_routed_experts``).
_EXPERTS_DEFAULT = {"qwen3_moe": 128, "deepseek_v3": 256, "deepseek_v2": 64}


def _qwen3_dense_layers(config: dict[str, Any], n_experts: int) -> list[int]:
    """The layers transformers' Qwen3-MoE builds with a dense MLP: those in ``mlp_only_layers``
    (any order; indices past the last layer name none) and, without experts or where ``(i + 1)``
    is not a multiple of ``decoder_sparse_step``, the others too."""
    only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    n_layers = config["num_hidden_layers"]
    return [i for i in range(n_layers) if i in only or n_experts <= 0 or (i + 1) % step]


#: Fields :func:`args_from_hf` reads as numbers, and which of them may be ``null`` (transformers'
#: config types them ``int | None``: no query compression, no shared experts, ...). transformers 5
#: refuses the others' ``null`` or a string (its strict config); titan failed on them with a
#: ``TypeError`` traceback.
_INTEGERS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok"]
_INTEGERS += ["moe_intermediate_size", "max_position_embeddings", "intermediate_size"]
_MLA_INTEGERS = ["n_routed_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
_MLA_INTEGERS += ["first_k_dense_replace"]
_KIND_INTEGERS = {"qwen3_moe": ["num_experts"], "deepseek_v3": _MLA_INTEGERS, "deepseek_v2": _MLA_INTEGERS}
_NULLABLE_INTEGERS = ["num_key_value_heads", "head_dim", "q_lora_rank", "n_shared_experts", "n_group"]
_NULLABLE_INTEGERS += ["topk_group", "decoder_sparse_step", "num_local_experts"]
_NUMBERS = ["rms_norm_eps", "rope_theta", "routed_scaling_factor"]


def _check_types(config: dict[str, Any], kind: str) -> None:
    """One error naming a field whose value is not of the type transformers' config gives it."""

    def refuse(field: str, what: str) -> UsageError:
        return UsageError(
            f"Hugging Face config: {field} = {config[field]!r} is not {what}, as transformers' {kind} "
            "config types it (its model cannot be built from it either); correct it in config.json"
        )

    def is_integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for field in [*_INTEGERS, *_KIND_INTEGERS[kind], *_NULLABLE_INTEGERS]:
        if field not in config or (config[field] is None and field in _NULLABLE_INTEGERS):
            continue
        if not is_integer(config[field]):
            raise refuse(field, "an integer")
    for field in _NUMBERS:
        if field in config and (
            isinstance(config[field], bool) or not isinstance(config[field], (int, float))
        ):
            raise refuse(field, "a number")
    for field in ("rope_scaling", "rope_parameters"):
        if config.get(field) is not None and not isinstance(config[field], dict):
            raise refuse(field, "a table (rope_type, factor, ...) or null")


def args_from_hf(config: dict[str, Any]) -> MoEArgs:
    """Model arguments equal to a Hugging Face ``config.json`` (Qwen3-MoE, DeepSeek-V2/V3)."""
    kind = config.get("model_type")
    if kind not in _ARCHITECTURES:
        raise UsageError(
            f"Hugging Face config: model_type {kind!r} has no titan counterpart in the moe plugin; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    # A field the file leaves out means transformers' default, not titan's: a config without
    # routed_scaling_factor is a DeepSeek-V3 with 2.5, which no tensor of the folder shows.
    # The number of routed experts under the file's name for it, else the name transformers 5
    # writes (``num_local_experts``), else transformers' default.
    n_experts = config.get(
        "num_experts" if kind == "qwen3_moe" else "n_routed_experts",
        config.get("num_local_experts", _EXPERTS_DEFAULT[kind]),
    )
    _check_types(config, kind)
    quantization = config.get("quantization_config")
    if quantization is not None:
        # Quantized tensors read as plain numbers would be other weights (their scales live in
        # separate tensors, e.g. DeepSeek-V3's block-wise FP8 ``weight_scale_inv``).
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UsageError(
            f"Hugging Face config: quantization_config (quant_method {method!r}) is not supported: "
            "titan loads unquantized weights (float32, bfloat16 or float16); dequantize the checkpoint "
            "first (for DeepSeek-V3's FP8 release, its inference/fp8_cast_bf16.py) and drop "
            "quantization_config from config.json"
        )
    config = {**_HF_DEFAULTS[kind], **config}
    _refuse_unsupported(config, kind)
    # Fields transformers has no default for (DeepSeek-V2's num_experts_per_tok: its model cannot
    # be built without it): one error naming the field, not a TypeError in the model's checks.
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    required += ["num_experts_per_tok", "moe_intermediate_size"]
    for field in required:
        if config.get(field) is None:
            raise UsageError(f"Hugging Face config: {field} is not set (transformers has no default for it)")
    common: dict[str, Any] = {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "max_seq_len": config.get("max_position_embeddings", 4096),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "top_k": config["num_experts_per_tok"],
        "expert_hidden_dim": config["moe_intermediate_size"],
        "dense_hidden_dim": config.get("intermediate_size", 0),
        **_rope_fields(config),
    }
    if kind == "qwen3_moe":
        dense = _qwen3_dense_layers(config, n_experts or 0)
        if dense != list(range(len(dense))) or len(dense) == config["num_hidden_layers"]:
            raise UsageError(
                f"Hugging Face config: transformers builds dense layers {dense} of "
                f"{config['num_hidden_layers']} (mlp_only_layers = {config.get('mlp_only_layers')}, "
                f"decoder_sparse_step = {config.get('decoder_sparse_step')}, num_experts = {n_experts}); "
                "titan's dense blocks lead the model and at least one MoE block follows them"
            )
        return MoEArgs(
            **common,
            n_kv_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            qk_norm=True,
            n_experts=n_experts,
            shared_expert_hidden_dim=0,
            route_norm=bool(config.get("norm_topk_prob", False)),
            n_dense_layers=len(dense),
        )
    if (config.get("num_key_value_heads") or config["num_attention_heads"]) != config["num_attention_heads"]:
        raise UsageError("Hugging Face config: MLA needs num_key_value_heads = num_attention_heads")
    if kind == "deepseek_v3" and config.get("rope_interleave", True) is False:
        raise UsageError(
            "Hugging Face config: rope_interleave = false is not supported (titan rotates pairs)"
        )
    args = MoEArgs(
        **common,
        attention="mla",
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        n_experts=n_experts,
        shared_expert_hidden_dim=(config.get("n_shared_experts") or 0) * config["moe_intermediate_size"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
    )
    if kind == "deepseek_v3":
        return attrs.evolve(
            args,
            score_func="sigmoid",
            route_norm=bool(config.get("norm_topk_prob", True)),
            n_expert_groups=config.get("n_group") or 1,
            n_limited_groups=config.get("topk_group") or 1,
        )
    # topk_method other than greedy is refused by _refuse_unsupported.
    return attrs.evolve(args, score_func="softmax", route_norm=False)
