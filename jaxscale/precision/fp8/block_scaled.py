"""Block-scaled projections (``precision.fp8: mxfp8 | nvfp4``): each of a projection's three GEMMs on operands
scaled in blocks along that GEMM's contraction (:mod:`jaxscale.precision.fp8.microscaling`).

A projection ``y = x · w`` is read as ``[M, K] · [K, N]`` (as :mod:`jaxscale.precision.fp8.blockwise` reads it; a
batch letter, the routed experts' ``e`` of the capacity buffers, makes a stack of them; the dropless experts' grouped
matmuls: :mod:`jaxscale.precision.fp8.block_scaled_grouped`):

- forward ``y = x · w``: ``x`` in blocks along K (its rows), ``w`` along K (its columns);
- input gradient ``dx = g · wᵀ``: the output gradient ``g`` along N, ``w`` along N;
- weight gradient ``dw = xᵀ · g``: both along the tokens M (padded with zero rows to whole blocks).

MXFP8 quantizes each operand for each GEMM afresh (the power-of-two scales differ along K and along N). NVFP4
takes the recipe's parts from :class:`~jaxscale.precision.fp8.scaling.Recipe` (``precision.nvfp4``): the weight
in 16 x 16 blocks, the same E2M1 values in the forward and the input gradient (``weight_2d``; else 1 x 16
along each GEMM's contraction); the weight gradient's operands through the 16 x 16 random Hadamard transform
along the tokens (``hadamard``); the output gradient rounded stochastically (``stochastic_rounding``). Each
NVFP4 operand has its per-tensor scale from its amax (a stack: per matrix), the maximum over the devices that
hold parts of it (:func:`~jaxscale.precision.fp8.scaling.global_amax`; the partitioner's reduction outside a
``shard_map``).

The GEMM (:func:`gemm`) is ``jax.nn.scaled_matmul`` on GPU devices, which lowers to cuDNN's block-scaled GEMM (the
custom call ``__op$block_scaled_dot``: MXFP8 and NVFP4 tensor-core GEMMs on Blackwell), and elsewhere the same
product of the dequantized operands in fp32 (jax 0.10.2 has no CPU lowering of ``scaled_matmul``; jax 0.12's
is this dequantized dot). ``jax.nn.scaled_dot_general`` is not used: it quantizes inside its own VJP with an
NVFP4 tensor scale fixed by the caller (1 by default), and its NVFP4 backward GEMMs run unquantized, with no
Hadamard transform, 2-D weight blocks or stochastic rounding.

The residuals: ``x`` and ``w`` in the compute dtype (MXFP8 scales them again along other axes in the backward;
NVFP4 with 2-D weight blocks keeps the weight's E2M1 values and scales). The amax histories get the tensors'
amaxes pushed, as blockwise's do (scaling is per block and current: nothing reads them).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.read import ConfigError
from jaxscale.layout.sharding import platform
from jaxscale.precision.fp8 import microscaling as mx
from jaxscale.precision.fp8.blockwise import matrix, padded, tensor
from jaxscale.precision.fp8.operand import Deferred, Operand, pushed
from jaxscale.precision.fp8.scaling import Recipe, global_amax
from jaxscale.precision.letters import letters, split

BLOCK = {"mxfp8": mx.MX_BLOCK, "nvfp4": mx.NV_BLOCK}


def _cudnn(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """``jax.nn.scaled_matmul``, typed as varying over the manual mesh axes its operands vary over (inside a
    ``shard_map``: its result is typed as varying over none)."""
    y = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
    missing = tuple(sorted((jax.typeof(a).mat.varying | jax.typeof(b).mat.varying) - jax.typeof(y).mat.varying))
    return lax.pcast(y, missing, to="varying") if missing else y


def _dequantized(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
    da, db = (mx.Blocks(q, s, jnp.float32(1.0)).dequantized() for q, s in ((a, sa), (b, sb)))
    return jnp.einsum("bmk,bnk->bmn", da, db, precision=lax.Precision.HIGHEST)


def gemm(a: mx.Blocks, b: mx.Blocks) -> jax.Array:
    """``[B, M, K] · [B, N, K]ᵀ`` in fp32 of two block-scaled stacks (scales along K): ``[B, M, N]``."""
    kernel = _cudnn if platform() == "gpu" else _dequantized  # chosen when traced (layout.sharding.platform)
    y = kernel(a.q, b.q, a.scale, b.scale)
    return y if a.q.dtype == mx.E4M3 else y * (a.tensor * b.tensor)


class _Shape(NamedTuple):
    equation: str
    recipe: Recipe
    x_dtype: Any
    w_dtype: Any
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]


def einsum(equation: str, x: Operand, w: Operand) -> jax.Array:
    """``einsum(equation, x, w)`` block-scaled (``x.recipe.mode``: mxfp8 or nvfp4), in ``x``'s dtype."""
    sizes = dict(zip(letters(equation)[1], w.value.shape, strict=True))
    _, _, contract, free_w = split(equation)
    k, n, block = math.prod(sizes[c] for c in contract), math.prod(sizes[c] for c in free_w), BLOCK[x.recipe.mode]
    if k % block or n % block:  # a device's share: config validation checks the whole sizes
        raise ConfigError(f"precision.fp8={x.recipe.mode}: the projection {equation} holds a {k} x {n} weight on each "
                          f"device, not whole {block}-element blocks along both")
    dtypes = jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)
    return _einsum(_Shape(equation, x.recipe, *dtypes, tuple(x.value.shape), tuple(w.value.shape)), x, w)


