"""DeepSeek-V3 weights: Hugging Face's ``DeepseekV3ForCausalLM`` checkpoints <-> jaxscale's DeepSeek-V3-style model
(:mod:`jaxscale.models.deepseek`); the table and configs :mod:`jaxscale.hf.convert` streams through.

Layer ``i`` of HF is ``dense`` slot ``i`` for ``i < k`` (``first_k_dense_replace``, ``model.deepseek.dense_layers``),
``blocks`` slot ``i - k`` after; ``[out, in]`` HF matrices become ``[in..., out...]``:

===============================================  ==============================================================
Hugging Face, layer ``i``, expert ``e``           jaxscale (a block's parameters)
===============================================  ==============================================================
``self_attn.q_a_proj [Rq, D]``, ``q_a_layernorm``  ``attn.wq_a [D, Rq]``, ``attn.q_norm.scale``
``self_attn.q_b_proj [H·(n+r), Rq]``              ``attn.wq_b [Rq, H, n+r]`` (rotary columns reordered)
``self_attn.q_proj`` (``q_lora_rank: null``)      ``attn.wq [D, H, n+r]`` (likewise)
``self_attn.kv_a_proj_with_mqa [Rkv+r, D]``       ``attn.wkv_a [D, Rkv+r]`` (likewise)
``self_attn.kv_a_layernorm``                      ``attn.kv_norm.scale``
``self_attn.kv_b_proj [H·(n+v), Rkv]``            ``attn.wkv_b [Rkv, H, n+v]``
``self_attn.o_proj [D, H·v]``                     ``attn.wo [H, v, D]``
``mlp.gate/up/down_proj`` (dense layers)          ``mlp.w_gate/w_up/w_down``
``mlp.gate.weight [E, D]``                        ``routed.router [D, E]``
``mlp.gate.e_score_correction_bias [E]``          ``routed.bias [E]`` (``TrainState.balance``, not a parameter)
``mlp.experts.e.gate/up/down_proj``               ``routed.w_gate/w_up/w_down [E, ...]``
``mlp.shared_experts.gate/up/down_proj``          ``mlp.w_gate/w_up/w_down``
``input_layernorm``, ``post_attention_layernorm``  ``attn_norm.scale``, ``mlp_norm.scale``
===============================================  ==============================================================

**RoPE**: DeepSeek's checkpoints (``rope_interleave: true``) rotate adjacent columns as pairs; ours rotates column
``j`` with ``j + r/2`` (rotate-half). Our rotated columns are HF's even ones, then its odd ones: a permutation of the
columns of ``q_b_proj``/``q_proj`` (each head's last ``r``) and of ``kv_a_proj_with_mqa`` (its last ``r``), exact
both ways; transformers' rotation of the interleaved pairs returns them in that order, so the scores agree.
**Routing**: sigmoid scores, group-limited (``n_group``, ``topk_group``), gates renormalised (``norm_topk_prob``)
and scaled by ``routed_scaling_factor`` (``model.deepseek.routed_scale``); the generated model is dropless, with
DeepSeek-V3's bias balancing. **The routing bias** (``mlp.gate.e_score_correction_bias [E]``, added to the scores
for the choice of experts only) is ``routed.bias``: balancing state in jaxscale (``TrainState.balance``, not a
parameter), written to the converted checkpoint's ``balance/`` and read by ``checkpoint.init_from`` into the state
the run starts from; exported from that (or a run's state), float32 whatever ``--dtype`` (transformers keeps it
float32), zeros where the model has none (``model.moe.balance: off``; importing non-zero biases into such a
model is refused). **Multi-token prediction**:
transformers' model has none and skips DeepSeek's MTP layers (layer ``num_hidden_layers + j`` for depth ``j``), so the
generated model has ``mtp_depth: 0`` and the MTP layers are left out; with ``--config`` setting
``deepseek.mtp_depth`` they are read: ``enorm``, ``hnorm``, ``eh_proj [D, 2D]`` (the embedding's half first),
``shared_head.norm`` and an MoE block are ``mtp.j.embed_norm``, ``hidden_norm``, ``proj [2, D, D]``, ``out_norm`` and
``block``; their ``embed_tokens`` and ``shared_head.head`` (copies of the shared embedding and head) are left out on
import and not written on export. YaRN rope scaling (DeepSeek-V3's long context) is refused by
:mod:`jaxscale.hf.convert`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxscale.config.read import ConfigError, DeepSeekConfig, ModelConfig, MoEConfig
from jaxscale.hf.weights import Weight, hf_int

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"


def model_from_hf(hf: dict[str, Any], model: ModelConfig) -> ModelConfig:
    """``model`` (what :func:`jaxscale.hf.models.model_from_hf` read of every decoder) with DeepSeek-V3's MLA, MoE
    and dense layers from the HF ``config.json`` ``hf``."""
    q_rank = hf.get("q_lora_rank")
    d = DeepSeekConfig(
        q_lora_rank=None if q_rank is None else hf_int(hf, "q_lora_rank"),
        kv_lora_rank=hf_int(hf, "kv_lora_rank"),
        qk_nope_head_dim=hf_int(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=hf_int(hf, "qk_rope_head_dim"),
        v_head_dim=hf_int(hf, "v_head_dim"),
        dense_layers=int(hf.get("first_k_dense_replace") or 0),
        routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
        mtp_depth=0,
    )
    moe = MoEConfig(
        experts=hf_int(hf, "n_routed_experts"),
        top_k=hf_int(hf, "num_experts_per_tok"),
        mlp=hf_int(hf, "moe_intermediate_size"),
        shared_experts=int(hf.get("n_shared_experts") or 0),
        dispatch="dropless",
        router="sigmoid",
        normalize_gates=bool(hf.get("norm_topk_prob", True)),
        groups=hf_int(hf, "n_group", 1),
        top_groups=hf_int(hf, "topk_group", 1),
        balance="sign",
        aux_loss_weight=0.0001,
        z_loss_weight=0.0,
    )
    heads = model.heads
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"config.json: num_key_value_heads ({hf['num_key_value_heads']}) differs from "
                          f"num_attention_heads ({heads}): multi-head latent attention has a key per head")
    if model.rope_scaling is not None:
        raise ConfigError("config.json: llama3 rope scaling on DeepSeek-V3 (its rotary part takes the default RoPE)")
    head_dim = d.qk_nope_head_dim + d.qk_rope_head_dim
    return dataclasses.replace(model, kv_heads=heads, head_dim=head_dim, moe=moe, deepseek=d)


def hf_config(model: ModelConfig, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF ``config.json`` of the DeepSeek-V3-style ``model`` (over ``base``, the config it was imported from)."""
    moe, d = model.moe, model.deepseek
    if moe.router != "sigmoid" or model.rope_scaling is not None:
        raise ConfigError("DeepSeek-V3 export: needs model.moe.router=sigmoid and no model.rope_scaling")
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "torch_dtype")}
    out.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": model.vocab_size, "hidden_size": model.embed, "intermediate_size": model.mlp,
        "moe_intermediate_size": moe.mlp or model.mlp, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.heads,
        "n_shared_experts": moe.shared_experts, "n_routed_experts": moe.experts, "num_experts_per_tok": moe.top_k,
        "n_group": moe.groups, "topk_group": moe.top_groups, "norm_topk_prob": moe.normalize_gates,
        "routed_scaling_factor": d.routed_scale, "first_k_dense_replace": d.dense_layers,
        "q_lora_rank": d.q_lora_rank, "kv_lora_rank": d.kv_lora_rank, "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim, "v_head_dim": d.v_head_dim,
        "num_nextn_predict_layers": d.mtp_depth, "hidden_act": "silu", "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}, "rope_interleave": True,
        "attention_bias": False, "tie_word_embeddings": model.tie_embeddings, "dtype": dtype,
    })
    return out


