"""The steps of a ring of devices: a chunk passed to the neighbour, one step ordered after another, and the two
loops that collective matmuls are made of (every chunk used as it passes; partial sums accumulated round).

Both run inside a ``jax.shard_map`` manual over ``axis`` (one mesh axis or a tuple of them, ring-ordered as
``lax.all_gather`` orders them); the loop over steps is unrolled in Python (``t`` is a mesh size), so XLA sees
every step and may schedule each transfer against the previous step's work. The bf16 collective matmuls
(:mod:`jaxscale.parallel.collective_matmul`) and the fp8 ones (:mod:`jaxscale.precision.fp8.collective`,
:mod:`jaxscale.precision.fp8.blockwise_collective`) are written on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | tuple[str, ...]
T = TypeVar("T")


def from_neighbour(x: Any, axis: AxisName, n: int, offset: int) -> Any:
    """Device ``i`` receives ``x`` of device ``i + offset`` (mod ``n``)."""
    return lax.ppermute(x, axis, [(j, (j - offset) % n) for j in range(n)])


def after(done: Any, then: T) -> T:
    """``then`` unchanged, as a value XLA has only once ``done`` is computed: the ring's next partial matmul
    reads it, so the ``t`` partial matmuls run one after another, each overlapping a transfer. Without it
    XLA:GPU's dot merger joins them (they share the weight and none reads another) into one GEMM on the
    whole gathered input that waits for every transfer; the collective-permutes, left nothing to overlap,
    then run synchronously (``tests/test_compile_gpu_audit.py``). Autodiff transposes it into a barrier on
    the cotangents, yet XLA:GPU 0.12 still merges the backward's partial matmuls here (the fp8 rings'
    backward, written out in :mod:`jaxscale.precision.fp8.collective`, keeps most of them apart)."""
    return lax.optimization_barrier((done, then))[1]


def ring(x: Any, axis: AxisName, use: Callable[[jax.Array, Any], Any]) -> None:
    """``use(index, chunk)`` for each of the ``t`` chunks of ``x`` (a pytree) held around the ring, each sent on
    before it is used, and used once the previous chunk's ``use`` result is computed (:func:`after`: each
    transfer overlaps a partial matmul)."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    held = x
    for step in range(n):
        following = from_neighbour(held, axis, n, 1) if step < n - 1 else None
        done = use((me + step) % n, held)
        held = None if following is None else after(done, following)


def reduce_scattered(part: Callable[[jax.Array], jax.Array], axis: AxisName) -> jax.Array:
    """``sum over devices of part(i)`` for this device's chunk ``i``, accumulated around the ring, each
    ``part`` after the previous one (:func:`after`)."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    acc = p = None
    for step in range(n):
        index = (me - step - 1) % n
        p = part(index if p is None else after(p, index))  # after the previous part, not its sum's transfer
        acc = p if acc is None else acc + p
        if step < n - 1:
            acc = from_neighbour(acc, axis, n, -1)
    return acc


def place(full: jax.Array | None, part: jax.Array, index: jax.Array, dim: int, n: int) -> jax.Array:
    """``part`` written as chunk ``index`` of dimension ``dim`` of an array ``n`` chunks long there."""
    if full is None:
        shape = list(part.shape)
        shape[dim] *= n
        full = jnp.zeros(shape, part.dtype)
    return lax.dynamic_update_slice_in_dim(full, part, index * part.shape[dim], dim)


def chunk(x: jax.Array, index: jax.Array, dim: int, n: int) -> jax.Array:
    """Chunk ``index`` of ``n`` along dimension ``dim`` of ``x``."""
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, index * size, size, dim)
