"""What every pipeline stage runs: the loop of ticks as one frozen
object, and what crosses stages.

:func:`jaxscale.parallel.pipeline.build` works out once what is fixed
for the step (stages, chunks, microbatches, the schedule's table, the
stage's plan: :class:`~jaxscale.layout.stage_plan.StagePlan`, the
compute dtype, the graphs of a block and of the rest of the model) and
builds a :class:`StageProgram`; :meth:`StageProgram.run` is the body of
the ``shard_map`` over ``stage``.

A tick (:meth:`StageProgram.tick`) is one row of the table: each stage
runs its forward slot and, training, its backward slot (and, split, its
weight slot: :mod:`~jaxscale.parallel.stage_slots`). Each unit's
metrics, whichever the model's unit returns, are kept per unit slot,
the head's apart (:attr:`Loop.metrics`, :attr:`Loop.head`).

The program is assembled from one part per switch: skipped or masked
idle work (:mod:`~jaxscale.parallel.stage_gate`), FSDP's gathers and
scatters (:mod:`~jaxscale.parallel.stage_fsdp`), the stacked units and
uneven stages (:mod:`~jaxscale.parallel.stage_units`), the ring's ends
(:mod:`~jaxscale.parallel.stage_ends`), the metrics channel
(:mod:`~jaxscale.parallel.stage_metrics`).

**What crosses stages** is here: per tick the forward's output and the
backward's input gradient, each a ``ppermute`` round the ring
(:meth:`~StageProgram.send_forward`, :meth:`~StageProgram.send_backward`);
once per step the sums of :meth:`~StageProgram.count_targets` (the
batch's trained targets) and :meth:`~StageProgram.reduce` (gradients and
loss over the manual data and context axes, loss and the head's metrics
over ``stage``) and, outside the ``shard_map``, the embedding's and
head's per-stage gradients over ``stage``
(:meth:`~StageProgram.sum_stage_copies`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.read import ModelConfig
from jaxscale.layout.sharding import Layout, constrain, use_layout, vary, varying
from jaxscale.layout.stage_plan import StagePlan
from jaxscale.parallel import weight_split
from jaxscale.parallel.schedules import IDLE, Table
from jaxscale.parallel.stage_ends import HeadLoss
from jaxscale.parallel.stage_fsdp import Fsdp
from jaxscale.parallel.stage_gate import Mask, Skip, gate
from jaxscale.parallel.stage_metrics import PREFIX, Channel, SlotMetrics
from jaxscale.parallel.stage_slots import Forward, Grads, Slots
from jaxscale.parallel.stage_state import Loop, Unit, Weights, put, read_slot, take

AXIS = "stage"
F32 = jnp.float32


class Result(NamedTuple):
    """What the loop gives once a step (evaluating: the first three)."""

    loss: jax.Array
    layers: Any  # each unit slot's metrics, [v·slots, ...]
    head: Any  # the prefix's and the head's metrics
    grads: Any = ()  # the blocks' gradients
    histories: Any = ()  # their updated fp8 histories
    outer: Any = ()  # the outer parts' gradients, [1, ...] per stage


@dataclasses.dataclass(frozen=True, eq=False)
class StageProgram(Slots, SlotMetrics):
    """A stage's program for one step: what ``build`` fixed up front, and
    the loop."""

    table: Table  # the schedule (training or evaluation)
    stages: int  # p
    repeats: int  # v, chunks per stage
    microbatches: int  # m
    counts: tuple[int, ...]  # the stacked units of each virtual stage
    slots: int  # unit slots per chunk: the largest virtual stage's
    plan: StagePlan  # manual axes, skip or mask, FSDP's gathers
    fsdp: Fsdp  # the blocks over FSDP's and TP's axes
    inner: Layout  # the rules less the manual axes, and the Stage
    dtype: jnp.dtype  # the compute dtype of the activations
    model: ModelConfig  # width, vocabulary and MoE settings
    graph: Any  # the model's graph without its blocks (head_model)
    block_shapes: Any
    rest: Any
    block_graph: Any  # one stacked unit's graph
    outer_axes: Any  # the logical axes of the embedding, norm and head
    outer_histories: Any  # True at the head's fp8 amax histories
    head_loss: HeadLoss  # (model, y, micro) -> loss, metrics
    head_metrics: Any  # the shapes of the head's metrics
    channel: Channel  # the model's aux_loss of its metrics, in shares
    metric_shapes: Any = None  # the prefix's, a unit's, the head's: run
    stash_on_host: bool = False  # pipeline.offload_stash: the kept layer inputs in host memory

    @property
    def manual(self) -> tuple[str, ...]:
        """The mesh axes the loop is manual over."""
        return self.plan.manual

    @property
    def rows(self) -> tuple[str, ...]:
        """The manual axes over which activations differ: ``stage``,
        data, context and SP's axes (not TP's alone: there each device
        holds the same activations and its shard of the blocks)."""
        plan = self.plan
        return tuple(a for a in self.manual
                     if a not in plan.tensor or a in plan.sequence)

    @property
    def summed(self) -> tuple[str, ...]:
        """The row axes besides ``stage``: each device holds its own
        rows, summed once per step."""
        return self.rows[1:]

    @property
    def gate(self) -> Skip | Mask:
        """How idle work is left out (:mod:`~.stage_gate`)."""
        return gate(self.plan.skip, self.rows)

    # -- the loop -------------------------------------------------------

    def tick(self, w: Weights, stage: jax.Array, state: Loop,
             col: dict[str, jax.Array]) -> tuple[Loop, None]:
        """One row of the table: the forward slot, the backward slot
        (training), then the two messages."""
        fwd = read_slot(col, stage, "f_")
        f = self.forward_slot(w, fwd, stage, state.acts)
        if not self.table.train:
            acts = self.send_forward(state.acts, f.y, col["recv_f"][stage])
            return self.evaluated(state, f, acts), None
        # The units' inputs kept for the backward, in the slot where the
        # chunk's input arrived.
        src = jnp.where(fwd.kind > IDLE, fwd.src, -1)
        state = state._replace(acts=put(state.acts, src, f.inputs))
        acts = self.send_forward(state.acts, f.y, col["recv_f"][stage])
        bwd = read_slot(col, stage, "b_")
        dy_in = state.grads[col["b_grad"][stage]]
        b = self.backward_slot(w, bwd, stage, dy_in, state)
        acc_outer, p_loss = self.embedding_grad(w, bwd, b.dx, b.acc_outer)
        grads, cots = Grads(b.acc, b.amax), state.cots
        if self.table.split:  # the weight slot, after B has kept its own
            cots = jax.tree.map(
                lambda c, k: put(c, col["b_cot"][stage], k), cots, b.kept)
            kept = jax.tree.map(lambda c: c[col["w_cot"][stage]], cots)
            with jax.named_scope("weight_slot"):
                slot = read_slot(col, stage, "w_")
                grads = self.weight_slot(w, slot, stage, kept, grads)
        recv_b = col["recv_b"][stage]
        return Loop(
            acts=acts, grads=self.send_backward(state.grads, b.dx, recv_b),
            cots=cots, acc=grads.acc, acc_outer=acc_outer, amax=grads.amax,
            loss=state.loss + b.loss + p_loss,
            metrics=jax.tree.map(jnp.add, state.metrics, b.metrics),
            head=jax.tree.map(jnp.add, state.head, (f.prefix, b.head)),
        ), None

    @staticmethod
    def evaluated(state: Loop, f: Forward, acts: jax.Array) -> Loop:
        """An evaluating tick's state: the forward slot's loss and
        metrics added, its output sent on (``acts``)."""
        return state._replace(
            acts=acts, loss=state.loss + f.obj,
            metrics=jax.tree.map(jnp.add, state.metrics, f.metrics),
            head=jax.tree.map(jnp.add, state.head, (f.prefix, f.head)))

    def start(self, w: Weights) -> Loop:
        """The loop's state before the first tick: empty buffers, zero
        gradients."""
        # a microbatch's activations: rows, length, embed
        h = (*w.xs["inputs"].shape[1:], self.model.embed)
        table, train = self.table, self.table.train

        def zeros(tree: Any) -> Any:  # each varying as its parameter
            if not train:
                return {}
            return jax.tree.map(
                lambda a: vary(jnp.zeros(a.shape, F32), varying(a)), tree)

        cots = ()
        if table.split:
            lead = (table.cot_slots, self.slots)
            cots = weight_split.zeros(self.split_types(w)[::-1], lead)
        state = Loop(
            acts=jnp.zeros((table.act_slots, self.slots, *h), self.dtype),
            grads=jnp.zeros((table.grad_slots if train else 1, *h),
                            self.dtype),
            cots=cots, acc=zeros(w.blocks.params), acc_outer=zeros(w.outer),
            amax=zeros(w.blocks.histories), loss=jnp.zeros((), F32),
            metrics=self.zero_metrics((self.repeats, self.slots)),
            head=(self.zero_head(PREFIX), self.zero_head()),
        )
        state = vary(state, self.rows)
        if self.stash_on_host and train:  # pipeline.offload_stash: read and written there (stage_state.put)
            state = state._replace(acts=jax.device_put(state.acts, jax.memory.Space.Host))
        return state

    def run(self, outer: Any, blocks: Any, histories: Any,
            xs: dict[str, jax.Array]) -> Result:
        """The ``shard_map``'s body: the stage's loop over the table's
        ticks under the stage's layout.

        ``histories``: the blocks' fp8 amax histories, each stage its own
        layers' (varying over ``stage`` alone: an amax inside the stage is
        the maximum over the devices of that stage,
        :func:`jaxscale.precision.fp8.global_amax`)."""
        mesh = jax.sharding.get_abstract_mesh()
        with use_layout(mesh, self.inner):
            w = self.weights(outer, blocks, histories, xs)
            # which metrics there are: a first trace of the prefix, a unit
            first = take(take(w.blocks, 0), 0)
            pos = w.xs["positions"][0]
            shapes = jax.eval_shape(lambda: (
                self.embedded(w, w.outer, 0)[1],
                self.unit(first, self.unit_input(w), pos)[1]))
            program = dataclasses.replace(
                self, metric_shapes=(*shapes, self.head_metrics))
            cols = {k: jnp.asarray(a)
                    for k, a in self.table.arrays().items()}
            tick = functools.partial(program.tick, w, lax.axis_index(AXIS))
            state, _ = lax.scan(tick, program.start(w), cols)
            return program.reduce(state)

    def weights(self, outer: Any, blocks: Any, histories: Any,
                xs: dict[str, jax.Array]) -> Weights:
        """What the stage reads through the loop, made once a step."""
        # The embedding and head gathered over the stage's FSDP axes once,
        # before the loop: XLA cannot partition their lookup or scatter
        # against FSDP shards inside the partly manual region.
        outer = jax.tree.map(
            lambda x, a: constrain(
                x[0], tuple(None if n == "embed" else n for n in a)),
            outer, self.outer_axes,
            is_leaf=lambda x: isinstance(x, jax.Array))
        # once per step: not per microbatch or tick
        copies = self.quantized(Unit(blocks, histories, {}))
        xs = self.own_tokens(xs)
        lookup, blocks, xs = vary(
            (self.lookup_table(outer["embedding"]), blocks, xs), self.rows)
        # The head's fp8 histories vary over ``stage`` alone, as the
        # blocks': its amaxes span the stage's rows.
        outer = jax.tree.map(lambda x, h: x if h else vary(x, self.rows),
                             outer, self.outer_histories)
        total = self.count_targets(xs["targets"])
        return Weights(outer, lookup, Unit(blocks, histories, copies), xs,
                       total)

    def own_tokens(self, xs: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """With SP's axes manual, the device's own part of the sequence of
        the token ids and targets: it embeds those, and the head reads the
        residual stream there (split on the sequence); the positions stay
        whole, for attention reads them on its gathered input."""
        axes = self.plan.sequence
        if not axes:
            return xs
        n = xs["inputs"].shape[2] // self.inner.size(axes)
        start = lax.axis_index(axes) * n
        return {**xs, **{k: lax.dynamic_slice_in_dim(xs[k], start, n, axis=2)
                         for k in ("inputs", "targets")}}

    # -- what crosses stages ----------------------------------------------

    def _ring(self) -> list[tuple[int, int]]:
        """Stage s sends to s + 1; with v > 1 chunks the last stage's
        output goes round to stage 0."""
        p = self.stages
        if self.repeats > 1:
            return [(s, (s + 1) % p) for s in range(p)]
        return [(s, s + 1) for s in range(p - 1)]

    def send_forward(self, acts: jax.Array, y: jax.Array,
                     recv: jax.Array) -> jax.Array:
        """Each tick: the forward slot's output to the next stage, into
        its buffer slot ``recv`` (−1: none), as the first unit's input
        there."""
        sent = lax.ppermute(y, AXIS, self._ring())
        return put(acts, recv, sent[None], whole=False)

    def send_backward(self, grads: jax.Array, dh: jax.Array,
                      recv: jax.Array) -> jax.Array:
        """Each tick (training): the backward slot's input gradient to the
        previous stage, into slot ``recv``."""
        back = [(b, a) for a, b in self._ring()]
        return put(grads, recv, lax.ppermute(dh, AXIS, back))

    def count_targets(self, targets: jax.Array) -> jax.Array:
        """Once per step: the trained targets (≥ 0) of the batch, summed
        over the manual data and context axes (each device's own rows;
        every stage holds the same), at least 1."""
        trained = jnp.sum(targets >= 0, dtype=F32)
        if self.summed:
            trained = lax.psum(trained, self.summed)
        return jnp.maximum(trained, 1.0)

    def reduce(self, state: Loop) -> Result:
        """Once per step: gradients and loss summed over the manual data
        and context axes (each device's own rows), then loss and the
        head's metrics over ``stage`` (the head's are the last stage's),
        the model's aux objective's constant part added
        (:meth:`Channel.constant`). Each unit slot's metrics, their
        microbatches' mean (averaged over the devices of the stage's rows,
        each holding its own rows'), stay with their stage, [v·slots, ...],
        as the stack is stored."""
        m, summed, train = self.microbatches, self.summed, self.table.train
        layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]) / m,
                              state.metrics)
        acc = self.fsdp.scatter(state.acc, summed) if train else state.acc
        acc_outer, loss, amax = state.acc_outer, state.loss, state.amax
        if summed:
            loss = lax.psum(loss, summed)
            if train:  # the head's fp8 histories: the largest amaxes
                acc_outer = jax.tree.map(
                    lambda a, h: (lax.pmax if h else lax.psum)(a, summed),
                    acc_outer, self.outer_histories)
            amax = lax.pmax(amax, summed)  # the same on a stage's devices
        head = jax.tree.map(lambda a: a / m, state.head)
        if summed:  # each device's rows' means, averaged (MoE's: the same)
            head, layers = lax.pmean((head, layers), summed)
        loss, head = lax.psum((loss, head), AXIS)
        loss = loss + self.channel.constant(self.metric_shapes)
        if not train:
            return Result(loss, layers, head)
        outer = jax.tree.map(lambda a: a[None], acc_outer)
        return Result(loss, layers, head, acc, amax, outer)

    @staticmethod
    def sum_stage_copies(d_outer: Any) -> Any:
        """Once per step, outside the ``shard_map``: the embedding's,
        final norm's and head's gradients of each stage's copy
        ([stage, ...]) summed over ``stage`` (the head's fp8 histories:
        zeros but on the last stage)."""
        return jax.tree.map(lambda d: jnp.sum(d, axis=0), d_outer)