def rotary_columns(width: int, rope: int) -> tuple[int, ...]:
    """Ours' order of HF's last dimension of ``width`` columns whose last ``rope`` are rotated in adjacent pairs:
    the others as they are, then the rotated pairs' first columns, then their second ones."""
    start = width - rope
    return (*range(start), *range(start, width, 2), *range(start + 1, width, 2))


def block(path: tuple[str | int, ...], hf: str, model: ModelConfig, moe: bool) -> list[Weight]:
    """The table of one block (``path`` ours, ``hf`` the HF prefix, with ``{i}`` when stacked)."""
    d = model.deepseek
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    attn, mlp = hf + "self_attn.", hf + "mlp."
    q_columns = rotary_columns(qk, d.qk_rope_head_dim)
    table = [
        Weight((*path, "attn_norm", "scale"), hf + "input_layernorm.weight", None),
        Weight((*path, "mlp_norm", "scale"), hf + "post_attention_layernorm.weight", None),
        Weight((*path, "attn", "wkv_a"), attn + "kv_a_proj_with_mqa.weight",
               columns=rotary_columns(d.kv_lora_rank + d.qk_rope_head_dim, d.qk_rope_head_dim)),
        Weight((*path, "attn", "kv_norm", "scale"), attn + "kv_a_layernorm.weight", None),
        Weight((*path, "attn", "wkv_b"), attn + "kv_b_proj.weight"),
        Weight((*path, "attn", "wo"), attn + "o_proj.weight", 2),
    ]
    if d.q_lora_rank:
        table += [
            Weight((*path, "attn", "wq_a"), attn + "q_a_proj.weight"),
            Weight((*path, "attn", "q_norm", "scale"), attn + "q_a_layernorm.weight", None),
            Weight((*path, "attn", "wq_b"), attn + "q_b_proj.weight", columns=q_columns),
        ]
    else:
        table.append(Weight((*path, "attn", "wq"), attn + "q_proj.weight", columns=q_columns))
    dense = mlp + ("shared_experts." if moe else "")
    if not moe or model.moe.shared_experts:
        table += [Weight((*path, "mlp", f"w_{name}"), f"{dense}{name}_proj.weight") for name in ("gate", "up", "down")]
    if moe:
        table.append(Weight((*path, "routed", "router"), mlp + "gate.weight"))
        table.append(Weight((*path, "routed", "bias"), mlp + "gate.e_score_correction_bias", None, balance=True))
        table += [Weight((*path, "routed", f"w_{name}"), mlp + "experts.{e}." + f"{name}_proj.weight")
                  for name in ("gate", "up", "down")]
    return table


