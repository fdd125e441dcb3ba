"""Collective matmul in fp8: the ring steps of :mod:`jaxscale.parallel.collective_matmul` on float8 operands.

Per-tensor fp8 (``precision.fp8`` ``delayed`` or ``current``, :mod:`jaxscale.precision.fp8.per_tensor`) under
``model.tp_overlap``: one scale per operand for the whole collective matmul, the same as
the plain collectives' step uses. The input and the weights arrive quantized (their
amaxes are global), so the ring passes e4m3 chunks and each step's ``dot_general`` takes
them as they are. The output gradient is quantized once, over the whole gradient (its
amax a ``pmax`` over the ring, :func:`jaxscale.precision.fp8.scaling.global_amax`), inside one
``custom_vjp`` around the whole collective matmul: autodiff through the steps would
quantize each step's chunk of it on its own and push into the history once per step.

- :func:`all_gather_matmul`: forward as the bf16 ring, keeping the gathered e4m3 input;
  backward: the input gradient as a matmul-reduce-scatter ring of ``e5m2 x e4m3`` dots,
  each weight gradient one ``e4m3 x e5m2`` dot of the gathered input and the whole
  output gradient (the plain step's).
- :func:`matmul_reduce_scatter`: forward as the bf16 ring; backward: the e5m2 output
  gradient's chunks passed around the ring into the input gradient's ``e5m2 x e4m3``
  dots and gathered for the one weight-gradient dot.

The histories get one push per step each, as :func:`jaxscale.precision.fp8.per_tensor.einsum`'s backward gives them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.ring import AxisName, chunk, place, reduce_scattered, ring
from jaxscale.precision.fp8 import per_tensor as fp8
from jaxscale.precision.fp8.operand import Operand, pushed
from jaxscale.precision.fp8.scaling import E5M2, Quantized, Recipe, along, quantize
from jaxscale.precision.letters import letters


class _Static(NamedTuple):
    equations: tuple[str, ...]
    axis: AxisName
    dim: int
    recipe: Recipe
    x_dtype: Any
    w_dtypes: tuple[Any, ...]


def _weight_grad(equation: str, qa: Quantized, qg: Quantized, w: Quantized, dtype: Any) -> jax.Array:
    """``dw`` of ``equation`` from the whole e4m3 input and e5m2 output gradient, summed as
    :func:`jaxscale.precision.fp8.per_tensor.einsum`'s."""
    lhs, rhs, out = letters(equation)
    dw = fp8.dot(f"{lhs},{out}->{rhs}", qa.q, qg.q) * (qa.scale * qg.scale)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(w.q).mat.varying))
    return (lax.psum(dw, summed) if summed else dw).astype(dtype)


def _scaled_dot(equation: str, a: jax.Array, sa: jax.Array, w: Quantized, dtype: Any) -> jax.Array:
    """``dot(a, w) * sa * w.scale`` in ``dtype``; ``w`` the equation's right operand."""
    _, rhs, out = letters(equation)
    return (fp8.dot(equation, a, w.q) * (sa * along(w.scale, rhs, out))).astype(dtype)


def _input_grad_equation(equation: str) -> str:
    lhs, rhs, out = letters(equation)
    return f"{out},{rhs}->{lhs}"