def _stack(a: jax.Array, have: str, batch: str, rows: str, cols: str) -> jax.Array:
    """``a`` as a stack of matrices ``[B, rows, cols]`` (B = 1 without batch letters)."""
    m = matrix(a, have, batch, rows, cols)
    return m if batch else m[None]


def _amax(a: jax.Array, reference: jax.Array | None) -> jax.Array:
    """Each matrix's amax of a stack ``[B, R, C]`` (``[B, 1, 1]``), over the devices holding parts of it."""
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=(1, 2), keepdims=True)
    return amax if reference is None else global_amax(amax, reference)


def quantized(a: jax.Array, recipe: Recipe, reference: jax.Array | None, stochastic: bool = False) -> mx.Blocks:
    """A stack ``[B, R, C]`` in the recipe's format, blocks along C."""
    if recipe.mode == "mxfp8":
        return mx.mxfp8(a)
    return mx.nvfp4(a, _amax(a, reference), stochastic)


def weight_blocks(w3: jax.Array, recipe: Recipe, reference: jax.Array | None) -> tuple[mx.Blocks, mx.Blocks | None]:
    """The weight stack ``[B, K, N]`` along K for the forward, and along N for the input gradient where it is the
    same values (NVFP4's 2-D blocks) or None."""
    if recipe.mode == "nvfp4" and recipe.weight_2d:
        return mx.nvfp4_2d(w3, _amax(w3, reference))
    return quantized(jnp.swapaxes(w3, 1, 2), recipe, reference), None


def amax_reference(w: Operand) -> jax.Array | None:
    """An array varying as the weight's state does (inside a pipeline stage: over ``stage``): the amaxes are
    reduced over the other axes a tensor's parts vary over."""
    return w.history if w.history is not None else w.grad_history


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(shape: _Shape, x: Operand, w: Operand) -> jax.Array:
    return _forward(shape, x, w)[0]


def _forward(shape: _Shape, x: Operand, w: Operand) -> tuple[jax.Array, tuple]:
    lhs, rhs, out = letters(shape.equation)
    batch, free_x, contract, free_w = split(shape.equation)
    ref = amax_reference(w)
    x3, w3 = _stack(x.value, lhs, batch, free_x, contract), _stack(w.value, rhs, batch, contract, free_w)
    along_k, along_n = weight_blocks(w3, shape.recipe, ref)
    y = gemm(quantized(x3, shape.recipe, ref), along_k)
    sizes = dict(zip(lhs, shape.x_shape, strict=True)) | dict(zip(rhs, shape.w_shape, strict=True))
    y = tensor(y if batch else y[0], sizes, batch + free_x + free_w, out).astype(shape.x_dtype)
    amaxes = jnp.max(jnp.abs(x3.astype(jnp.float32))), jnp.max(jnp.abs(w3.astype(jnp.float32)), axis=(1, 2))
    kept = w3 if along_n is None else along_n
    return y, (x3, kept, amaxes, ref, x.history, w.history, w.grad_history)


def _weight_grad(x3: jax.Array, g3: jax.Array, recipe: Recipe, ref: jax.Array | None) -> jax.Array:
    """``dw = xᵀ · g`` ``[B, K, N]`` from blocks along the tokens (NVFP4: Hadamard-transformed, ``g`` rounded
    stochastically, as the recipe says)."""
    block = BLOCK[recipe.mode]
    xt, gt = (padded(jnp.swapaxes(a, 1, 2), block) for a in (x3, g3))  # [B, K, M], [B, N, M]
    if recipe.mode == "nvfp4" and recipe.hadamard:
        xt, gt = mx.hadamard(xt), mx.hadamard(gt)
    sr = recipe.mode == "nvfp4" and recipe.stochastic_rounding
    return gemm(quantized(xt, recipe, ref), quantized(gt, recipe, ref, stochastic=sr))


def _backward(shape: _Shape, saved: tuple, g: jax.Array) -> tuple[Operand, Operand]:
    x3, kept, (x_amax, w_amax), ref, x_history, w_history, g_history = saved
    lhs, rhs, out = letters(shape.equation)
    batch, free_x, contract, free_w = split(shape.equation)
    recipe = shape.recipe
    g3 = _stack(g, out, batch, free_x, free_w)  # [B, M, N]
    sr = recipe.mode == "nvfp4" and recipe.stochastic_rounding
    w_n = kept if isinstance(kept, mx.Blocks) else quantized(kept, recipe, ref)  # [B, K, N] along N
    dx = gemm(quantized(g3, recipe, ref, stochastic=sr), w_n)  # [B, M, K]
    dw = _weight_grad(x3, g3, recipe, ref)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(w_n.q).mat.varying))
    if summed:
        dw = lax.psum(dw, summed)
    summed = tuple(sorted(jax.typeof(dx).mat.varying - jax.typeof(x3).mat.varying))
    if summed:  # x the same on the devices w is split over (TP inside a pipeline stage): its partial gradients
        dx = lax.psum(dx, summed)
    sizes = dict(zip(out, g.shape, strict=True)) | dict(zip(lhs, shape.x_shape, strict=True))
    sizes |= dict(zip(rhs, shape.w_shape, strict=True))
    dx = tensor(dx if batch else dx[0], sizes, batch + free_x + contract, lhs).astype(shape.x_dtype)
    dw = tensor(dw if batch else dw[0], sizes, batch + contract + free_w, rhs).astype(shape.w_dtype)
    w_amax = w_amax if batch else w_amax[0]
    return (
        Operand(dx, Deferred(), pushed(x_history, x_amax), None, recipe),
        Operand(dw, Deferred(), pushed(w_history, w_amax), pushed(g_history, jnp.max(jnp.abs(g3))), recipe),
    )


_einsum.defvjp(_forward, _backward)

