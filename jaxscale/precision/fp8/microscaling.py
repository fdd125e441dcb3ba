"""Block-scaled number formats: MXFP8 and NVFP4 quantisation along a matrix's last axis, the random Hadamard
transform and stochastic rounding NVIDIA's NVFP4 recipe applies before it.

- **MXFP8** (OCP Microscaling Formats v1.0; NVIDIA, "Recipes for Pre-training LLMs with MXFP8", 2025): blocks of
  32 consecutive elements share a power-of-two scale stored as E8M0; the elements are E4M3. The scale is
  ``2^ceil(log2(amax / 448))``: the block's amax rounded *up* to a power of two over E4M3's largest value, as
  NVIDIA's recipe (and cuBLAS / Transformer Engine / jax's ``scaled_dot_general``) choose it, so no element
  saturates; the OCP spec's ``2^(floor(log2 amax) - 8)`` can clip a block's largest elements to 448. Every
  tensor (gradients too) is E4M3: the block scales give the range.
- **NVFP4** (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025): blocks of 16 elements of E2M1 (largest
  6) share an E4M3 scale, under an fp32 scale per tensor. With ``amax`` the tensor's: encode scale
  ``s_enc = 6·448 / amax``; a block's decode scale ``e4m3(amax_b / 6 · s_enc)`` (round to nearest, saturating at
  448); elements ``e2m1(x · s_enc / scale_b)`` (clipped to ±6; round to nearest even, or stochastic); read back
  as ``q · scale_b / s_enc``. Weights may be scaled in 16 x 16 blocks (2-D: the same values in the forward and
  the transposed backward GEMM).

:func:`hadamard` is the 16 x 16 random Hadamard transform (fixed random signs, ``H_16 / 4``) applied along the
contraction of the weight-gradient GEMM to both operands: orthogonal, so the product is unchanged, and it spreads a
block's outliers. Stochastic rounding (:func:`e2m1`) draws its uniform numbers from a hash of each element's fp32
bits less the last 8 (deterministic, the same for a value wherever it is computed: every layout rounds as one
device does, and values that differ only in their last bits mostly alike).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MX_BLOCK, NV_BLOCK = 32, 16
E4M3, E8M0, E2M1 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.float4_e2m1fn
E4M3_MAX, E2M1_MAX = 448.0, 6.0
# The random signs of the Hadamard transform: one fixed vector for every tensor (NVIDIA's recipe shares one).
SIGNS = np.array([1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, 1, -1, -1, 1], np.float32)


class Blocks(NamedTuple):
    """A matrix in a block-scaled format: ``q`` [..., K] (E4M3 or E2M1), ``scale`` [..., K/block] (E8M0 or E4M3),
    ``tensor`` the fp32 decode scale of the whole tensor (NVFP4's ``1 / s_enc``; 1 for MXFP8)."""

    q: jax.Array
    scale: jax.Array
    tensor: jax.Array

    def dequantized(self) -> jax.Array:
        """The values it stands for, in fp32."""
        block = self.q.shape[-1] // self.scale.shape[-1]
        s = jnp.repeat(self.scale.astype(jnp.float32), block, axis=-1)
        return self.q.astype(jnp.float32) * s * self.tensor


def _blocked(a: jax.Array, block: int) -> jax.Array:
    return a.astype(jnp.float32).reshape(*a.shape[:-1], a.shape[-1] // block, block)


def e8m0_up(ratio: jax.Array) -> jax.Array:
    """``2^ceil(log2(ratio))``, a power of two at least ``ratio``, within ``[2^-126, 2^127]`` (E8M0's range less
    its smallest value, an fp32 subnormal that XLA flushes to 0; a block of zeros takes ``2^-126``)."""
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.float32(1.0), jnp.clip(jnp.where(ratio > 0, exponent, -126), -126, 127))


def mxfp8(a: jax.Array) -> Blocks:
    """``a`` [..., K] in MXFP8: 32-element blocks along K, E8M0 scales rounded up, E4M3 elements."""
    x = _blocked(a, MX_BLOCK)
    scale = e8m0_up(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / E4M3_MAX)
    q = jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(a.shape)
    return Blocks(q, scale[..., 0].astype(E8M0), jnp.float32(1.0))


def encode_scale(amax: jax.Array) -> jax.Array:
    """NVFP4's per-tensor encode scale ``6·448 / amax`` (1 where amax is 0 or not finite)."""
    s = E2M1_MAX * E4M3_MAX / amax
    return jnp.where(jnp.isfinite(s) & (amax > 0), s, 1.0).astype(jnp.float32)


def _hash_uniform(x: jax.Array) -> jax.Array:
    """A uniform number in [0, 1) for each element, from a hash (lowbias32) of its fp32 bits less the last 8:
    values a few ulps apart (two layouts' sums in other orders) mostly draw the same number."""
    h = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) >> 8
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * 2.0**-24


