"""The metrics channel inside a pipeline: every metric the model's ``prefix``, stacked units and ``ahead``
return, weighed into the objective by the model's ``aux_loss`` and logged as on one device (docs/models.md).

On one device the model's ``hidden`` (or ``trunk``) reduces its units' metrics, stacked over the layers
``[layers, ...]``, by its ``stack_metrics`` (each key's mean over the layers when it has none), after its
prefix's; the metrics of ``ahead`` join them, and ``aux_loss`` weighs the result. A pipeline never runs the
whole stack at once: each unit slot keeps its unit's metrics (their microbatches' mean), and after the loop
the stack's metrics, in the model's layer order, go through the same ``stack_metrics`` (:func:`whole`).
Which keys there are is known at trace time, from a first trace of one unit and of the prefix
(:meth:`~jaxscale.parallel.stage_program.StageProgram.run`).

**Gradients**: ``aux_loss`` of the metrics must be affine in them, with the same weight for every layer
(sums, means and weighted sums, as the built-in models' are), so that the objective splits into one share
per microbatch's prefix, per unit and per microbatch's head, each added where that part runs, its gradient
flowing through the same backward slot (:meth:`Channel.share`): a part's share is ``aux_loss`` of the whole
metrics with that part's in place and zeros elsewhere, less ``aux_loss`` of zeros (:meth:`Channel.constant`,
added once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.stage_layers import Storage
from jaxscale.layout.rules import Layout
from jaxscale.layout.sharding import vary
from jaxscale.ops.routing import joined

F32 = jnp.float32
Metrics = dict[str, Any]
PREFIX, UNIT, HEAD = range(3)  # the parts of the model whose metrics the channel joins, in their order
PER_LAYER = "moe_layers"  # per-layer statistics a reduction keeps, stored as the stack (the routing biases' order)


def layer_mean(stacked: Metrics) -> Metrics:
    """The default reduction of the stacked units' metrics: each key's mean over the layers."""
    return jax.tree.map(lambda a: jnp.mean(a, axis=0), stacked)


def prefixed(model: Any, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
    """The model's ``prefix`` on the embedded tokens ``x``: its output and metrics (none when it returns ``x``
    alone); ``x`` itself without a prefix."""
    if not hasattr(model, "prefix"):
        return x, {}
    out = model.prefix(x, positions)
    return out if isinstance(out, tuple) else (out, {})


def reduction(model: Any) -> Callable[[Metrics], Metrics]:
    """The model's ``stack_metrics`` (its units' metrics [layers, ...] -> those ``hidden`` returns), or
    :func:`layer_mean`."""
    return getattr(model, "stack_metrics", layer_mean)


@dataclasses.dataclass(frozen=True, eq=False)
class Channel:
    """The model's objective on its metrics, split into the shares a pipeline's slots add."""

    aux_loss: Callable[[Metrics], Any]  # the model's
    fold: Callable[[Metrics], Metrics]  # :func:`reduction`
    units: int  # the stacked units (layers, or MoE groups) of the model

    def objective(self, prefix: Metrics, first: Metrics, head: Metrics) -> jax.Array:
        """``aux_loss`` of the whole metrics: the prefix's, ``first`` the first unit's (the other units' zeros),
        the head's."""

        def stacked(a: jax.Array) -> jax.Array:
            return jnp.concatenate([a[None], jnp.zeros((self.units - 1, *a.shape), a.dtype)])

        whole = joined(joined(prefix, self.fold(jax.tree.map(stacked, first))), head)
        return jnp.asarray(self.aux_loss(whole), F32)

    def share(self, zeros: tuple[Metrics, Metrics, Metrics], part: int, metrics: Metrics) -> jax.Array:
        """One part's share of the objective (``PREFIX``, ``UNIT``, ``HEAD``) on one microbatch, ``zeros`` the
        three parts' metrics as zeros."""
        return self.objective(*(metrics if i == part else z for i, z in enumerate(zeros))) - self.objective(*zeros)

    def constant(self, shapes: tuple[Any, Any, Any]) -> jax.Array:
        """``aux_loss`` of zero metrics (the three parts' ``shapes``): the part of the objective no share holds
        (0 for a linear one)."""
        return self.objective(*jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


class SlotMetrics:
    """The metrics side of a stage's program (:class:`~jaxscale.parallel.stage_program.StageProgram`, which
    holds what these read): zeros shaped as each part's metrics, a chunk's units' metrics in the loop's state,
    and a part's share of the aux objective."""

    channel: Channel
    metric_shapes: tuple[Any, Any, Any]  # of the prefix's, one unit's and the head's metrics
    repeats: int
    microbatches: int
    inner: Layout
    rows: tuple[str, ...]  # the manual axes over which activations differ
    summed: tuple[str, ...]  # ... besides ``stage``

    def zero_metrics(self, lead: tuple[int, ...] = ()) -> Metrics:
        """A unit's metrics as zeros; with ``lead`` (v, slots) a slot's or the loop's, one per unit slot."""
        return vary(jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), F32), self.metric_shapes[UNIT]), self.rows)

    def tally(self, met: Metrics, chunk: jax.Array) -> Metrics:
        """A chunk's units' metrics [slots, ...] at chunk ``chunk``'s slots of the stage's [v, slots, ...]."""
        return jax.tree.map(lambda a: lax.dynamic_update_slice_in_dim(
            jnp.zeros((self.repeats, *a.shape), F32), a[None], chunk, 0), met)

    def zero_head(self, part: int = HEAD) -> Any:
        """The head's metrics as zeros (none without the model's ``ahead``), or the prefix's."""
        return vary(jax.tree.map(lambda a: jnp.zeros(a.shape, F32), self.metric_shapes[part]), self.rows)

    @property
    def spread(self) -> int:
        """Over how many devices and microbatches the share of a part that runs on one microbatch's rows is
        spread (the prefix's and the units', not weighed as the loss): the microbatches, and the devices of the
        stage's rows (each holds its rows' metrics, or MoE's the microbatch's, summed over them by
        routing.route), as the loss is summed over them."""
        return self.microbatches * self.inner.size(self.summed)

    def share(self, part: int, metrics: Metrics) -> jax.Array:
        """A part's share of the model's aux objective on one microbatch (:meth:`Channel.share`)."""
        zeros = vary(jax.tree.map(lambda s: jnp.zeros(s.shape, F32), self.metric_shapes), self.rows)
        return self.channel.share(zeros, part, metrics)


def whole(fold: Callable[[Metrics], Metrics], prefix: Metrics, stored: Metrics, head: Metrics,
          storage: Storage) -> Metrics:
    """The model's metrics from the prefix's, each unit slot's (``stored`` [slots, ...] as the stack is stored)
    and the head's: ``fold`` of the units' in the model's layer order (unused slots left out), its per-layer
    statistics (``moe_layers``) back in the stored order, as the routing biases they update are stored; the
    prefix's before them, the head's after."""
    stack = fold(storage.canonical(stored))
    if PER_LAYER in stack:
        stack = {**stack, PER_LAYER: storage.place(stack[PER_LAYER])}
    return joined(joined(prefix, stack), head)
