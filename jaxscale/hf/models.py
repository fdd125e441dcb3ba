"""Hugging Face ``config.json`` <-> the jaxscale model config (:mod:`jaxscale.hf.convert`): what a Llama,
Mixtral, Qwen3-MoE or DeepSeek-V3 (:mod:`jaxscale.hf.convert_deepseek`) ``config.json`` reads as, what cannot be
expressed (a one-line :class:`~jaxscale.config.read.ConfigError`), the ``config.json`` an export writes, and a model
YAML (``--config``) layered over the generated model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxscale.config import bounds
from jaxscale.config.model_checks import validate_deepseek, validate_moe, validate_rope
from jaxscale.config.read import (
    Config,
    ConfigError,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    _build,
    read_yaml,
    resolve_named,
)
from jaxscale.hf import convert_deepseek as deepseek
from jaxscale.hf.weights import hf_int as _hf_int

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    deepseek.MODEL_TYPE: deepseek.ARCHITECTURE,
}


def architecture(model: ModelConfig) -> str:
    """The HF ``model_type`` whose checkpoints hold ``model``: qk-norm and experts make Qwen3-MoE."""
    if model.deepseek is not None:
        return deepseek.MODEL_TYPE
    if model.qk_norm and not model.moe:
        raise ConfigError("model.qk_norm without model.moe: only Qwen3-MoE of the Qwen3 family converts")
    return ("qwen3_moe" if model.qk_norm else "mixtral") if model.moe else "llama"


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the scaling of an HF config (transformers 4's top-level ``rope_theta`` and
    ``rope_scaling``, or 5's ``rope_parameters``): the default RoPE or Llama 3.1's ``llama3``."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope scaling '{kind}' is not supported (jaxscale implements the default "
                          "RoPE and llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ConfigError(f"config.json: llama3 rope scaling without {', '.join(missing)}")
    context = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if context is None:
        raise ConfigError("config.json: llama3 rope scaling without original_max_position_embeddings")
    scaling = RopeScaling(**{k: float(rope[k]) for k in keys}, original_max_position_embeddings=int(context))
    return theta, scaling


def model_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The jaxscale model of an HF ``config.json`` (a mapping); ConfigError for what it cannot express."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"config.json: model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {hf['hidden_act']!r} (jaxscale's MLP is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json: {key}=true (jaxscale's projections have no bias)")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise ConfigError(f"config.json: sliding_window={hf['sliding_window']} (jaxscale attends to the whole prefix)")
    heads, embed = _hf_int(hf, "num_attention_heads"), _hf_int(hf, "hidden_size")
    theta, scaling = _rope(hf)
    model = ModelConfig(
        vocab_size=_hf_int(hf, "vocab_size"),
        embed=embed,
        layers=_hf_int(hf, "num_hidden_layers"),
        heads=heads,
        kv_heads=_hf_int(hf, "num_key_value_heads", heads),
        head_dim=_hf_int(hf, "head_dim", embed // heads),
        mlp=_hf_int(hf, "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=kind == "qwen3_moe",
    )
    if kind == deepseek.MODEL_TYPE:
        model = deepseek.model_from_hf(hf, model)
    if kind in ("mixtral", "qwen3_moe"):
        model.moe = _moe_from_hf(hf, kind, model.layers)
    problem = bounds.out_of_range(Config(model=model))
    if problem:
        raise ConfigError(f"config.json: {problem}")
    return model


def _moe_from_hf(hf: dict[str, Any], kind: str, layers: int) -> MoEConfig:
    """``model.moe`` of a Mixtral or Qwen3-MoE ``config.json`` (with HF's defaults for what it omits)."""
    mixtral = kind == "mixtral"
    top_k = _hf_int(hf, "num_experts_per_tok", 2 if mixtral else 8)
    experts = _hf_int(hf, "num_local_experts", 8) if mixtral else _hf_int(
        hf, "num_experts", _hf_int(hf, "num_local_experts", 128))
    every = 1 if mixtral else _hf_int(hf, "decoder_sparse_step", 1)
    if hf.get("mlp_only_layers"):
        raise ConfigError(f"config.json: mlp_only_layers={hf['mlp_only_layers']} (jaxscale places an MoE layer "
                          "every decoder_sparse_step layers, none dense out of turn)")
    if layers % every:
        raise ConfigError(f"config.json: num_hidden_layers ({layers}) is not a multiple of decoder_sparse_step "
                          f"({every})")
    return MoEConfig(
        experts=experts,
        top_k=top_k,
        mlp=_hf_int(hf, "intermediate_size" if mixtral else "moe_intermediate_size"),
        every_n_layers=every,
        normalize_gates=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        dispatch="dropless",
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * top_k,
        z_loss_weight=0.0,
    )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object read from ``path``; a one-line :class:`ConfigError` naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({getattr(e, 'strerror', None) or e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_config(model: ModelConfig, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF ``config.json`` of ``model`` (over ``base``, the config it was imported from, if any)."""
    if model.deepseek is not None:
        return deepseek.hf_config(model, dtype, base)
    moe, kind = model.moe, architecture(model)
    needs = {"shared_experts": 0, "router": "softmax", "groups": 1}
    if kind == "mixtral":
        needs.update(every_n_layers=1, normalize_gates=True)
    for key, want in needs.items() if moe else ():
        if getattr(moe, key) != want:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)!r}: {ARCHITECTURES[kind]} needs {want!r}")
    drop = ("rope_parameters", "rope_scaling", "torch_dtype", "num_local_experts" if kind == "qwen3_moe" else "")
    out = {k: v for k, v in (base or {}).items() if k not in drop}
    out.update({
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed,
        "intermediate_size": moe.mlp or model.mlp if kind == "mixtral" else model.mlp,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None if model.rope_scaling is None else dataclasses.asdict(model.rope_scaling),
        "tie_word_embeddings": model.tie_embeddings,
        "dtype": dtype,
    })
    if kind == "llama":
        out.update({"attention_bias": False, "mlp_bias": False})
        return out
    out.update({
        "num_local_experts" if kind == "mixtral" else "num_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k,
        "sliding_window": None,
    })
    if kind == "qwen3_moe":
        out.update({"moe_intermediate_size": moe.mlp or model.mlp, "decoder_sparse_step": moe.every_n_layers,
                    "norm_topk_prob": moe.normalize_gates, "mlp_only_layers": [], "use_sliding_window": False,
                    "attention_bias": False})
    return out


def layer_over(model: ModelConfig, override: str | None) -> ModelConfig:
    """``model`` with the keys of the model YAML ``override`` (a path or a name in configs/models/) on top;
    the keys that decide the parameters' shapes must agree."""
    if override is None:
        return model
    raw = read_yaml(resolve_named(override, "models"))
    generated = dataclasses.asdict(model)
    merged = {**generated, **raw}
    for section in ("moe", "deepseek"):
        if isinstance(raw.get(section), dict) and generated[section] is not None:
            merged[section] = {**generated[section], **raw[section]}
    out = _build(ModelConfig, merged, "model")
    for key in ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "tie_embeddings", "qk_norm"):
        if getattr(out, key) != getattr(model, key):
            raise ConfigError(f"{override}: model.{key}={getattr(out, key)!r}, config.json has {getattr(model, key)!r}")
    if (out.moe is None) != (model.moe is None):
        raise ConfigError(f"{override}: model.moe does not match config.json's model_type")
    if model.moe is not None:
        for key in ("experts", "top_k", "mlp", "every_n_layers", "shared_experts"):
            if getattr(out.moe, key) != getattr(model.moe, key):
                raise ConfigError(f"{override}: model.moe.{key}={getattr(out.moe, key)!r}, config.json has "
                                  f"{getattr(model.moe, key)!r}")
    if (out.deepseek is None) != (model.deepseek is None):
        raise ConfigError(f"{override}: model.deepseek does not match config.json's model_type")
    if model.deepseek is not None:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "dense_layers"):
            if getattr(out.deepseek, key) != getattr(model.deepseek, key):
                raise ConfigError(f"{override}: model.deepseek.{key}={getattr(out.deepseek, key)!r}, config.json has "
                                  f"{getattr(model.deepseek, key)!r}")
    dense_width = model.moe is None or model.deepseek is not None or model.moe.every_n_layers > 1
    if out.mlp != model.mlp and dense_width:  # the dense layers' width
        raise ConfigError(f"{override}: model.mlp={out.mlp!r}, config.json has {model.mlp!r}")
    return out


def check_model(model: ModelConfig) -> None:
    if model.heads % model.kv_heads:
        raise ConfigError(f"model.heads ({model.heads}) is not divisible by model.kv_heads ({model.kv_heads})")
    validate_moe(model)
    validate_deepseek(model)
    validate_rope(model.rope_scaling)