def e2m1(x: jax.Array, stochastic: bool, noise_of: jax.Array | None = None) -> jax.Array:
    """``x`` (fp32, in E2M1's range) to E2M1: to nearest even, or stochastically (up with probability the distance
    to the lower neighbour over the gap: E2M1's grid 0, 0.5, ..., 2, 3, 4, 6), the noise hashed from ``noise_of``."""
    x = jnp.clip(x, -E2M1_MAX, E2M1_MAX)
    if not stochastic:
        return x.astype(E2M1)
    y = jnp.abs(x)
    gap = jnp.where(y < 2, 0.5, jnp.where(y < 4, 1.0, 2.0))
    low = jnp.floor(y / gap) * gap
    up = _hash_uniform(x if noise_of is None else noise_of) < (y - low) / gap
    return (jnp.sign(x) * jnp.minimum(jnp.where(up, low + gap, low), E2M1_MAX)).astype(E2M1)


def _nv_elements(x: jax.Array, scale: jax.Array, enc: jax.Array, stochastic: bool) -> jax.Array:
    """E2M1 elements of fp32 ``x`` under E4M3 decode scales (broadcast to it) and encode scale ``enc``."""
    s = scale.astype(jnp.float32)
    ratio = jnp.where(s > 0, enc / jnp.where(s > 0, s, 1.0), 0.0)
    return e2m1(x * ratio, stochastic, noise_of=x)


def nvfp4(a: jax.Array, amax: jax.Array, stochastic: bool = False) -> Blocks:
    """``a`` [..., K] in NVFP4: 16-element blocks along K under the tensor amax ``amax`` (``a``'s rank, ones
    where it broadcasts: a stack's matrices each their own)."""
    x, enc = _blocked(a, NV_BLOCK), encode_scale(amax)
    scale = jnp.minimum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / E2M1_MAX * enc[..., None], E4M3_MAX)
    scale = scale.astype(E4M3)
    q = _nv_elements(x, scale, enc[..., None], stochastic).reshape(a.shape)
    return Blocks(q, scale[..., 0], 1.0 / enc)


def nvfp4_2d(w: jax.Array, amax: jax.Array) -> tuple[Blocks, Blocks]:
    """``w`` [..., K, N] in NVFP4 with one scale per 16 x 16 block (round to nearest): as read along K
    (``[..., N, K]``, scales ``[..., N, K/16]``) and along N (``[..., K, N]``, scales ``[..., K, N/16]``), the
    same values both ways."""
    *lead, k, n = w.shape
    b, enc = NV_BLOCK, encode_scale(amax)
    x = w.astype(jnp.float32).reshape(*lead, k // b, b, n // b, b)
    peak = jnp.max(jnp.abs(x), axis=(-3, -1), keepdims=True)
    scale = jnp.minimum(peak / E2M1_MAX * enc[..., None, None], E4M3_MAX).astype(E4M3)
    q = _nv_elements(x, scale, enc[..., None, None], stochastic=False).reshape(w.shape)
    s = scale.reshape(*lead, k // b, n // b)
    along_n = Blocks(q, jnp.repeat(s, b, axis=-2), 1.0 / enc)
    along_k = Blocks(jnp.swapaxes(q, -1, -2), jnp.repeat(jnp.swapaxes(s, -1, -2), b, axis=-2), 1.0 / enc)
    return along_k, along_n


def hadamard_matrix() -> np.ndarray:
    """``diag(SIGNS) · H_16 / 4`` (Sylvester's H_16): orthogonal."""
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < NV_BLOCK:
        h = np.block([[h, h], [h, -h]])
    return (SIGNS[:, None] * h / 4.0).astype(np.float32)


def hadamard(a: jax.Array) -> jax.Array:
    """``a`` [..., K] with each 16 consecutive elements along K mixed by :func:`hadamard_matrix` (fp32)."""
    x = _blocked(a, NV_BLOCK)
    return jnp.einsum("...i,ij->...j", x, jnp.asarray(hadamard_matrix())).reshape(a.shape)
