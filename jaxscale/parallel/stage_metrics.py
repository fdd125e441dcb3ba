"""The metrics channel inside a pipeline: every metric the model's stacked units and its ``ahead`` return,
weighed into the objective by the model's ``aux_loss`` and logged as on one device (docs/models.md).

On one device the model's ``hidden`` (or ``trunk``) reduces its units' metrics, stacked over the layers
``[layers, ...]``, by its ``stack_metrics`` (each key's mean over the layers when it has none), joins the
metrics of ``ahead``, and ``aux_loss`` weighs the result. A pipeline never runs the whole stack at once:
each unit slot keeps its unit's metrics (their microbatches' mean), and after the loop the stack's metrics,
in the model's layer order, go through the same ``stack_metrics``
(:func:`stack_of`). Which keys there are is known at trace time, from a first trace of one unit
(:meth:`~jaxscale.parallel.stage_program.StageProgram.run`).

**Gradients**: ``aux_loss`` of ``stack_metrics`` must be affine in the metrics and the same for every layer
(sums, means and weighted sums of them, as the built-in models' are), so that the objective splits into one
share per unit and one per microbatch's head, each added where that unit or head runs, its gradient flowing
through the same backward slot (:meth:`Channel.unit_share`, :meth:`Channel.head_share`): a part's share is
``aux_loss`` of the whole metrics with that part's in place and zeros elsewhere, less ``aux_loss`` of zeros
(:meth:`Channel.constant`, added once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.routing import joined
from jaxscale.stage_layers import Storage

F32 = jnp.float32
Metrics = dict[str, Any]
PER_LAYER = "moe_layers"  # per-layer statistics a reduction keeps, stored as the stack (the routing biases' order)


def layer_mean(stacked: Metrics) -> Metrics:
    """The default reduction of the stacked units' metrics: each key's mean over the layers."""
    return jax.tree.map(lambda a: jnp.mean(a, axis=0), stacked)


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

    def objective(self, first: Metrics, head: Metrics) -> jax.Array:
        """``aux_loss`` of the whole metrics: ``first`` the first unit's, the other units' zeros, ``head`` the
        head's."""

        def stacked(a: jax.Array) -> jax.Array:
            return jnp.concatenate([a[None], jnp.zeros((self.units - 1, *a.shape), a.dtype)])

        return jnp.asarray(self.aux_loss(joined(self.fold(jax.tree.map(stacked, first)), head)), F32)

    def unit_share(self, metrics: Metrics, head_zeros: Metrics) -> jax.Array:
        """One unit's share of the objective (on one microbatch's rows)."""
        zeros = jax.tree.map(jnp.zeros_like, metrics)
        return self.objective(metrics, head_zeros) - self.objective(zeros, head_zeros)

    def head_share(self, unit_zeros: Metrics, head: Metrics) -> jax.Array:
        """The head's share of the objective: its metrics (the model's ``ahead``) on one microbatch."""
        return self.objective(unit_zeros, head) - self.objective(unit_zeros, jax.tree.map(jnp.zeros_like, head))

    def constant(self, unit_shapes: Any, head_shapes: Any) -> jax.Array:
        """``aux_loss`` of zero metrics: the part of the objective no share holds (0 for a linear one)."""
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (unit_shapes, head_shapes))
        return self.objective(*zeros)


def stack_of(fold: Callable[[Metrics], Metrics], stored: Metrics, storage: Storage) -> Metrics:
    """The metrics of the whole stack from each unit slot's, ``stored`` [slots, ...] as the stack is stored:
    ``fold`` of them in the model's layer order (unused slots left out); its per-layer statistics
    (``moe_layers``) back in the stored order, as the routing biases they update are stored."""
    out = fold(storage.canonical(stored))
    if PER_LAYER in out:
        out = {**out, PER_LAYER: storage.place(out[PER_LAYER])}
    return out
