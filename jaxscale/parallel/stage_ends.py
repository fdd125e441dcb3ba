"""The two ends of a pipeline stage's ring: the first virtual stage's
embedding (and the model's ``prefix``), the last one's final norm, head
and loss (and the model's ``ahead``), and their gradients.

Every stage holds its own copy of the embedding, final norm and head
(``outer``); they run where the table says (:class:`~jaxscale.parallel.
stage_gate.Skip`'s ``at_end``: skipped elsewhere, or masked), and their
gradients are summed over ``stage`` once a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.config.read import ModelConfig
from jaxscale.layout.sharding import Layout, vary
from jaxscale.parallel.schedules import FIRST
from jaxscale.parallel.stage_gate import Mask, Skip
from jaxscale.parallel.stage_metrics import HEAD, PREFIX, Metrics, prefixed
from jaxscale.parallel.stage_state import Slot, Weights

F32 = jnp.float32
HeadLoss = Callable[[Any, jax.Array, dict[str, jax.Array]],
                    tuple[jax.Array, Any]]


class HeadGrad(NamedTuple):
    """The head's backward on one microbatch (zeros off the last stage)."""

    loss: jax.Array  # its share of the batch's loss
    dy: jax.Array  # the loss's gradient in the stack's output
    acc_outer: Any  # the outer gradients, the head's added
    metrics: Metrics  # the head's (the model's ``ahead``)


def fp32(metrics: Metrics) -> Metrics:
    """Every metric in fp32."""
    return jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)


