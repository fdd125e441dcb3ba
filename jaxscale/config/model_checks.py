"""The model section's own checks: mixture of experts, DeepSeek's parts, RoPE scaling (no jax; rules naming two settings
are rows of :mod:`jaxscale.config.refusals`).
"""

from __future__ import annotations

from jaxscale.config.schema import (  # the schema, importable from here
    ConfigError,
    ModelConfig,
    RopeScaling,
)


def validate_moe(m: ModelConfig) -> None:
    """Checks of ``model.moe`` that need no devices."""
    moe = m.moe
    if moe is None:
        return
    for key in ("experts", "top_k", "every_n_layers"):
        if getattr(moe, key) < 1:
            raise ConfigError(f"model.moe.{key} must be at least 1, got {getattr(moe, key)}")
    if moe.mlp is not None and moe.mlp < 1:
        raise ConfigError(f"model.moe.mlp must be positive, got {moe.mlp}")
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts must be at least 0, got {moe.shared_experts}")
    if moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor must be positive, got {moe.capacity_factor}")
    for key in ("aux_loss_weight", "z_loss_weight", "bias_rate"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key} must be at least 0, got {getattr(moe, key)}")
    if not 0 <= moe.bias_ema < 1:
        raise ConfigError(f"model.moe.bias_ema must be in [0, 1), got {moe.bias_ema}")


def validate_deepseek(m: ModelConfig) -> None:
    """``model.deepseek`` (the DeepSeek-V3-style decoder): MoE blocks after the dense ones, an even rotary width
    (the ranges of its numbers are :mod:`jaxscale.config.bounds`')."""
    d = m.deepseek
    if d is None:
        return
    if d.qk_rope_head_dim % 2:
        raise ConfigError(f"model.deepseek.qk_rope_head_dim ({d.qk_rope_head_dim}) must be even for rotary embeddings")


def validate_rope(s: RopeScaling | None) -> None:
    """``model.rope_scaling``: a factor of at least 1, 0 < low_freq_factor < high_freq_factor, a positive context."""
    if s is None:
        return
    if s.factor < 1:
        raise ConfigError(f"model.rope_scaling.factor must be at least 1, got {s.factor}")
    if not 0 < s.low_freq_factor < s.high_freq_factor:
        raise ConfigError(f"model.rope_scaling: needs 0 < low_freq_factor ({s.low_freq_factor}) < high_freq_factor "
                          f"({s.high_freq_factor})")
    if s.original_max_position_embeddings < 1:
        raise ConfigError("model.rope_scaling.original_max_position_embeddings must be positive, got "
                          f"{s.original_max_position_embeddings}")
