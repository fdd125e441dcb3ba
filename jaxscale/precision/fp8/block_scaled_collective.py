"""Block-scaled collective matmuls (``precision.fp8: mxfp8 | nvfp4`` under ``model.tp_overlap``): the rings of
:mod:`jaxscale.layout.ring` with :func:`jaxscale.precision.fp8.block_scaled.einsum` on each chunk.

A forward block runs along the contraction (a token's K or N elements), so a chunk of the sequence quantizes as
it does in the whole; the weight gradient's blocks run along the tokens, here a chunk's (each device's part of
the sequence a multiple of the block: :mod:`jaxscale.config.refusals`). The backward is autodiff's through each
chunk's projection (its own VJP: the three block-scaled GEMMs) and the ring (a ``ppermute``'s transpose is the
reverse one). Each amax history is pushed once, with the whole tensor's amax (the maximum over the ring,
:func:`jaxscale.precision.fp8.scaling.global_amax`): by the first step's projection where the ring's first
chunks make up the tensor, else around the collective matmul (:func:`_push`); the other steps read them without
a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.ring import AxisName, chunk, place, reduce_scattered, ring
from jaxscale.precision.fp8.block_scaled import einsum
from jaxscale.precision.fp8.operand import Operand, pushed, sharing
from jaxscale.precision.letters import letters


def _varying(w: Operand, like: jax.Array) -> Operand:
    """``w`` typed as varying over ``like``'s mesh axes too: its ``t`` uses' gradients summed before one
    reduction over those axes."""
    missing = tuple(sorted(jax.typeof(like).mat.varying - jax.typeof(w.value).mat.varying))
    return w.replace(value=lax.pcast(w.value, missing, to="varying")) if missing else w


def _quiet(a: Operand, *, history: bool = False, grad_history: bool = False) -> Operand:
    """``a`` for one ring step: the histories not named read, not updated (no gradient)."""
    keep = lambda h, on: h if on else jax.tree.map(lax.stop_gradient, h)  # noqa: E731
    return a.replace(history=keep(a.history, history), grad_history=keep(a.grad_history, grad_history))


@jax.custom_vjp
def _push(a: jax.Array, history: jax.Array, amax: jax.Array | None) -> jax.Array:
    """``a``; the "gradient" of ``history`` is it with ``amax`` pushed (None: the amax of ``a``'s gradient), over
    the devices holding parts (:func:`jaxscale.precision.fp8.operand.pushed`): a whole tensor's amax where no
    ring step's projection sees all of it."""
    return a


def _push_forward(a: jax.Array, history: jax.Array, amax: jax.Array | None) -> tuple[jax.Array, tuple]:
    return a, (history, amax)


def _push_backward(saved: tuple, g: jax.Array) -> tuple:
    history, amax = saved
    seen = jnp.max(jnp.abs(g)).astype(jnp.float32) if amax is None else amax
    return g, pushed(history, seen), None if amax is None else jnp.zeros_like(amax)


_push.defvjp(_push_forward, _push_backward)


def all_gather_matmul(x: Operand, weights: Sequence[tuple[str, Operand]], axis: AxisName, dim: int) -> list[jax.Array]:
    """:func:`jaxscale.parallel.collective_matmul.all_gather_matmul` block-scaled. The first step's projections push
    the input's and the weights' amaxes (the devices' own chunks: the whole input over the ring); each output's
    gradient amax is pushed whole (:func:`_push`: a step sees one chunk of each device's columns)."""
    n = lax.axis_size(axis)
    ws = [(eq, _varying(w, x.value)) for eq, w in weights]
    out_dims = [letters(eq)[2].index(letters(eq)[0][dim]) for eq, _ in ws]
    outs: list[jax.Array | None] = [None] * len(ws)
    steps = []

    def use(index: jax.Array, held: jax.Array) -> list[jax.Array]:
        first = not steps
        steps.append(index)
        xs = sharing(_quiet(x.replace(value=held), history=first), len(ws))  # x's history pushed once
        parts = [einsum(eq, xk, _quiet(w, history=first)) for xk, (eq, w) in zip(xs, ws, strict=True)]
        for k, (part, d) in enumerate(zip(parts, out_dims, strict=True)):
            outs[k] = place(outs[k], part, index, d, n)
        return parts

    ring(x.value, axis, use)
    return [y if w.grad_history is None else _push(y, w.grad_history, None)
            for y, (_, w) in zip(outs, ws, strict=True)]


def matmul_reduce_scatter(equation: str, h: Operand, w: Operand, axis: AxisName, dim: int) -> jax.Array:
    """:func:`jaxscale.parallel.collective_matmul.matmul_reduce_scatter` block-scaled. The input's amax is pushed
    whole (:func:`_push`), the weight's and the output gradient's by the first step (its chunk of the output:
    the whole output gradient over the ring)."""
    n = lax.axis_size(axis)
    lhs, _, out = letters(equation)
    h_dim = lhs.index(out[dim])
    w = _varying(w, h.value)
    value = h.value if h.history is None else _push(h.value, h.history, jnp.max(jnp.abs(h.value)).astype(jnp.float32))
    steps = []

    def part(index: jax.Array) -> jax.Array:
        first = not steps
        steps.append(index)
        held = _quiet(h.replace(value=chunk(value, index, h_dim, n)))
        return einsum(equation, held, _quiet(w, history=first, grad_history=first))

    return reduce_scattered(part, axis)
