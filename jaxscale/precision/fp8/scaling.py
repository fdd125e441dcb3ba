"""Per-tensor fp8 scaling (Transformer Engine's): a recipe, a tensor's amax over the devices that hold it, the
scale mapping it to a float8 format's range, and the saturating cast.

``x`` of format ``F`` is stored as ``clip(x / s, ±max_F)`` cast to ``F`` and read as that times ``s``,
``s = amax · 2^margin / max_F``. ``current`` takes ``amax = max|x|``; ``delayed`` the largest of the last
``precision.amax_history`` steps' amaxes, or the tensor's own while the history is empty (a ``jnp.where``:
nothing in the step branches). Scales are fp32 scalars (per expert: ``[experts]``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How scales are chosen: ``mode`` (``precision.fp8``: the row of :data:`jaxscale.precision.fp8.recipes.KERNELS`
    that runs it), the margin and the tile and block size of tiled recipes, and NVFP4's recipe parts
    (``precision.nvfp4``, :mod:`jaxscale.precision.fp8.block_scaled`)."""

    mode: str
    margin: int
    block: int = 128
    hadamard: bool = True
    weight_2d: bool = True
    stochastic_rounding: bool = True

    @property
    def delayed(self) -> bool:
        return self.mode == "delayed"


class Quantized(NamedTuple):
    """A tensor in float8: the values, the scale that reads them back, and the tensor's amax (fp32)."""

    q: jax.Array
    scale: jax.Array
    amax: jax.Array

    def mapped(self, float8: Callable[[Any], Any], scale: Callable[[Any], Any]) -> Quantized:
        """The float8 values through ``float8``, the scale and amax through ``scale``."""
        return Quantized(float8(self.q), scale(self.scale), scale(self.amax))


def global_amax(amax: jax.Array, history: jax.Array) -> jax.Array:
    """A device's ``amax`` as the tensor's: the ``pmax`` over the manual mesh axes it varies over and
    ``history`` does not. Whole histories (a sequence-parallel ``shard_map``) reduce over every axis the
    tensor is split over; inside a pipeline stage each stage holds its own layers' histories (varying over
    ``stage``): a stage's amax is its own."""
    axes = tuple(sorted(jax.typeof(amax).mat.varying - jax.typeof(history).mat.varying))
    return lax.pmax(amax, axes) if axes else amax


def _amax(x: jax.Array, history: jax.Array) -> jax.Array:
    """``max|x|`` in fp32 over the devices that hold parts of ``x`` (:func:`global_amax`)."""
    return global_amax(jnp.max(jnp.abs(x)).astype(jnp.float32), history)


def scale_of(amax: jax.Array, fmt: Any, margin: int) -> jax.Array:
    """The scale mapping ``amax · 2^margin`` to the largest value of ``fmt`` (1 where amax is 0 or not finite)."""
    s = amax * 2.0**margin / float(jnp.finfo(fmt).max)
    return jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0)


def scale(history: jax.Array, amax: jax.Array, fmt: Any, recipe: Recipe) -> jax.Array:
    """The dequantization scale of a tensor of amax ``amax``: from the history (``delayed``, once it holds an
    amax) or from ``amax``. A select, not a branch."""
    if not recipe.delayed:
        return scale_of(amax, fmt, recipe.margin)
    past = jnp.max(history, axis=-1)
    return jnp.where(past > 0, scale_of(past, fmt, recipe.margin), scale_of(amax, fmt, recipe.margin))


def cast(x: jax.Array, s: jax.Array, fmt: Any) -> jax.Array:
    """``x / s`` saturated to the range of ``fmt`` and cast to it."""
    top = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(fmt)


def quantize(x: jax.Array, history: jax.Array, fmt: Any, recipe: Recipe) -> Quantized:
    """``x`` in ``fmt`` scaled per tensor by ``recipe`` (no gradient flows through it)."""
    x, history = lax.stop_gradient(x), lax.stop_gradient(history)
    amax = _amax(x, history)
    s = scale(history, amax, fmt, recipe)
    return Quantized(cast(x, s, fmt), s, amax)


def stacked(x: jax.Array, history: jax.Array, recipe: Recipe) -> Quantized:
    """``x`` in e4m3 with one scale per leading index of ``history`` (``[..., steps]``): a stack of layers'
    weights, or of experts' (``[experts, ...]`` with ``[experts, steps]`` histories)."""
    fn = functools.partial(quantize, fmt=E4M3, recipe=recipe)
    for _ in range(history.ndim - 1):
        fn = jax.vmap(fn)
    return fn(x, history)


def along(scale: jax.Array, have: str, want: str) -> jax.Array:
    """A scale over the leading letters of ``have`` (a scalar: per tensor; ``[experts]``: per expert) shaped to
    broadcast against an array of letters ``want``."""
    lead = have[: scale.ndim]
    order = [c for c in want if c in lead]
    scale = jnp.transpose(scale, [lead.index(c) for c in order])
    return scale.reshape([scale.shape[order.index(c)] if c in lead else 1 for c in want])