class Ends:
    """The ends side of a stage's program
    (:class:`~jaxscale.parallel.stage_program.StageProgram`)."""

    graph: Any
    block_shapes: Any
    rest: Any
    inner: Layout
    model: ModelConfig
    outer_histories: Any
    head_loss: HeadLoss
    gate: Skip | Mask
    rows: tuple[str, ...]
    spread: int
    share: Callable[[int, Metrics], jax.Array]
    zero_head: Callable[..., Any]

    def head_model(self, outer: Any) -> Any:
        """The model with ``outer`` as its embedding, final norm and head
        (its blocks: shapes only)."""
        state = jax.tree.map(lambda a: a, self.rest)
        nnx.replace_by_pure_dict(state, outer)
        return nnx.merge(self.graph, self.block_shapes, state)

    def micro(self, w: Weights, i: jax.Array) -> dict[str, jax.Array]:
        """Microbatch ``i`` of the batch: inputs, positions, targets."""
        return {k: a[i] for k, a in w.xs.items()}

    def loss_of(self, outer: Any, y: jax.Array, micro: dict[str, jax.Array],
                total: jax.Array) -> tuple[jax.Array, Metrics]:
        """The loss of the stack's output ``y`` on one microbatch with the
        head's share of the model's aux objective (its ``ahead``'s
        metrics), as its share of the batch's mean: weighed by its trained
        targets over the batch's ``total``; and the head's metrics."""
        loss, metrics = self.head_loss(self.head_model(outer), y, micro)
        metrics = fp32(metrics)
        loss = loss + self.share(HEAD, metrics)
        share = jnp.sum(micro["targets"] >= 0, dtype=F32) / total
        return loss * share, metrics

    def lookup_table(self, table: jax.Array) -> jax.Array:
        """The embedding table as the lookup reads it: split over the
        vocabulary's mesh axes on its width.

        Split on the vocabulary by a partitioner axis inside the partly
        manual ``shard_map``, the lookup makes XLA's partitioner (jax
        0.12) abort while it costs its ways of splitting the gather (a
        failed check on the device groups of the masked lookup's
        all-reduce, ``spmd_partitioner_util``). Split on the width, each
        device looks up its slice of every row; the rows are gathered."""
        vocab = self.inner.mesh_axes(("vocab",))
        fits = table.shape[1] % self.inner.size(vocab) == 0
        width = vocab if vocab and fits else None
        mesh = jax.sharding.get_abstract_mesh()
        return lax.with_sharding_constraint(
            table, NamedSharding(mesh, PartitionSpec(None, width)))

    def embedded(self, w: Weights, outer: Any,
                 i: jax.Array) -> tuple[jax.Array, Metrics]:
        """Microbatch ``i``'s embedding, then the model's prefix where it
        has one (the first virtual stage's input), with ``outer`` as the
        prefix's parameters; and the prefix's metrics, in fp32."""
        model = self.head_model({**outer, "embedding": w.lookup})
        x = model.embed(w.xs["inputs"][i])
        h, metrics = prefixed(model, x, w.xs["positions"][i])
        return h, fp32(metrics)

    def head_grad(self, w: Weights, here: jax.Array, anywhere: jax.Array,
                  y: jax.Array, micro: dict[str, jax.Array],
                  acc_outer: Any) -> HeadGrad:
        """The head's backward on the last virtual stage (the sum inside
        the conditional: its cross-device sum then runs in these ticks
        only). The head's fp8 histories (``precision.fp8_head``) get the
        largest of the microbatches' updates, as the blocks'."""

        def add(a: jax.Array, g: jax.Array, history: bool) -> jax.Array:
            return jnp.maximum(a, g) if history else a + g.astype(a.dtype)

        def run() -> HeadGrad:
            loss, pull, metrics = jax.vjp(
                lambda o, y: self.loss_of(o, y, micro, w.total),
                w.outer, y, has_aux=True)
            d_outer, dy = pull(jnp.ones_like(loss))
            acc = jax.tree.map(add, acc_outer, d_outer, self.outer_histories)
            return HeadGrad(loss, dy, acc, metrics)

        zeros = HeadGrad(jnp.zeros((), F32), jnp.zeros_like(y), acc_outer,
                         self.zero_head())
        return self.gate.at_end(here, anywhere, run, zeros)

    def embedding_grad(self, w: Weights, slot: Slot, dh: jax.Array,
                       acc_outer: Any) -> tuple[Any, jax.Array]:
        """``acc_outer`` plus, from the first virtual stage's input
        gradient ``dh``, the gradients of the model's prefix (where it has
        one: recomputed from the lookup under ``jax.vjp``, its share of
        the aux objective with it) and of the embedding, one-hot(tokens)ᵀ ·
        (the lookup's output gradient), there; and that share.

        A matmul, not the scatter-add that autodiff of the lookup gives:
        XLA's partitioner cannot split a scatter into a sharded operand
        inside a partly manual ``shard_map``."""

        def run() -> tuple[Any, jax.Array]:
            return self._embedding_grad(w, slot, dh, acc_outer)

        zeros = (acc_outer, jnp.zeros((), F32))
        return self.gate.at_end(slot.kind == FIRST, slot.any_first, run,
                                zeros)

    def _embedding_grad(self, w: Weights, slot: Slot, dh: jax.Array,
                        acc: Any) -> tuple[Any, jax.Array]:
        tokens, positions = w.xs["inputs"][slot.micro], w.xs["positions"]
        de, share = dh, jnp.zeros((), F32)
        model = self.head_model({**w.outer, "embedding": w.lookup})
        if hasattr(model, "prefix"):

            def prefix(outer: Any, h: jax.Array) -> tuple:
                x, metrics = prefixed(self.head_model(outer), h,
                                      positions[slot.micro])
                return x, self.share(PREFIX, fp32(metrics)) / self.spread

            (_, share), pull = jax.vjp(prefix, w.outer, model.embed(tokens))
            d_outer, de = pull(vary((dh, jnp.ones((), F32)), self.rows))
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc,
                               d_outer)
        hot = jax.nn.one_hot(tokens, self.model.vocab_size, dtype=de.dtype)
        table = acc["embedding"] + jnp.einsum(
            "bsv,bse->ve", hot, de, preferred_element_type=F32)
        return {**acc, "embedding": table}, share
