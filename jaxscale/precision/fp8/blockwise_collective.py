"""Blockwise FP8 collective matmuls: the rings of :mod:`jaxscale.precision.fp8.collective` with a scale per tile.

``precision.fp8: blockwise`` (:mod:`jaxscale.precision.fp8.blockwise`, tiles and blocks of ``B``) under
``model.tp_overlap``. A tile is one token's ``B`` elements along the contraction (``1 x B``) or, for a
weight gradient, ``B`` consecutive tokens of one sequence (``B x 1``); with ``B`` dividing each device's
part of the sequence (:meth:`jaxscale.layout.rules.Layout.validate`) every tile lies in one device's chunk. Each
device quantizes its own chunk, and the ring passes float8 chunks with their fp32 scales (a chunk's scales
travel with it): the tiles are the plain collectives' (:func:`jaxscale.precision.fp8.blockwise.einsum` on the
gathered arrays), so the step quantizes as theirs does. One ``custom_vjp`` around each collective matmul.

- :func:`all_gather_matmul`: the input chunk in ``1 x B`` tiles along the contraction (the forward's t
  block dots per projection) and in ``B x 1`` tiles along its tokens (the weight gradient's), both passed
  around the ring; the second gathered is the residual (1 byte an element, where the plain step keeps the
  gathered input in the compute dtype). Backward: the whole output gradient in e5m2 tiles, the input gradient a
  matmul-reduce-scatter ring of ``e5m2 x e4m3`` block dots, each weight gradient one block dot.
- :func:`matmul_reduce_scatter`: forward as the bf16 ring (partial sums travel) on the input's ``1 x B``
  tiles; backward: the output gradient's chunk in e5m2 ``1 x B`` tiles along the output (the input
  gradient's block dots) and ``B x 1`` tiles along its tokens (the weight gradient's), both passed around.

Bytes: a chunk crosses the ring in two float8 tilings and their scales, ``2·(1 + 4/B)`` bytes an element
(B = 128: 2.06), about the bf16 ring's 2. Each ring step's block dot is
:func:`jaxscale.precision.fp8.blockwise.block_dot`
on the chunk (a batched fp8 GEMM over the K/B slices and its fp32 partial products, as there). The histories
get one push per step each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.ring import AxisName, chunk, place, reduce_scattered, ring
from jaxscale.precision.fp8.blockwise import block_dot, blocks, matrix, tensor, tiles, transposed
from jaxscale.precision.fp8.operand import Deferred, Operand, pushed
from jaxscale.precision.fp8.scaling import E4M3, E5M2, Quantized, Recipe
from jaxscale.precision.letters import letters, split


class _Static(NamedTuple):
    equations: tuple[str, ...]
    axis: AxisName
    dim: int  # the sequence's dimension: in the input (all-gather), in the output (reduce-scatter)
    recipe: Recipe
    x_dtype: Any
    w_dtypes: tuple[Any, ...]
    x_shape: tuple[int, ...]  # this device's input
    w_shapes: tuple[tuple[int, ...], ...]


def _static(equations: tuple[str, ...], axis: AxisName, dim: int, x: Operand, ws: Sequence[Operand]) -> _Static:
    return _Static(
        equations, axis, dim, x.recipe, jnp.dtype(x.value.dtype), tuple(jnp.dtype(w.value.dtype) for w in ws),
        tuple(x.value.shape), tuple(tuple(w.value.shape) for w in ws),
    )


class _Letters(NamedTuple):
    """An equation read as a matrix product: the operands' and output's letters, the input's free letters (the
    rows, the sequence last), the contracted ones and the weight's free ones; each letter's size."""

    lhs: str
    rhs: str
    out: str
    rows: str
    contract: str
    cols: str
    sizes: dict[str, int]

    def chunk(self, length: int) -> dict[str, int]:
        """The sizes with the sequence ``length`` long (one device's chunk)."""
        return self.sizes | {self.rows[-1]: length}


def _equations(static: _Static, seq: str) -> list[_Letters]:
    found = []
    for equation, w_shape in zip(static.equations, static.w_shapes, strict=True):
        lhs, rhs, out = letters(equation)
        batch, rows, contract, cols = split(equation)
        if batch or not rows.endswith(seq):
            raise ValueError(f"blockwise fp8 collective matmul {equation!r}: the sequence {seq!r} must end the rows")
        sizes = dict(zip(lhs, static.x_shape, strict=True)) | dict(zip(rhs, w_shape, strict=True))
        found.append(_Letters(lhs, rhs, out, rows, contract, cols, sizes))
    return found


def _tiled(a: jax.Array, dims: Sequence[int], block: int, fmt: Any, margin: int) -> tuple[Quantized, Quantized]:
    """Matrix ``a`` [M, K] (M: ``dims`` flattened, the sequence last) in ``1 x B`` tiles, values and scales shaped
    ``[*dims, K]``, ``[*dims, K/B]``, and in ``B x 1`` tiles along its tokens, ``[K, *dims]``, ``[K, *dims/B]``
    (the sequence's tiles): arrays whose chunks along the sequence are a chunk's tiles."""
    k = a.shape[1]
    rows, cols = tiles(a, block, fmt, margin), tiles(transposed(a), block, fmt, margin)
    along = (*dims[:-1], dims[-1] // block)
    return (
        rows._replace(q=rows.q.reshape(*dims, k), scale=rows.scale.reshape(*dims, k // block)),
        cols._replace(q=cols.q.reshape(k, *dims), scale=cols.scale.reshape(k, *along)),
    )


def _dot(q: jax.Array, scale: jax.Array, w: Quantized, block: int, transpose: bool = False) -> jax.Array:
    """Row tiles ``q`` [*dims, K] (scales [*dims, K/B]) times weight blocks ``w`` [K, N] (or ``wᵀ``): [M, N] fp32."""
    qw, sw = (transposed(w.q), transposed(w.scale)) if transpose else (w.q, w.scale)
    a, sa = q.reshape(-1, q.shape[-1]), scale.reshape(-1, scale.shape[-1])
    return block_dot(a, sa, qw, jnp.repeat(sw, block, axis=1), block)


def _weight_grad(xt: Quantized, gt: Quantized, w: Quantized, eq: _Letters, block: int, dtype: Any) -> jax.Array:
    """``dw`` from the input's and the output gradient's token tiles over the whole sequence ([K|N, *dims])."""
    k, n = xt.q.shape[0], gt.q.shape[0]
    dw = block_dot(
        xt.q.reshape(k, -1), xt.scale.reshape(k, -1), transposed(gt.q.reshape(n, -1)),
        transposed(gt.scale.reshape(n, -1)), block,
    )
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(w.q).mat.varying))
    dw = lax.psum(dw, summed) if summed else dw
    return tensor(dw, eq.sizes, eq.contract + eq.cols, eq.rhs).astype(dtype)


def _pass_around(chunk: tuple, axis: AxisName, dim: int, use: Callable[..., Any]) -> list[jax.Array]:
    """Pass this device's ``chunk`` (row tiles, their scales, token tiles, their scales) around the ring: ``use``
    each chunk's row tiles as they arrive (its index, tiles, scales; what it returns is computed before the next
    chunk is used); returns the token tiles and their scales gathered along ``dim``."""
    n, gathered = lax.axis_size(axis), [None, None]

    def one(index: jax.Array, held: tuple) -> Any:
        q, s, qt, st = held
        gathered[:] = [place(g, a, index, dim, n) for g, a in zip(gathered, (qt, st), strict=True)]
        return use(index, q, s)

    ring(chunk, axis, one)
    return gathered


def all_gather_matmul(x: Operand, weights: Sequence[tuple[str, Operand]], axis: AxisName, dim: int) -> list[jax.Array]:
    """:func:`jaxscale.parallel.collective_matmul.all_gather_matmul` in blockwise fp8."""
    static = _static(tuple(eq for eq, _ in weights), axis, dim, x, [w for _, w in weights])
    return list(_gather(static, x, tuple(w for _, w in weights)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(static: _Static, x: Operand, ws: tuple[Operand, ...]) -> tuple[jax.Array, ...]:
    return _gather_forward(static, x, ws)[0]


def _gather_forward(static: _Static, x: Operand, ws: tuple[Operand, ...]) -> tuple[tuple, tuple]:
    n, b, margin = lax.axis_size(static.axis), static.recipe.block, static.recipe.margin
    seq = letters(static.equations[0])[0][static.dim]
    eqs = _equations(static, seq)
    first = eqs[0]
    if any((e.rows, e.contract) != (first.rows, first.contract) for e in eqs):
        raise ValueError(f"blockwise fp8 collective matmul {static.equations}: the input read two ways")
    dims = [first.sizes[c] for c in first.rows]
    qx, qxt = _tiled(matrix(x.value, first.lhs, "", first.rows, first.contract), dims, b, E4M3, margin)
    qws = [blocks(matrix(w.value, e.rhs, "", e.contract, e.cols), b, E4M3, margin)
           for e, w in zip(eqs, ws, strict=True)]
    outs: list[jax.Array | None] = [None] * len(ws)

    def use(index: jax.Array, q: jax.Array, s: jax.Array) -> list[jax.Array]:
        parts = [tensor(_dot(q, s, qw, b), eq.sizes, eq.rows + eq.cols, eq.out).astype(static.x_dtype)
                 for eq, qw in zip(eqs, qws, strict=True)]
        for k, (eq, part) in enumerate(zip(eqs, parts, strict=True)):
            outs[k] = place(outs[k], part, index, eq.out.index(seq), n)
        return parts

    gathered = _pass_around((qx.q, qx.scale, qxt.q, qxt.scale), static.axis, len(dims), use)
    xt = qxt._replace(q=gathered[0], scale=gathered[1])
    saved = (xt, qx.amax, x.history, tuple((qw, w.history, w.grad_history) for qw, w in zip(qws, ws, strict=True)))
    return tuple(outs), saved


def _gather_backward(static: _Static, saved: tuple, gs: tuple[jax.Array, ...]) -> tuple:
    xt, x_amax, x_history, weights = saved
    n, b, margin = lax.axis_size(static.axis), static.recipe.block, static.recipe.margin
    eqs = _equations(static, letters(static.equations[0])[0][static.dim])
    tiled = [
        _tiled(matrix(g, e.out, "", e.rows, e.cols), [g.shape[e.out.index(c)] for c in e.rows], b, E5M2, margin)
        for e, g in zip(eqs, gs, strict=True)
    ]

    def dx_chunk(index: jax.Array) -> jax.Array:
        parts = []
        for eq, (qg, _), (qw, _, _) in zip(eqs, tiled, weights, strict=True):
            q, s = (chunk(a, index, len(eq.rows) - 1, n) for a in (qg.q, qg.scale))
            dx = tensor(_dot(q, s, qw, b, transpose=True), eq.sizes, eq.rows + eq.contract, eq.lhs)
            parts.append(dx.astype(static.x_dtype))
        return sum(parts[1:], parts[0])

    dx = reduce_scattered(dx_chunk, static.axis)
    dws = []
    for eq, (qg, qgt), (qw, history, g_history), dtype in zip(eqs, tiled, weights, static.w_dtypes, strict=True):
        dw = _weight_grad(xt, qgt, qw, eq, b, dtype)
        dws.append(Operand(dw, Deferred(), pushed(history, qw.amax), pushed(g_history, qg.amax), static.recipe))
    return Operand(dx, Deferred(), pushed(x_history, x_amax), None, static.recipe), tuple(dws)


_gather.defvjp(_gather_forward, _gather_backward)


def matmul_reduce_scatter(equation: str, h: Operand, w: Operand, axis: AxisName, dim: int) -> jax.Array:
    """:func:`jaxscale.parallel.collective_matmul.matmul_reduce_scatter` in blockwise fp8."""
    return _scatter(_static((equation,), axis, dim, h, [w]), h, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter(static: _Static, h: Operand, w: Operand) -> jax.Array:
    return _scatter_forward(static, h, w)[0]


def _scatter_forward(static: _Static, h: Operand, w: Operand) -> tuple[jax.Array, tuple]:
    n, b, margin = lax.axis_size(static.axis), static.recipe.block, static.recipe.margin
    (eq,) = _equations(static, letters(static.equations[0])[2][static.dim])
    h2 = matrix(h.value, eq.lhs, "", eq.rows, eq.contract)
    qh = tiles(h2, b, E4M3, margin)
    dims = [eq.sizes[c] for c in eq.rows]
    q, s = qh.q.reshape(*dims, -1), qh.scale.reshape(*dims, -1)
    qw = blocks(matrix(w.value, eq.rhs, "", eq.contract, eq.cols), b, E4M3, margin)

    def part(index: jax.Array) -> jax.Array:
        qc, sc = (chunk(a, index, len(dims) - 1, n) for a in (q, s))
        y = tensor(_dot(qc, sc, qw, b), eq.chunk(dims[-1] // n), eq.rows + eq.cols, eq.out)
        return y.astype(static.x_dtype)

    y = reduce_scattered(part, static.axis)
    return y, (h2, qw, qh.amax, h.history, w.history, w.grad_history)


def _scatter_backward(static: _Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand]:
    h2, qw, h_amax, h_history, w_history, g_history = saved
    n, b, margin = lax.axis_size(static.axis), static.recipe.block, static.recipe.margin
    (eq,) = _equations(static, letters(static.equations[0])[2][static.dim])
    dims = [g.shape[eq.out.index(c)] for c in eq.rows]  # this device's chunk of the sequence
    qg, qgt = _tiled(matrix(g, eq.out, "", eq.rows, eq.cols), dims, b, E5M2, margin)
    dh: list[jax.Array | None] = [None]

    def use(index: jax.Array, q: jax.Array, s: jax.Array) -> jax.Array:
        part = tensor(_dot(q, s, qw, b, transpose=True), eq.chunk(dims[-1]), eq.rows + eq.contract, eq.lhs)
        dh[0] = place(dh[0], part.astype(static.x_dtype), index, eq.lhs.index(eq.rows[-1]), n)
        return part

    gathered = _pass_around((qg.q, qg.scale, qgt.q, qgt.scale), static.axis, len(dims), use)
    qht = tiles(transposed(h2), b, E4M3, margin)  # B x 1 along the tokens: [K, M]
    dw = _weight_grad(qht, qgt._replace(q=gathered[0], scale=gathered[1]), qw, eq, b, static.w_dtypes[0])
    dh_op = Operand(dh[0], Deferred(), pushed(h_history, h_amax), None, static.recipe)
    dw_op = Operand(dw, Deferred(), pushed(w_history, qw.amax), pushed(g_history, qg.amax), static.recipe)
    return dh_op, dw_op


_scatter.defvjp(_scatter_forward, _scatter_backward)
