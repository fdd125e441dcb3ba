"""Blockwise FP8 (``precision.fp8: blockwise``): DeepSeek-V3's recipe, a scale per tile and per block.

With ``B = precision.fp8_block`` (128 in DeepSeek-V3), each projection ``y = x · w`` is read as a matrix
product ``[M, K] · [K, N]`` (tokens x contracted letters, contracted x output letters of the einsum):

- activations in ``1 x B`` tiles: a row's ``B`` consecutive elements along the contraction share an fp32
  scale (``[M, K/B]`` scales), e4m3;
- weights in ``B x B`` blocks (``[K/B, N/B]`` scales), e4m3;
- backward: the output gradient in ``1 x B`` tiles along ``N`` for ``dx = g · wᵀ`` (e5m2 against the
  weight's e4m3 blocks, transposed as they are) and, for ``dw = xᵀ · g``, both operands in ``B x 1`` tiles
  along the tokens (``x`` e4m3, ``g`` e5m2): their contraction runs over ``M``.

A batch letter (the routed experts' ``e`` of the capacity buffers, ``becd,edf->becf``) makes each operand a
stack of matrices, one per expert: tiles of that expert's rows, blocks and a weight amax per expert (its
history ``[experts, steps]``), the tokens of the weight gradient's tiles padded with zero rows to a whole
tile (a buffer holds ``batch x capacity`` rows). The dropless experts' grouped matmuls:
:mod:`jaxscale.precision.fp8.blockwise_grouped`.

Each scale maps its tile's amax (times ``2^margin``) to the format's largest value, as
:func:`jaxscale.precision.fp8.scaling.scale_of`: scaling is current, per tile, so nothing waits on a history; the
per-tensor amaxes are still pushed into the module's histories (the state keeps one shape for every mode).

The matmul: ``dot_general`` of the float8 operands split into ``K/B`` slices of ``B`` (a batched fp8 GEMM,
``[K/B]`` batches of ``M x B x N``), accumulated in fp32, each slice's partial product times its tile and
block scales, summed over the slices. On GPU that is the form XLA can run on FP8 tensor cores
(``__cublas$lt$matmul$f8`` with a batch dimension), at a price: the ``[K/B, M, N]`` fp32 partial products
are ``4·K/B`` bytes per output element written and read again (llama-1b's MLP up-projection, 16K tokens:
K = 2048, 16 slices: 8.6 GB of partials for a 0.55 TFLOP matmul), where DeepGEMM (and cuBLASLt 12.9's
block-scaled modes) scale inside the kernel. XLA's other form, dequantizing into a bf16 GEMM, runs at
bf16 speed. The residual kept for the backward is ``x`` in the compute dtype (the weight gradient needs it
tiled the other way), the weight's e4m3 blocks and their scales.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.read import ConfigError
from jaxscale.precision.fp8.operand import Deferred, Operand, pushed
from jaxscale.precision.fp8.scaling import E4M3, E5M2, Quantized, Recipe, cast, scale_of
from jaxscale.precision.letters import letters, split


def ahead(a: jax.Array, history: jax.Array, recipe: Recipe) -> Deferred:
    """Nothing made ahead of the kernels: each tiles its operands itself (an activation or a weight)."""
    return Deferred()


def residual(x: Operand) -> jax.Array:
    """What a weight gradient reads of input ``x``: its compute-dtype values (tiled along the tokens for it)."""
    return x.value


def restored(x: Operand, kept: jax.Array) -> Operand:
    """Input ``x`` read from what was kept of it (:func:`residual`), without its history (pushed already)."""
    return x.replace(value=kept, history=None)


def tiles(a: jax.Array, block: int, fmt: Any, margin: int) -> Quantized:
    """``a`` [M, K] in ``fmt`` with one scale per ``1 x block`` tile (scale [M, K/block]); amax: the device's
    part's (:func:`jaxscale.precision.fp8.operand.pushed` takes the tensor's)."""
    m, k = a.shape
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)).reshape(m, k // block, block), axis=-1)
    s = scale_of(amax, fmt, margin)
    return Quantized(cast(a, jnp.repeat(s, block, axis=1), fmt), s, jnp.max(amax))


def blocks(w: jax.Array, block: int, fmt: Any, margin: int) -> Quantized:
    """``w`` [K, N] in ``fmt`` with one scale per ``block x block`` block (scale [K/block, N/block])."""
    k, n = w.shape
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)).reshape(k // block, block, n // block, block), axis=(1, 3))
    s = scale_of(amax, fmt, margin)
    return Quantized(cast(w, _expand(s, block), fmt), s, jnp.max(amax))


def _expand(s: jax.Array, block: int) -> jax.Array:
    """Block scales [K/B, N/B] at every element: [K, N]."""
    return jnp.repeat(jnp.repeat(s, block, axis=0), block, axis=1)


def block_dot(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array, block: int) -> jax.Array:
    """``[M, K] · [K, N]`` in fp32 of float8 ``qa`` (row scales per K slice: ``sa`` [M, K/B]) and ``qb`` (column
    scales per K slice: ``sb`` [K/B, N]): a batched fp8 dot over the K slices, scaled and summed."""
    (m, k), n = qa.shape, qb.shape[1]
    partial = lax.dot_general(
        qa.reshape(m, k // block, block),
        qb.reshape(k // block, block, n),
        (((2,), (1,)), ((1,), (0,))),
        preferred_element_type=jnp.float32,
    )  # [K/B, M, N]
    return jnp.sum(partial * sa.T[:, :, None] * sb[:, None, :], axis=0)


class _Shape(NamedTuple):
    """How an einsum's operands are read as matrices: letters (free, contracted) and the output's order."""

    equation: str
    recipe: Recipe
    x_dtype: Any
    w_dtype: Any
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]


def matrix(a: jax.Array, have: str, batch: str, rows: str, cols: str) -> jax.Array:
    """``a`` (letters ``have``) as a matrix ``[rows, cols]``, or with batch letters a stack ``[batch, rows, cols]``."""
    a = jnp.transpose(a, [have.index(c) for c in batch + rows + cols])
    lead = (math.prod(a.shape[: len(batch)]),) if batch else ()
    return a.reshape(*lead, math.prod(a.shape[len(batch) : len(batch + rows)]), -1)


def tensor(a: jax.Array, sizes: dict[str, int], have: str, want: str) -> jax.Array:
    """A matrix (or stack) of letters ``have`` (batch, rows, columns) back to the tensor of letters ``want``."""
    a = a.reshape([sizes[c] for c in have])
    return jnp.transpose(a, [have.index(c) for c in want])


def _per(fn: Callable, batch: str) -> Callable:
    """``fn`` on each matrix of a stack (batch letters: one leading dimension, :func:`matrix`), or as it is."""
    return jax.vmap(fn) if batch else fn


def padded(a: jax.Array, block: int) -> jax.Array:
    """``a`` with zero columns added up to a multiple of ``block`` (tiles along the tokens of a weight gradient:
    an expert's capacity buffer need not be whole tiles; a zero column changes no amax and no product)."""
    pad = -a.shape[-1] % block
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a


def _sizes(shape: _Shape) -> dict[str, int]:
    lhs, rhs, _ = letters(shape.equation)
    return dict(zip(lhs, shape.x_shape, strict=True)) | dict(zip(rhs, shape.w_shape, strict=True))


def einsum(equation: str, x: Operand, w: Operand) -> jax.Array:
    """``einsum(equation, x, w)`` in blockwise fp8, in ``x``'s dtype."""
    dtypes = jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)
    sizes = dict(zip(letters(equation)[1], w.value.shape, strict=True))
    _, _, contract, free_w = split(equation)
    k, n = math.prod(sizes[c] for c in contract), math.prod(sizes[c] for c in free_w)
    if k % x.recipe.block or n % x.recipe.block:  # a device's share: config validation checks the whole sizes
        raise ConfigError(f"precision.fp8=blockwise: the projection {equation} holds a {k} x {n} weight on each "
                          f"device (the tensor-parallel share inside a pipeline stage), not whole "
                          f"{x.recipe.block} x {x.recipe.block} blocks (precision.fp8_block)")
    return _einsum(_Shape(equation, x.recipe, *dtypes, tuple(x.value.shape), tuple(w.value.shape)), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(shape: _Shape, x: Operand, w: Operand) -> jax.Array:
    return _forward(shape, x, w)[0]


def _forward(shape: _Shape, x: Operand, w: Operand) -> tuple[jax.Array, tuple]:
    lhs, rhs, out = letters(shape.equation)
    batch, free_x, contract, free_w = split(shape.equation)
    b, margin = shape.recipe.block, shape.recipe.margin
    x2 = matrix(x.value, lhs, batch, free_x, contract)
    qx = _per(functools.partial(tiles, block=b, fmt=E4M3, margin=margin), batch)(x2)
    qw = _per(functools.partial(blocks, block=b, fmt=E4M3, margin=margin), batch)(
        matrix(w.value, rhs, batch, contract, free_w)
    )
    y = _per(functools.partial(block_dot, block=b), batch)(qx.q, qx.scale, qw.q, jnp.repeat(qw.scale, b, axis=-1))
    y = tensor(y, _sizes(shape), batch + free_x + free_w, out).astype(shape.x_dtype)
    return y, (x2, qw, jnp.max(qx.amax), x.history, w.history, w.grad_history)


def _backward(shape: _Shape, saved: tuple, g: jax.Array) -> tuple[Operand, Operand]:
    x2, qw, x_amax, x_history, w_history, g_history = saved
    lhs, rhs, out = letters(shape.equation)
    batch, free_x, contract, free_w = split(shape.equation)
    b, margin = shape.recipe.block, shape.recipe.margin
    e4m3, e5m2 = (_per(functools.partial(tiles, block=b, fmt=f, margin=margin), batch) for f in (E4M3, E5M2))
    dot = _per(functools.partial(block_dot, block=b), batch)
    sizes = _sizes(shape)
    g2 = matrix(g, out, batch, free_x, free_w)  # [M, N]
    qg = e5m2(g2)  # 1 x B along N
    dx = dot(qg.q, qg.scale, transposed(qw.q), jnp.repeat(transposed(qw.scale), b, axis=-1))
    qxt, qgt = e4m3(padded(transposed(x2), b)), e5m2(padded(transposed(g2), b))  # B x 1 along the tokens
    dw = dot(qxt.q, qxt.scale, transposed(qgt.q), transposed(qgt.scale))
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(qw.q).mat.varying))
    if summed:
        dw = lax.psum(dw, summed)
    summed = tuple(sorted(jax.typeof(dx).mat.varying - jax.typeof(x2).mat.varying))
    if summed:  # x the same on the devices w is split over (TP inside a pipeline stage): its partial gradients
        dx = lax.psum(dx, summed)

    dx = tensor(dx, sizes, batch + free_x + contract, lhs).astype(shape.x_dtype)
    dw = tensor(dw, sizes, batch + contract + free_w, rhs).astype(shape.w_dtype)
    return (
        Operand(dx, Deferred(), pushed(x_history, x_amax), None, shape.recipe),
        Operand(dw, Deferred(), pushed(w_history, qw.amax), pushed(g_history, jnp.max(qg.amax)), shape.recipe),
    )


def transposed(a: jax.Array) -> jax.Array:
    """A matrix, or each of a stack, transposed."""
    return jnp.swapaxes(a, -1, -2)


_einsum.defvjp(_forward, _backward)
