"""Collective matmul: tensor parallelism's all-gather and reduce-scatter cut into ring steps that overlap matmuls.

Under Megatron sequence parallelism (:mod:`jaxscale.parallel.sequence`) each
tensor-parallel region starts with an all-gather of the sequence-sharded
input and ends with a reduce-scatter of partial sums, and the matmuls wait
for them. The collective matmul of Wang et al. (2023, "Overlap communication
with dependent computation via decomposition in large deep learning
models"), as MaxText uses it on TPU and as the JAX ``shard_map`` tutorial
writes it, splits each collective into ``t−1`` point-to-point steps around
the ring of the ``t`` tensor-parallel devices (``lax.ppermute``) and
interleaves them with ``t`` partial matmuls, each on the chunk a device
holds at that step:

* :func:`all_gather_matmul` (column-parallel entry): each device starts with
  its own sequence chunk; at every step it multiplies the chunk it holds into
  that chunk's slot of the output while passing the chunk on to its
  neighbour. After ``t`` steps every device has multiplied every chunk.
* :func:`matmul_reduce_scatter` (row-parallel exit): at every step a device
  computes its partial product for one destination chunk, adds it to the
  accumulator it received and passes the sum on; after ``t`` steps the
  accumulator a device holds is the full sum for its own chunk.

**What it communicates**: the same bytes as the collective it replaces:
``t−1`` collective-permutes of one chunk, ``(t−1)/t·b·s·h·bytes`` per device
for each all-gather or reduce-scatter (docs/formulas.md, "TP + SP"). The backward
is autodiff's: the transpose of a ``ppermute`` is the reverse ``ppermute``,
so the gradient of the all-gather-matmul is a decomposed matmul-reduce-scatter
and vice versa, ``t−1`` collective-permutes each too (the compiled step
shows them; ``tests/test_collective_matmul.py`` counts them).

**What it saves**: time, not bytes or memory. A plain all-gather must finish
before the first FLOP of the matmul that consumes it; here step ``k+1``'s
transfer runs while step ``k``'s partial matmul computes, so at most one
chunk's transfer is exposed. That needs a backend that runs
collective-permutes asynchronously and a scheduler that overlaps them (the
latency-hiding scheduler on GPU, ``xla.preset: gpu``; TPU by default), and a
chunk matmul long enough to cover a transfer: ``b·(s/t)·h·f/t`` FLOPs per
``b·(s/t)·h`` bytes, the TP condition ``(t−1)/(2h)·F/W ≤ 1`` of docs/formulas.md
per step. On XLA:CPU the permutes run synchronously: the CPU tests only
prove the result (forward and gradients) equals the plain collectives'.

Both functions run inside a ``jax.shard_map`` that is manual over ``axis``
(one mesh axis or a tuple of them, ring-ordered as ``lax.all_gather`` orders
them); the loop over steps is unrolled in Python (``t`` is a mesh size), so
XLA sees every step and may schedule each transfer against the previous
matmul. fp8 operands take their recipe's rings (:func:`jaxscale.precision.fp8.kernels`, their own backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout import collectives
from jaxscale.layout.ring import AxisName, after, from_neighbour
from jaxscale.precision import policy as precision
from jaxscale.precision.letters import letters


def _varying_like(w: jax.Array, x: jax.Array, grads: jnp.dtype | None) -> jax.Array:
    """``w`` typed as varying over ``x``'s mesh axes too, once: the gradients of its ``t`` uses are then
    summed before the one reduction over those axes (data parallelism's, in ``grads`` if given), instead of
    reduced one by one."""
    missing = tuple(sorted(jax.typeof(x).mat.varying - jax.typeof(w).mat.varying))
    if not missing:
        return w
    return lax.pcast(w, missing, to="varying") if grads is None else collectives.vary(w, missing, jnp.dtype(grads))


def all_gather_matmul(
    x: jax.Array,
    weights: Sequence[tuple[str, jax.Array]],
    axis: AxisName,
    dim: int,
    grads: jnp.dtype | None = None,
) -> list[jax.Array]:
    """``einsum(eq, all_gather(x, axis, dim, tiled), w)`` for each ``(eq, w)``, as ``t`` ring steps.

    ``x`` is this device's chunk of dimension ``dim``; each output has the gathered length on
    the dimension that ``x``'s ``dim`` maps to in its equation. ``grads``: the weight gradients'
    dtype (:func:`jaxscale.precision.policy.einsum`).
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    chunk = x.shape[dim]
    out_dims = []
    for eq, _ in weights:
        lhs, _, out = letters(eq)
        out_dims.append(out.index(lhs[dim]))
    weights = [(eq, _varying_like(w, x, grads)) for eq, w in weights]
    outs: list[jax.Array | None] = [None] * len(weights)
    held = x
    for step in range(n):
        # Send on what this device holds before multiplying it, so the transfer can overlap the matmul.
        following = from_neighbour(held, axis, n, 1) if step < n - 1 else None
        start = ((me + step) % n) * chunk  # device i holds chunk (i + step) mod n
        parts = [precision.einsum(eq, held, w, grads) for eq, w in weights]
        for k, (part, d) in enumerate(zip(parts, out_dims, strict=True)):
            if outs[k] is None:
                shape = list(part.shape)
                shape[d] *= n
                outs[k] = jnp.zeros(shape, part.dtype)
            outs[k] = lax.dynamic_update_slice_in_dim(outs[k], part, start, d)
        held = None if following is None else after(parts, following)
    return outs


def matmul_reduce_scatter(
    equation: str, h: jax.Array, w: jax.Array, axis: AxisName, dim: int, grads: jnp.dtype | None = None
) -> jax.Array:
    """``psum_scatter(einsum(equation, h, w), axis, scatter_dimension=dim, tiled)``, as ``t`` ring steps.

    ``h`` holds the full length of the output's dimension ``dim`` (and this device's share of the
    contracted dimensions); the result is this device's chunk of it, summed over ``axis``. ``grads``:
    the weight gradient's dtype (:func:`jaxscale.precision.policy.einsum`).
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    lhs, _, out = letters(equation)
    h_dim = lhs.index(out[dim])
    chunk = h.shape[h_dim] // n
    w = _varying_like(w, h, grads)
    acc = None
    for step in range(n):
        # The accumulator of chunk (i − step − 1) mod n: the last step's is this device's own chunk.
        start = ((me - step - 1) % n) * chunk
        part = precision.einsum(equation, lax.dynamic_slice_in_dim(h, start, chunk, h_dim), w, grads)
        acc = part if acc is None else acc + part
        if step < n - 1:
            acc = from_neighbour(acc, axis, n, -1)
            h = after(part, h)  # the next partial matmul after this one, while its sum travels
    return acc
