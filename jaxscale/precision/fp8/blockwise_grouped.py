"""Blockwise FP8 grouped matmuls: the dropless experts' ``ragged_dot`` in DeepSeek-V3's recipe.

Rows ``x`` [m, K], sorted by expert, ``sizes`` [G] rows each, through per-expert weights ``w`` [G, K, N]
(:func:`jaxscale.ops.routing.grouped_swiglu`), with ``B = precision.fp8_block``, as
:mod:`jaxscale.precision.fp8.blockwise` reads a projection:

- forward: ``x`` in ``1 x B`` tiles along K (e4m3; a tile is one row's, so rows of two experts never
  share one, wherever the experts' boundaries fall), each expert's weight in ``B x B`` blocks (e4m3, a
  scale per block per expert). The K/B slices are the batch of one ``ragged_dot_general`` on the float8
  operands (ragged over the rows, grouped over the experts): ``[K/B, m, N]`` fp32 partial products, each
  times its row's tile scale and its expert's block scale, summed over the slices;
- dx: the output gradient in ``1 x B`` tiles along N (e5m2) against the blocks transposed: the same form;
- dw contracts the rows: ``x`` (e4m3) and the output gradient (e5m2) in ``B x 1`` tiles along the rows,
  counted from each expert's first row (an expert's last tile is short where its rows are not a multiple
  of B: no tile straddles two experts). The tiles are the groups of a ``ragged_dot_general`` ragged over
  the contracted rows: ``[T, K, N]`` fp32 partial products (``T = ceil(m/B) + G`` bounds the tiles), each
  times its two tiles' scales, summed over each expert's tiles.

The cost is :mod:`jaxscale.precision.fp8.blockwise`'s: fp32 partial products of ``4·K/B`` (forward), ``4·N/B`` (dx)
and ``4·(m/B + G)/G`` (dw, per expert) bytes per output element, written and summed outside the GEMM.
jax lowers ``ragged_dot_general`` to XLA's ragged dot on GPU (``chlo.ragged_dot``) and, on CPU, to a dense
dot of the operands masked per group (G, or T, times the operand: the numerics are fp8's, not the speed).
Rows past ``sum(sizes)`` (other devices' experts) give zeros and no weight gradient. Amaxes as
:mod:`jaxscale.precision.fp8.blockwise`'s: current per tile; the per-tensor (per-expert for weights) amaxes pushed.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.precision.fp8.blockwise import blocks, tiles
from jaxscale.precision.fp8.grouped import WGRAD, Static
from jaxscale.precision.fp8.operand import Deferred, Operand, pushed
from jaxscale.precision.fp8.scaling import E4M3, E5M2, Recipe, cast, scale_of

# [K/B, m, B] rows (ragged over m) times [K/B, G, B, N] experts' weights: the K/B slices a batch.
_SLICED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [2]), ([0], [0])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[1]
)


def ragged(x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    """``ragged_dot(x, w, sizes)`` in blockwise fp8 (``x`` [m, K] rows, ``w`` [G, K, N]), in ``x``'s dtype."""
    return _ragged(Static(x.recipe, jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)), x, w, sizes)


