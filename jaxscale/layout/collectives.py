"""Collectives with a chosen gradient dtype, and a layout stated inside a trace.

A gradient summed by a collective in the compute dtype (bf16) loses the low bits of every partial sum;
:func:`take`, :func:`all_gather` and :func:`vary` are jax's gather, all-gather and ``pcast`` whose backward
(a scatter-add, a reduce-scatter, a ``psum``) runs in ``grads`` instead (``precision.grads_reduce``,
:func:`jaxscale.precision.policy.weight_grads`). They communicate exactly what jax's own do, in the
forward; the backward's bytes are those of ``grads``. :func:`lay_out` is a constraint on auto mesh axes and
a ``reshard`` on explicit ones.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def take(table: jax.Array, ids: jax.Array, grads: jnp.dtype | None = None, out: Any = None) -> jax.Array:
    """Rows ``table[ids]`` (an embedding lookup), the table's gradient (a scatter-add) summed in ``grads``
    (None: autodiff's, the table's dtype); ``out``: the rows' sharding, stated on explicit mesh axes (jax's
    rules cannot decide a gather from a split table)."""
    if grads is None:
        return jnp.take(table, ids, axis=0) if out is None else table.at[ids].get(out_sharding=out)
    return _take(jnp.dtype(grads), out, table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _take(grads: jnp.dtype, out: Any, table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0) if out is None else table.at[ids].get(out_sharding=out)


def _take_forward(grads: jnp.dtype, out: Any, table: jax.Array, ids: jax.Array) -> tuple[jax.Array, tuple]:
    return _take(grads, out, table, ids), (table, ids)


def _take_backward(grads: jnp.dtype, out: Any, saved: tuple, g: jax.Array) -> tuple[jax.Array, None]:
    table, ids = saved
    if out is None:
        d_table = jnp.zeros(table.shape, grads).at[ids].add(g.astype(grads))
    else:  # explicit axes: the stated gather's own transpose (a scatter-add into the table's layout), in grads
        zeros = jnp.zeros(table.shape, grads, out_sharding=jax.typeof(table).sharding)
        d_table = jax.vjp(lambda t: t.at[ids].get(out_sharding=out), zeros)[1](g.astype(grads))[0]
    return d_table.astype(table.dtype), None


_take.defvjp(_take_forward, _take_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_gather(w: jax.Array, axes: tuple[str, ...], dim: int, grads: jnp.dtype) -> jax.Array:
    """Inside a ``shard_map``: ``lax.all_gather(w, axes, axis=dim, tiled=True)``, its backward (the gradient's
    reduce-scatter) in ``grads``."""
    return jax.lax.all_gather(w, axes, axis=dim, tiled=True)


def _all_gather_forward(w: jax.Array, axes: tuple[str, ...], dim: int, grads: jnp.dtype) -> tuple[jax.Array, None]:
    return all_gather(w, axes, dim, grads), None


def _all_gather_backward(axes: tuple[str, ...], dim: int, grads: jnp.dtype, _: None, g: jax.Array) -> tuple:
    return (jax.lax.psum_scatter(g.astype(grads), axes, scatter_dimension=dim, tiled=True).astype(g.dtype),)


all_gather.defvjp(_all_gather_forward, _all_gather_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def vary(w: jax.Array, axes: tuple[str, ...], grads: jnp.dtype) -> jax.Array:
    """Inside a ``shard_map``: ``w`` typed as varying over ``axes`` (``lax.pcast``), its backward (the
    gradient's ``psum`` over ``axes``) in ``grads``."""
    return jax.lax.pcast(w, axes, to="varying")


def _vary_forward(w: jax.Array, axes: tuple[str, ...], grads: jnp.dtype) -> tuple[jax.Array, None]:
    return vary(w, axes, grads), None


def _vary_backward(axes: tuple[str, ...], grads: jnp.dtype, _: None, g: jax.Array) -> tuple:
    return (jax.lax.psum(g.astype(grads), axes).astype(g.dtype),)


vary.defvjp(_vary_forward, _vary_backward)


def lay_out(tree: Any, shardings: Any) -> Any:
    """``tree`` laid out as ``shardings`` (a matching tree, or one for every leaf), inside a trace: a
    ``with_sharding_constraint`` on an Auto mesh, a ``jax.sharding.reshard`` where the context mesh's axes are
    all Explicit (``mesh.axis_types: explicit``: a constraint may not change a layout there). The step's
    gradients are its first user, :func:`jaxscale.layout.sharding.constrain` the other."""
    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        return jax.sharding.reshard(tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)
