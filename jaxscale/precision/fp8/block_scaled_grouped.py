"""Block-scaled grouped matmuls (``precision.fp8: mxfp8 | nvfp4``): the dropless experts' ``ragged_dot`` with each
of its three GEMMs on operands in the format's blocks (:mod:`jaxscale.precision.fp8.microscaling`).

Rows ``x`` [m, K], sorted by expert, ``sizes`` [G] rows each, through per-expert weights ``w`` [G, K, N]
(:func:`jaxscale.ops.routing.grouped_swiglu`), each expert's rows and weight read as
:mod:`jaxscale.precision.fp8.block_scaled` reads one matrix of the capacity buffers' stack:

- forward ``y = x · w_e``: ``x`` in blocks along K (a block is one row's: it never straddles two experts), each
  expert's weight along K;
- input gradient ``dx = g · w_eᵀ``: the output gradient ``g`` along N (per row), each expert's weight along N;
- weight gradient ``dw_e = x_eᵀ · g_e``: both in blocks along the rows, counted from each expert's first row:
  each expert's rows padded with zero rows to whole blocks (an expert's last block is short; a zero row changes
  no amax and no product), so no block holds two experts' rows.

NVFP4's recipe parts as :mod:`~jaxscale.precision.fp8.block_scaled` applies them: an fp32 tensor scale per expert
for every operand (each expert's weight, and each expert's rows of ``x``, of ``g`` and of the weight gradient's
transformed operands, as the capacity buffers' stack ``[experts, rows, K]`` is scaled per matrix), each the
maximum over the devices that hold that expert's rows; the weights in 16 x 16 blocks (``weight_2d``); ``g``
rounded stochastically (``stochastic_rounding``); the 16 x 16 random Hadamard transform along the rows of the
weight gradient's operands (``hadamard``), on each expert's padded rows: a 16-row block holds one expert's rows
(and zeros), so the transform mixes no two experts' rows and leaves each ``x_eᵀ · g_e`` as it is (it is
orthogonal). With every row one expert's, each operand takes the values ``block_scaled.einsum`` gives it.

**The GEMMs are not block-scaled GEMMs.** XLA has no block-scaled grouped GEMM (cuDNN's block-scaled dot, which
the projections run on CUDA, is not grouped), so each of the three is ``lax.ragged_dot`` /
``ragged_dot_general`` on the *dequantized* operands in fp32 (``Precision.HIGHEST``), on every backend: the
formats' numerics, not their speed (on a GPU an fp32 grouped GEMM, slower than the bf16 one it replaces).

Rows past ``sum(sizes)`` (other devices' experts) give zeros and no weight gradient. Inside a ``shard_map`` the
weight gradient is summed over the axes the rows vary over and the weight does not; where a layout splits an
expert's rows over devices (``ep_fsdp``: over fsdp), each device blocks its own rows for it, so its blocks are not
one device's (as :mod:`~jaxscale.precision.fp8.blockwise_grouped`'s tiles; MXFP8's power-of-two scales barely
move, NVFP4's gradients do: tests/test_fp8_blockscaled_grouped.py). The residuals: ``x`` in the
compute dtype and the weight (NVFP4 with 2-D blocks: its E2M1 values and scales, read along N). The histories get
``x``'s and ``g``'s amaxes and each expert weight's pushed, as :mod:`~jaxscale.precision.fp8.blockwise_grouped`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.read import ConfigError
from jaxscale.precision.fp8 import microscaling as mx
from jaxscale.precision.fp8.block_scaled import BLOCK, amax_reference, quantized, weight_blocks
from jaxscale.precision.fp8.blockwise_grouped import row_expert, row_tiles
from jaxscale.precision.fp8.grouped import WGRAD, Static
from jaxscale.precision.fp8.operand import Deferred, Operand, pushed
from jaxscale.precision.fp8.scaling import Recipe, global_amax

HIGHEST = lax.Precision.HIGHEST


def ragged(x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    """``ragged_dot(x, w, sizes)`` block-scaled (``x.recipe.mode``: mxfp8 or nvfp4; ``x`` [m, K] rows, ``w``
    [G, K, N]), in ``x``'s dtype."""
    _, k, n = w.value.shape
    block = BLOCK[x.recipe.mode]
    if k % block or n % block:  # a device's share: config validation checks the whole sizes
        raise ConfigError(f"precision.fp8={x.recipe.mode}: the routed experts hold {k} x {n} weights on each device, "
                          f"not whole {block}-element blocks along both")
    return _ragged(Static(x.recipe, jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)), x, w, sizes)


def _group_amax(a: jax.Array, group: jax.Array, groups: int, reference: jax.Array | None) -> jax.Array:
    """The amax of each group's slices of ``a`` [S, ...] (``group`` [S] in ``0..G``; ``G``: no expert's) [G + 1],
    over the devices holding parts of a group (:func:`~jaxscale.precision.fp8.scaling.global_amax`)."""
    peak = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=tuple(range(1, a.ndim)))
    amax = jnp.maximum(jax.ops.segment_max(peak, group, num_segments=groups + 1), 0.0)  # an empty group: 0
    return amax if reference is None else global_amax(amax, reference)


