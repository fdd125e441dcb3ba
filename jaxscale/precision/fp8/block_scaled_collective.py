"""Block-scaled collective matmuls (``precision.fp8: mxfp8 | nvfp4`` under ``model.tp_overlap``): the rings of
:mod:`jaxscale.layout.ring` with :func:`jaxscale.precision.fp8.block_scaled.einsum` on each chunk.

A forward block runs along the contraction (a token's K or N elements), so a chunk of the sequence quantizes as
it does in the whole; the weight gradient's blocks run along the tokens, here a chunk's (each device's part of
the sequence a multiple of the block: :mod:`jaxscale.config.refusals`). The backward is autodiff's through each
chunk's projection (its own VJP: the three block-scaled GEMMs) and the ring (a ``ppermute``'s transpose is the
reverse one). The amax histories are pushed by the first step's projection, whose amaxes are the maxima over the
ring (:func:`jaxscale.precision.fp8.scaling.global_amax`); the later steps read them without a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax

from jaxscale.layout.ring import AxisName, chunk, place, reduce_scattered, ring
from jaxscale.precision.fp8.block_scaled import einsum
from jaxscale.precision.fp8.operand import Operand
from jaxscale.precision.letters import letters


def _varying(w: Operand, like: jax.Array) -> Operand:
    """``w`` typed as varying over ``like``'s mesh axes too: its ``t`` uses' gradients summed before one
    reduction over those axes."""
    missing = tuple(sorted(jax.typeof(like).mat.varying - jax.typeof(w.value).mat.varying))
    return w.replace(value=lax.pcast(w.value, missing, to="varying")) if missing else w


def _quiet(a: Operand, first: bool) -> Operand:
    """``a`` for one ring step: its histories updated by the first step only (read, not updated, by the rest)."""
    if first:
        return a
    return a.replace(history=jax.tree.map(lax.stop_gradient, a.history),
                     grad_history=jax.tree.map(lax.stop_gradient, a.grad_history))


def all_gather_matmul(x: Operand, weights: Sequence[tuple[str, Operand]], axis: AxisName, dim: int) -> list[jax.Array]:
    """:func:`jaxscale.parallel.collective_matmul.all_gather_matmul` block-scaled."""
    n = lax.axis_size(axis)
    ws = [(eq, _varying(w, x.value)) for eq, w in weights]
    out_dims = [letters(eq)[2].index(letters(eq)[0][dim]) for eq, _ in ws]
    outs: list[jax.Array | None] = [None] * len(ws)
    steps = []

    def use(index: jax.Array, held: jax.Array) -> list[jax.Array]:
        first = not steps
        steps.append(index)
        xs = _quiet(x.replace(value=held), first)
        parts = [einsum(eq, xs, _quiet(w, first)) for eq, w in ws]
        for k, (part, d) in enumerate(zip(parts, out_dims, strict=True)):
            outs[k] = place(outs[k], part, index, d, n)
        return parts

    ring(x.value, axis, use)
    return outs


def matmul_reduce_scatter(equation: str, h: Operand, w: Operand, axis: AxisName, dim: int) -> jax.Array:
    """:func:`jaxscale.parallel.collective_matmul.matmul_reduce_scatter` block-scaled."""
    n = lax.axis_size(axis)
    lhs, _, out = letters(equation)
    h_dim = lhs.index(out[dim])
    w = _varying(w, h.value)
    steps = []

    def part(index: jax.Array) -> jax.Array:
        first = not steps
        steps.append(index)
        held = h.replace(value=chunk(h.value, index, h_dim, n))
        return einsum(equation, _quiet(held, first), _quiet(w, first))

    return reduce_scattered(part, axis)