def grouped_block_dot(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array, sizes: jax.Array, block: int
) -> jax.Array:
    """Rows ``qa`` [m, K] (float8, tile scales ``sa`` [m, K/B]) through their experts' ``qb`` [G, K, N] (float8,
    block scales ``sb`` [G, K/B, N/B]) in fp32: the K/B slices' ragged dots, scaled and summed."""
    (m, k), (g, _, n) = qa.shape, qb.shape
    partial = lax.ragged_dot_general(
        qa.reshape(m, k // block, block).transpose(1, 0, 2),
        qb.reshape(g, k // block, block, n).transpose(1, 0, 2, 3),
        jnp.broadcast_to(sizes, (k // block, g)),  # per slice: XLA:GPU's ragged dot aborts on [G] with a batch
        _SLICED,
        preferred_element_type=jnp.float32,
    )  # [K/B, m, N]
    rows = jnp.repeat(sb, sizes, axis=0, total_repeat_length=m).transpose(1, 0, 2)  # [K/B, m, N/B]: the row's expert's
    scaled = partial.reshape(k // block, m, n // block, block) * (sa.T[:, :, None] * rows)[..., None]
    return jnp.sum(scaled, axis=0).reshape(m, n)


class RowTiles(NamedTuple):
    """``B x 1`` tiles along the rows, counted from each expert's first row: each row's tile [m], each tile's
    rows [T] and expert [T] (``G`` for the tiles past the experts' rows: empty, the last one holding the rows
    past ``sum(sizes)``)."""

    of_row: jax.Array
    sizes: jax.Array
    expert: jax.Array


def row_expert(sizes: jax.Array, rows: int) -> jax.Array:
    """Each of ``rows`` rows' expert [rows], the rows grouped by ``sizes`` (``G`` for the rows past ``sum(sizes)``)."""
    groups = sizes.shape[0]
    return jnp.repeat(jnp.arange(groups + 1), jnp.append(sizes, rows), total_repeat_length=rows)


def row_tiles(sizes: jax.Array, rows: int, block: int) -> RowTiles:
    """The tiles of ``rows`` rows in groups of ``sizes`` (:class:`RowTiles`): ``ceil(rows/B) + G`` of them, at
    least one more than the experts use (an expert's ``ceil(n/B)`` tiles sum to under ``rows/B + G``)."""
    groups, count = sizes.shape[0], -(-sizes // block)
    total = -(-rows // block) + groups
    first_tile, first_row = jnp.cumsum(count) - count, jnp.cumsum(sizes) - sizes
    expert = jnp.repeat(jnp.arange(groups + 1), jnp.append(count, total), total_repeat_length=total)
    in_expert = jnp.arange(total) - jnp.append(first_tile, 0)[expert]
    tile_rows = jnp.where(expert < groups, jnp.minimum(block, jnp.append(sizes, 0)[expert] - in_expert * block), 0)
    expert_of = row_expert(sizes, rows)
    local = jnp.arange(rows) - jnp.append(first_row, 0)[expert_of]
    of_row = jnp.where(expert_of < groups, jnp.append(first_tile, 0)[expert_of] + local // block, total - 1)
    return RowTiles(of_row, tile_rows, expert)


def _row_tiled(a: jax.Array, tiling: RowTiles, fmt: Any, margin: int) -> tuple[jax.Array, jax.Array]:
    """``a`` [m, K] in ``fmt`` with a scale per tile of rows per column: (values [m, K], scales [T, K])."""
    amax = jax.ops.segment_max(jnp.abs(a.astype(jnp.float32)), tiling.of_row, num_segments=tiling.sizes.shape[0])
    s = scale_of(amax, fmt, margin)
    return cast(a, s[tiling.of_row], fmt), s


def _weight_grad(x: jax.Array, g: jax.Array, sizes: jax.Array, groups: int, recipe: Recipe) -> jax.Array:
    """``dw[e] = Σ_{rows r of e} x[r]ᵀ g[r]`` from ``B x 1`` tiles of ``x`` (e4m3) and ``g`` (e5m2), in fp32."""
    tiling = row_tiles(sizes, x.shape[0], recipe.block)
    (qx, sx), (qg, sg) = (_row_tiled(a, tiling, f, recipe.margin) for a, f in ((x, E4M3), (g, E5M2)))
    partial = lax.ragged_dot_general(qx, qg, tiling.sizes, WGRAD, preferred_element_type=jnp.float32)  # [T, K, N]
    return jax.ops.segment_sum(partial * sx[:, :, None] * sg[:, None, :], tiling.expert, num_segments=groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    return _forward(static, x, w, sizes)[0]


def _forward(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> tuple[jax.Array, tuple]:
    b, margin = static.recipe.block, static.recipe.margin
    qx = tiles(x.value, b, E4M3, margin)
    qw = jax.vmap(functools.partial(blocks, block=b, fmt=E4M3, margin=margin))(w.value)
    y = grouped_block_dot(qx.q, qx.scale, qw.q, qw.scale, sizes, b)
    return y.astype(static.x_dtype), (x.value, qw, sizes, qx.amax, x.history, w.history, w.grad_history)


def _backward(static: Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand, None]:
    x, qw, sizes, x_amax, x_history, w_history, g_history = saved
    recipe = static.recipe
    qg = tiles(g, recipe.block, E5M2, recipe.margin)
    dx = grouped_block_dot(qg.q, qg.scale, jnp.swapaxes(qw.q, 1, 2), jnp.swapaxes(qw.scale, 1, 2), sizes, recipe.block)
    dw = _weight_grad(x, g, sizes, qw.q.shape[0], recipe)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(qw.q).mat.varying))
    if summed:  # inside a shard_map: the partial weight gradients of the devices the rows are split over
        dw = lax.psum(dw, summed)
    dx_op = Operand(dx.astype(static.x_dtype), Deferred(), pushed(x_history, x_amax), None, recipe)
    dw_history, g_history = pushed(w_history, qw.amax), pushed(g_history, qg.amax)
    dw_op = Operand(dw.astype(static.w_dtype), Deferred(), dw_history, g_history, recipe)
    return dx_op, dw_op, None


_ragged.defvjp(_forward, _backward)