def _quantized(a: jax.Array, group: jax.Array, groups: int, recipe: Recipe, reference: jax.Array | None,
               stochastic: bool = False) -> mx.Blocks:
    """``a`` [S, ..., C] in the recipe's format, blocks along C; NVFP4's tensor scale per expert, the slices S
    grouped by ``group``."""
    if recipe.mode == "mxfp8":
        return mx.mxfp8(a)
    amax = _group_amax(a, group, groups, reference)[group]
    return mx.nvfp4(a, amax.reshape(-1, *[1] * (a.ndim - 1)), stochastic)


def _dot(rows: mx.Blocks, w: mx.Blocks, sizes: jax.Array) -> jax.Array:
    """Rows [m, C] through their experts' ``w`` [G, D, C] (both blocks along C): ``[m, D]`` in fp32, the
    dequantized operands' ragged dot."""
    b = jnp.swapaxes(w.dequantized(), 1, 2)
    return lax.ragged_dot(rows.dequantized(), b, sizes, precision=HIGHEST, preferred_element_type=jnp.float32)


def _tiled(a: jax.Array, slot: jax.Array, tiles: int, block: int) -> jax.Array:
    """Rows ``a`` [m, C] at their ``slot`` among ``tiles x block`` zero rows (a slot past them: dropped), as
    ``[tiles, C, block]``: each tile's rows along the last axis."""
    out = jnp.zeros((tiles * block, a.shape[1]), jnp.float32).at[slot].set(a.astype(jnp.float32), mode="drop")
    return jnp.swapaxes(out.reshape(tiles, block, -1), 1, 2)


def _weight_grad(x: jax.Array, g: jax.Array, sizes: jax.Array, recipe: Recipe, ref: jax.Array | None) -> jax.Array:
    """``dw[e] = x_eᵀ · g_e`` [G, K, N] in fp32 from blocks along each expert's rows (its rows padded to whole
    blocks; NVFP4: Hadamard-transformed, ``g`` rounded stochastically, as the recipe says)."""
    block, groups, m = BLOCK[recipe.mode], sizes.shape[0], x.shape[0]
    tiling = row_tiles(sizes, m, block)
    tiles, expert = tiling.sizes.shape[0], row_expert(sizes, m)
    first = jnp.append(jnp.cumsum(sizes) - sizes, 0)[expert]  # each row's expert's first row
    slot = jnp.where(expert < groups, tiling.of_row * block + (jnp.arange(m) - first) % block, tiles * block)
    xt, gt = _tiled(x, slot, tiles, block), _tiled(g, slot, tiles, block)  # [T, K, B], [T, N, B]
    if recipe.mode == "nvfp4" and recipe.hadamard:
        xt, gt = mx.hadamard(xt), mx.hadamard(gt)
    sr = recipe.mode == "nvfp4" and recipe.stochastic_rounding
    qx = _quantized(xt, tiling.expert, groups, recipe, ref)
    qg = _quantized(gt, tiling.expert, groups, recipe, ref, stochastic=sr)
    xr, gr = (jnp.swapaxes(q.dequantized(), 1, 2).reshape(tiles * block, -1) for q in (qx, qg))
    padded = -(-sizes // block) * block  # each expert's rows in whole blocks: contiguous, in the experts' order
    return lax.ragged_dot_general(xr, gr, padded, WGRAD, precision=HIGHEST, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> jax.Array:
    return _forward(static, x, w, sizes)[0]


def _forward(static: Static, x: Operand, w: Operand, sizes: jax.Array) -> tuple[jax.Array, tuple]:
    recipe, ref, groups = static.recipe, amax_reference(w), w.value.shape[0]
    along_k, along_n = weight_blocks(w.value, recipe, ref)  # [G, N, K] along K; [G, K, N] along N or None
    rows = _quantized(x.value, row_expert(sizes, x.value.shape[0]), groups, recipe, ref)
    y = _dot(rows, along_k, sizes)
    amaxes = jnp.max(jnp.abs(x.value.astype(jnp.float32))), jnp.max(jnp.abs(w.value.astype(jnp.float32)), axis=(1, 2))
    kept = w.value if along_n is None else along_n
    return y.astype(static.x_dtype), (x.value, kept, sizes, amaxes, ref, x.history, w.history, w.grad_history)


def _backward(static: Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand, None]:
    x, kept, sizes, (x_amax, w_amax), ref, x_history, w_history, g_history = saved
    recipe = static.recipe
    w_n = kept if isinstance(kept, mx.Blocks) else quantized(kept, recipe, ref)  # [G, K, N] along N
    sr = recipe.mode == "nvfp4" and recipe.stochastic_rounding
    rows = _quantized(g, row_expert(sizes, g.shape[0]), w_n.q.shape[0], recipe, ref, stochastic=sr)
    dx = _dot(rows, w_n, sizes)
    dw = _weight_grad(x, g, sizes, recipe, ref)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(w_n.q).mat.varying))
    if summed:  # inside a shard_map: the partial weight gradients of the devices the rows are split over
        dw = lax.psum(dw, summed)
    dx_op = Operand(dx.astype(static.x_dtype), Deferred(), pushed(x_history, x_amax), None, recipe)
    g_amax = jnp.max(jnp.abs(g.astype(jnp.float32)))
    dw_op = Operand(dw.astype(static.w_dtype), Deferred(), pushed(w_history, w_amax), pushed(g_history, g_amax), recipe)
    return dx_op, dw_op, None


_ragged.defvjp(_forward, _backward)
