"""Rotary position embeddings: the rotate-half layout of the Hugging Face Llama checkpoints, and Llama 3.1's
frequency scaling (``model.rope_scaling``, ``rope_type: llama3``).

Pair ``j`` of a head (dimensions ``j`` and ``j + d/2``) turns by ``position · f_j``, ``f_j = θ^(-j/(d/2))``.
Llama 3.1 stretches the context by ``factor`` without touching the short wavelengths: with ``L`` the
original context (``original_max_position_embeddings``) and ``λ_j = 2π / f_j`` a pair's wavelength,

- ``λ_j < L / high_freq_factor`` (high frequencies): ``f_j`` unchanged;
- ``λ_j > L / low_freq_factor`` (low frequencies): ``f_j / factor``;
- between them: ``(1 - t)·f_j/factor + t·f_j`` with ``t = (L/λ_j - low_freq_factor) / (high_freq_factor -
  low_freq_factor)``, the two joined smoothly.

The scaled frequencies apply at every position alike (no ``attention_factor``: Llama 3.1 has none).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxscale.config import ModelConfig, RopeScaling


def llama3_scaled(freq: jax.Array, s: RopeScaling) -> jax.Array:
    """Inverse frequencies ``freq`` [d/2] scaled as Llama 3.1 (this module's docstring)."""
    length = s.original_max_position_embeddings
    wavelength = 2 * math.pi / freq
    low = wavelength > length / s.low_freq_factor
    high = wavelength < length / s.high_freq_factor
    t = (length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smooth = (1 - t) * freq / s.factor + t * freq
    return jnp.where(low, freq / s.factor, jnp.where(high, freq, smooth))


def frequencies(config: ModelConfig) -> jax.Array:
    """The inverse frequency of each rotated pair of a head, fp32 [head_dim / 2]."""
    half = config.head_dim // 2
    freq = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    return freq if config.rope_scaling is None else llama3_scaled(freq, config.rope_scaling)


def rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:
    """Rotary embedding of ``x`` [batch, length, heads, head_dim] at integer ``positions`` [batch, length]."""
    half = x.shape[-1] // 2
    angle = positions.astype(jnp.float32)[..., None, None] * frequencies(config)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