def all_gather_matmul(
    x: Operand, weights: Sequence[tuple[str, Operand]], axis: AxisName, dim: int
) -> list[jax.Array]:
    """:func:`jaxscale.parallel.collective_matmul.all_gather_matmul` of an e4m3 input and e4m3 weights."""
    static = _Static(
        tuple(eq for eq, _ in weights), axis, dim, x.recipe, jnp.dtype(x.value.dtype),
        tuple(jnp.dtype(w.value.dtype) for _, w in weights),
    )
    return list(_gather(static, x, tuple(w for _, w in weights)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(static: _Static, x: Operand, ws: tuple[Operand, ...]) -> tuple[jax.Array, ...]:
    return _gather_forward(static, x, ws)[0]


def _gather_forward(static: _Static, x: Operand, ws: tuple[Operand, ...]) -> tuple[tuple, tuple]:
    n, qx = lax.axis_size(static.axis), x.quantized
    out_dims = [letters(eq)[2].index(letters(eq)[0][static.dim]) for eq in static.equations]
    outs: list[jax.Array | None] = [None] * (len(ws) + 1)  # the outputs, then the gathered input

    def use(index: jax.Array, held: jax.Array) -> list[jax.Array]:
        parts = [_scaled_dot(eq, held, qx.scale, w.quantized, static.x_dtype)
                 for eq, w in zip(static.equations, ws, strict=True)]
        for k, (part, d) in enumerate(zip([*parts, held], [*out_dims, static.dim], strict=True)):
            outs[k] = place(outs[k], part, index, d, n)
        return parts

    ring(qx.q, static.axis, use)
    *outs, gathered = outs
    saved = (qx._replace(q=gathered), x.history, tuple((w.quantized, w.history, w.grad_history) for w in ws))
    return tuple(outs), saved


def _gather_backward(static: _Static, saved: tuple, gs: tuple[jax.Array, ...]) -> tuple:
    qx, x_history, weights = saved
    n = lax.axis_size(static.axis)
    qgs = [quantize(g, gh, E5M2, static.recipe) for g, (_, _, gh) in zip(gs, weights, strict=True)]

    def dx_chunk(index: jax.Array) -> jax.Array:
        parts = []
        for eq, qg, (qw, _, _) in zip(static.equations, qgs, weights, strict=True):
            lhs, _, out = letters(eq)
            g = chunk(qg.q, index, out.index(lhs[static.dim]), n)
            parts.append(_scaled_dot(_input_grad_equation(eq), g, qg.scale, qw, static.x_dtype))
        return sum(parts[1:], parts[0])

    dx = reduce_scattered(dx_chunk, static.axis)
    dws = []
    for eq, qg, (qw, history, g_history), dtype in zip(static.equations, qgs, weights, static.w_dtypes, strict=True):
        dw = _weight_grad(eq, qx, qg, qw, dtype)
        dws.append(Operand(dw, fp8.NONE, pushed(history, qw.amax), pushed(g_history, qg.amax), static.recipe))
    return Operand(dx, fp8.NONE, pushed(x_history, qx.amax), None, static.recipe), tuple(dws)


_gather.defvjp(_gather_forward, _gather_backward)


def matmul_reduce_scatter(equation: str, h: Operand, w: Operand, axis: AxisName, dim: int) -> jax.Array:
    """:func:`jaxscale.parallel.collective_matmul.matmul_reduce_scatter` of an e4m3 input and an e4m3 weight."""
    static = _Static((equation,), axis, dim, h.recipe, jnp.dtype(h.value.dtype), (jnp.dtype(w.value.dtype),))
    return _scatter(static, h, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter(static: _Static, h: Operand, w: Operand) -> jax.Array:
    return _scatter_forward(static, h, w)[0]


def _h_dim(static: _Static) -> int:
    lhs, _, out = letters(static.equations[0])
    return lhs.index(out[static.dim])


def _scatter_forward(static: _Static, h: Operand, w: Operand) -> tuple[jax.Array, tuple]:
    n, qh, (eq,) = lax.axis_size(static.axis), h.quantized, static.equations
    y = reduce_scattered(
        lambda index: _scaled_dot(eq, chunk(qh.q, index, _h_dim(static), n), qh.scale, w.quantized, static.x_dtype),
        static.axis,
    )
    return y, (qh, h.history, w.quantized, w.history, w.grad_history)


def _scatter_backward(static: _Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand]:
    qh, h_history, qw, w_history, g_history = saved
    n, (eq,) = lax.axis_size(static.axis), static.equations
    qg = quantize(g, g_history, E5M2, static.recipe)
    dh, gathered = [None], [None]

    def use(index: jax.Array, held: jax.Array) -> jax.Array:
        part = _scaled_dot(_input_grad_equation(eq), held, qg.scale, qw, static.x_dtype)
        dh[0] = place(dh[0], part, index, _h_dim(static), n)
        gathered[0] = place(gathered[0], held, index, static.dim, n)
        return part

    ring(qg.q, static.axis, use)
    dh, gathered = dh[0], gathered[0]
    dw = _weight_grad(eq, qh, qg._replace(q=gathered), qw, static.w_dtypes[0])
    dh_op = Operand(dh, fp8.NONE, pushed(h_history, qh.amax), None, static.recipe)
    dw_op = Operand(dw, fp8.NONE, pushed(w_history, qw.amax), pushed(g_history, qg.amax), static.recipe)
    return dh_op, dw_op


_scatter.defvjp(_scatter_forward, _scatter_backward)
