"""FP8 grouped matmuls: the dropless experts' ``lax.ragged_dot`` on float8 operands, forward and backward.

Rows ``x`` [m, d], sorted by expert, with ``sizes`` [G] rows each, through per-expert weights ``w``
[G, d, f]: ``y[r] = x[r] · w[g(r)]`` (:func:`jaxscale.ops.routing.grouped_swiglu`). As
:func:`jaxscale.precision.fp8.per_tensor.einsum`, one ``custom_vjp`` that hands float8 arrays to the matmuls:

- forward: ``ragged_dot(q_x, q_w)`` on e4m3 operands in fp32, row ``r`` times ``s_x · s_w[g(r)]``: the
  activation scaled per tensor, each expert's weight by its own scale (:func:`jaxscale.precision.fp8.scaling.stacked`);
- backward: the output gradient in e5m2 (per tensor); ``dx = ragged_dot(q_g, q_wᵀ)`` row ``r`` times
  ``s_g · s_w[g(r)]``, and ``dw[g] = Σ_{r in g} q_x[r]ᵀ q_g[r]`` (``ragged_dot_general``, ragged over
  the contracted rows) times ``s_x · s_g``: e5m2 against e4m3, never e5m2 x e5m2;
- residuals: the e4m3 operands, the histories' pushes as :mod:`jaxscale.precision.fp8.per_tensor`'s.

Rows past ``sum(sizes)`` (other devices' experts) give zeros and no weight gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.precision.fp8.operand import Operand, pushed
from jaxscale.precision.fp8.per_tensor import NONE
from jaxscale.precision.fp8.scaling import E5M2, Recipe, quantize

# dw[g] = x[rows of g]ᵀ · g[rows of g]: the rows contracted, ragged over the groups (blockwise's row tiles too).
WGRAD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


class Static(NamedTuple):
    """What a grouped fp8 matmul's custom VJP fixes when traced (here and in
    :mod:`jaxscale.precision.fp8.blockwise_grouped`)."""

    recipe: Recipe
    x_dtype: Any
    w_dtype: Any


def ragged(x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    """``ragged_dot(x, w, sizes)`` of fp8 operands (a per-tensor activation, per-expert weights), in ``x``'s dtype."""
    return _ragged(Static(x.recipe, jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)), x, w, sizes)


def _row_scales(scale: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's expert's scale [rows, 1] (rows past the groups: the last expert's, their products are 0)."""
    return jnp.repeat(scale, sizes, total_repeat_length=rows)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    return _forward(static, x, w, sizes)[0]


def _forward(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> tuple[jax.Array, tuple]:
    qx, qw = x.quantized, w.quantized
    y = lax.ragged_dot(qx.q, qw.q, sizes, preferred_element_type=jnp.float32)
    y = y * (qx.scale * _row_scales(qw.scale, sizes, y.shape[0]))
    return y.astype(static.x_dtype), (qx, qw, sizes, x.history, w.history, w.grad_history)


def _backward(static: Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand, None]:
    qx, qw, sizes, x_history, w_history, g_history = saved
    qg = quantize(g, g_history, E5M2, static.recipe)
    dx = lax.ragged_dot(qg.q, jnp.swapaxes(qw.q, 1, 2), sizes, preferred_element_type=jnp.float32)
    dx = dx * (qg.scale * _row_scales(qw.scale, sizes, dx.shape[0]))
    dw = lax.ragged_dot_general(qx.q, qg.q, sizes, WGRAD, preferred_element_type=jnp.float32)
    dw = dw * (qx.scale * qg.scale)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(qw.q).mat.varying))
    if summed:  # inside a shard_map: the partial weight gradients of the devices the rows are split over
        dw = lax.psum(dw, summed)
    recipe = static.recipe
    dx_op = Operand(dx.astype(static.x_dtype), NONE, pushed(x_history, qx.amax), None, recipe)
    dw_op = Operand(dw.astype(static.w_dtype), NONE, pushed(w_history, qw.amax), pushed(g_history, qg.amax), recipe)
    return dx_op, dw_op, None


_ragged.defvjp(_forward, _backward)