def weights(model: ModelConfig) -> list[Weight]:
    """The table of every parameter of the DeepSeek-V3-style ``model``."""
    d, layer = model.deepseek, "model.layers.{i}."
    k = d.dense_layers
    table = [Weight(("embedding",), "model.embed_tokens.weight", None),
             Weight(("final_norm", "scale"), "model.norm.weight", None)]
    if not model.tie_embeddings:
        table.append(Weight(("lm_head",), "lm_head.weight"))
    if k:
        table += [dataclasses.replace(w, first=0, count=k) for w in block(("dense",), layer, model, False)]
    table += [dataclasses.replace(w, first=k, count=model.layers - k) for w in block(("blocks",), layer, model, True)]
    for j in range(d.mtp_depth):
        hf = f"model.layers.{model.layers + j}."
        table += [
            Weight(("mtp", j, "embed_norm", "scale"), hf + "enorm.weight", None),
            Weight(("mtp", j, "hidden_norm", "scale"), hf + "hnorm.weight", None),
            Weight(("mtp", j, "proj"), hf + "eh_proj.weight", 2),
            Weight(("mtp", j, "out_norm", "scale"), hf + "shared_head.norm.weight", None),
            *block(("mtp", j, "block"), hf, model, True),
        ]
    return table


def left_out(model: ModelConfig, name: str) -> bool:
    """Whether the HF tensor ``name`` is knowingly not imported: the MTP layers past ``mtp_depth``, and the MTP
    layers' copies of the shared embedding and head."""
    found = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if found is None or int(found[1]) < model.layers:
        return False
    return int(found[1]) >= model.layers + model.deepseek.mtp_depth or found[2] in (
        "embed_tokens.weight", "shared_head.head.weight")
