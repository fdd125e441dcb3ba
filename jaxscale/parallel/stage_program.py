"""What every pipeline stage runs: the loop of ticks as one frozen object, its slots as methods.

:func:`jaxscale.parallel.pipeline.objective` works out once what is fixed for the step (stages,
chunks, microbatches, the schedule's table, the loop's manual axes, whether idle slots are skipped,
the compute dtype, the graphs of a block and of the rest of the model) and builds a
:class:`StageProgram`; :meth:`StageProgram.run` is the body of the ``shard_map`` over ``stage``.

A tick (:meth:`StageProgram.tick`) is one row of the table: each stage runs its *forward slot*
(:meth:`~StageProgram.forward_slot`: the first virtual stage embeds its microbatch and runs the model's
``prefix`` if it has one, every chunk keeps the input of each of its layers) and, training, its *backward
slot* (:meth:`~StageProgram.backward_slot`: each layer recomputed from its kept input under ``jax.vjp``,
last layer first, the last virtual stage's output gradient from the head and loss, the model's ``ahead``
included, :meth:`~StageProgram.head_grad`; the first virtual stage's input gradient into the prefix's and
the embedding's, :meth:`~StageProgram.embedding_grad`). Each unit's metrics, whichever the model's unit
returns, are kept per unit slot, the head's metrics apart (:attr:`Loop.metrics`, :attr:`Loop.head`). A slot
is IDLE, FIRST, MIDDLE or LAST by the table. A schedule that splits the backward (``Table.split``: ZB-H1)
runs there every gradient but the weight matmuls', keeping their inputs and output gradients
(:mod:`~jaxscale.parallel.weight_split`), and a third, *weight slot* (:meth:`~StageProgram.weight_slot`)
runs those matmuls' weight gradients alone. An idle slot is skipped by a ``lax.cond`` when the stage leaves
no mesh axis to the partitioner (``skip``), else computed on zeros and masked (:meth:`~StageProgram.when`).

**What crosses stages** is in one place, the last methods of the class: per tick the forward's
output and the backward's input gradient, each a ``ppermute`` round the ring
(:meth:`~StageProgram.send_forward`, :meth:`~StageProgram.send_backward`); once per step the sums
of :meth:`~StageProgram.count_targets` (the batch's trained targets) and :meth:`~StageProgram.reduce`
(gradients and loss over the manual data and context axes, loss and the head's metrics over ``stage``)
and, outside the ``shard_map``, the embedding's and head's per-stage gradients over ``stage``
(:meth:`~StageProgram.sum_stage_copies`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.config.read import ModelConfig
from jaxscale.layout import collectives
from jaxscale.layout.sharding import Layout, constrain, use_layout, vary, varying
from jaxscale.parallel import weight_split
from jaxscale.parallel.schedules import FIRST, IDLE, LAST, Table
from jaxscale.parallel.stage_metrics import HEAD, PREFIX, UNIT, Channel, SlotMetrics, prefixed
from jaxscale.parallel.stage_state import Loop, Slot, Unit, Weights, put, read_slot, take
from jaxscale.precision import fp8

AXIS = "stage"
F32 = jnp.float32


@dataclasses.dataclass(frozen=True, eq=False)
class StageProgram(SlotMetrics):
    """A stage's program for one step: what ``objective`` fixed up front, and the loop's slots (their metrics:
    :class:`~jaxscale.parallel.stage_metrics.SlotMetrics`)."""

    table: Table  # the schedule (training: forwards and backwards; evaluation: forwards)
    stages: int  # p
    repeats: int  # v, chunks per stage
    microbatches: int  # m
    counts: tuple[int, ...]  # the stacked units (blocks, or MoE groups) of each virtual stage
    slots: int  # unit slots per chunk: the largest virtual stage's
    manual: tuple[str, ...]  # the mesh axes the loop is manual over: stage, then data, context and TP axes
    gathers: tuple[tuple[tuple[str, ...], ...], ...]  # per block parameter, the FSDP axes splitting each dim
    visit: bool  # FSDP's axes (``gathers``) gathered per layer as a slot runs it (pipeline.fsdp=visit)
    shards: tuple[tuple[tuple[str, ...], ...], ...]  # per block parameter, the TP axes splitting each dim
    block_axes: tuple[tuple[str | None, ...], ...]  # per block parameter, its logical axes (layers first)
    skip: bool  # whether idle slots are skipped by a conditional (no axis left to the partitioner)
    inner: Layout  # the layout inside a stage: the rules less the manual axes, and the stage itself
    dtype: jnp.dtype  # the compute dtype of the activations
    model: ModelConfig  # width, vocabulary and MoE settings
    graph: Any  # the model's graph without its blocks, their shapes, and the rest's state: see head_model
    block_shapes: Any
    rest: Any
    block_graph: Any  # one stacked unit's graph
    outer_axes: Any  # the logical axes of the embedding, final norm and head
    outer_histories: Any  # shaped like them: True at the head's fp8 amax histories (precision.fp8_head)
    head_loss: Callable[[Any, jax.Array, dict[str, jax.Array]], tuple[jax.Array, Any]]  # (model, y, micro) -> loss, ...
    head_metrics: Any  # the shapes of the head's metrics (jax.ShapeDtypeStruct)
    channel: Channel  # the model's aux_loss of its metrics, in shares (:mod:`jaxscale.parallel.stage_metrics`)
    metric_shapes: Any = None  # of the prefix's, one unit's and the head's metrics: set by :meth:`run`

    @property
    def rows(self) -> tuple[str, ...]:
        """The manual axes over which activations differ: ``stage``, data, context and SP's axes (not TP's
        alone: there each device holds the same activations and its shard of the blocks)."""
        where = self.inner.stage
        return tuple(a for a in self.manual if a not in where.tensor or a in where.sequence)

    @property
    def summed(self) -> tuple[str, ...]:
        """The row axes besides ``stage``: each device holds its own rows, summed once per step."""
        return self.rows[1:]

    @property
    def uneven(self) -> bool:
        return len(set(self.counts)) > 1

    # -- the model, in the stage ---------------------------------------------------------

    def head_model(self, outer: Any) -> Any:
        """The model with ``outer`` as its embedding, final norm and head (its blocks: shapes only)."""
        state = jax.tree.map(lambda a: a, self.rest)
        nnx.replace_by_pure_dict(state, outer)
        return nnx.merge(self.graph, self.block_shapes, state)

    def unit(self, lp: Unit, h: jax.Array, pos: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        """One stacked unit on ``h``: its output and its metrics, every one of them, in fp32."""
        unit = nnx.merge(self.block_graph, self.gathered(lp.params) if self.visit else lp.params, lp.histories)
        with fp8.using(unit, lp.copies):
            y, metrics = unit(h, pos)
        return y, jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)

    def layer(self, lp: Unit, h: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """One stacked unit on ``h``: its output, its share of the model's aux objective, its metrics."""
        y, metrics = self.unit(lp, h, pos)
        # Each device of the stage's rows holds its rows' metrics (or, MoE's, the microbatch's, summed over them
        # by routing.route): a share of the microbatch's objective each, as the loss is summed over those devices.
        return vary((y, self.share(UNIT, metrics) / self.spread, metrics), self.rows)

    def gathered(self, params: Any) -> Any:
        """A unit's parameters gathered over FSDP's axes as a slot runs it (``pipeline.fsdp=visit``): in a
        backward slot's ``vjp`` the gather's transpose reduce-scatters the unit's gradient onto the shards,
        in fp32, right after its backward; the devices of a stage take the same branch of each conditional."""

        def one(w: jax.Array, dims: tuple[tuple[str, ...], ...]) -> jax.Array:
            for dim, axes in enumerate(dims):
                w = collectives.all_gather(w, axes, dim, F32) if axes else w
            return w

        leaves, tree = jax.tree.flatten(params)
        return tree.unflatten([one(w, dims) for w, dims in zip(leaves, self.gathers, strict=True)])

    def loss_of(self, outer: Any, y: jax.Array, micro: dict[str, jax.Array], total: jax.Array) -> tuple:
        """The loss of the stack's output ``y`` on one microbatch ``micro`` with the head's share of the model's
        aux objective (its ``ahead``'s metrics), as its share of the batch's mean: weighed by its trained targets
        over the batch's ``total`` (:mod:`jaxscale.ops.loss`); and the head's metrics."""
        loss, metrics = self.head_loss(self.head_model(outer), y, micro)
        metrics = jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)
        loss = loss + self.share(HEAD, metrics)
        share = jnp.sum(micro["targets"] >= 0, dtype=F32) / total
        return loss * share, metrics

    def micro(self, w: Weights, i: jax.Array) -> dict[str, jax.Array]:
        """Microbatch ``i`` of the batch: inputs, positions, targets."""
        return {k: a[i] for k, a in w.xs.items()}

    def lookup_table(self, table: jax.Array) -> jax.Array:
        """The embedding table as the lookup reads it: split over the vocabulary's mesh axes on its width.

        Split on the vocabulary by a partitioner axis inside the partly manual ``shard_map``, the lookup
        makes XLA's partitioner (jax 0.12) abort while it costs its ways of splitting the gather (a failed
        check on the device groups of the masked lookup's all-reduce, ``spmd_partitioner_util``). Split on
        the width, each device looks up its slice of every row and the rows are gathered."""
        vocab = self.inner.mesh_axes(("vocab",))
        width = vocab if vocab and table.shape[1] % self.inner.size(vocab) == 0 else None
        return lax.with_sharding_constraint(
            table, NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec(None, width))
        )

    # -- conditionals ----------------------------------------------------------------------

    def when(self, pred: jax.Array, f: Callable[[], Any], zeros: Any) -> Any:
        """``f()`` where ``pred``, else ``zeros``: skipped by a conditional, or computed and masked.

        With mesh axes left to the partitioner inside a stage, XLA's SPMD partitioner cannot split the
        collectives of a conditional whose branch differs between stages (a check fails in
        spmd_partitioner_util; on CPU a collective-permute in a branch waits for every device)."""
        if self.skip:
            return lax.cond(pred, lambda: vary(f(), self.rows), lambda: vary(zeros, self.rows))
        return jax.tree.map(lambda o, z: jnp.where(pred, o, z), f(), zeros)

    def at_end(self, here: jax.Array, anywhere: jax.Array, f: Callable[[], Any], zeros: Any) -> Any:
        """``f()`` on the stage where ``here`` holds (the head on the last virtual stage, the embedding's
        gradient on the first), skipped elsewhere by a conditional where idle slots are (``skip``). Else the
        conditional must take the same branch on every stage: ``f`` then runs on every stage in the ticks where
        one needs it (``anywhere``), masked."""
        if self.skip:
            return self.when(here, f, zeros)
        masked = functools.partial(self.when, here, f, zeros)
        return lax.cond(anywhere, lambda: vary(masked(), self.rows), lambda: vary(zeros, self.rows))

    # -- the forward slot ------------------------------------------------------------------

    def unit_slot(self, lp: Unit, h: jax.Array, pos: jax.Array, real: jax.Array) -> tuple:
        """A unit slot of a chunk: the unit where ``real``, else the identity (uneven stages' unused slots,
        whose gradients are zero)."""
        if not self.uneven:
            return self.layer(lp, h, pos)
        passed = (h, jnp.zeros((), F32), self.zero_metrics())
        return self.when(real, lambda: self.layer(lp, h, pos), vary(passed, self.rows))

    def units(self, chunk: jax.Array, stage: jax.Array) -> jax.Array:
        """How many units the stage's chunk ``chunk`` runs: those of virtual stage chunk·p + stage."""
        return jnp.asarray(self.counts)[jnp.clip(chunk * self.stages + stage, 0, len(self.counts) - 1)]

    def chunk_forward(self, pc: Unit, h: jax.Array, pos: jax.Array, n: jax.Array) -> tuple:
        """A chunk of ``n`` units in its slots: output, the input of every slot, aux objective share, metrics
        (per slot)."""

        def one(h: jax.Array, lk: tuple) -> tuple[jax.Array, tuple]:
            y, obj, met = self.unit_slot(lk[0], h, pos, lk[1] < n)
            return y, (h, obj, met)

        y, (inputs, obj, met) = lax.scan(one, h, (pc, jnp.arange(self.slots)))
        return y, inputs, jnp.sum(obj), met

    def forward_slot(self, w: Weights, slot: Slot, stage: jax.Array, acts: jax.Array) -> tuple:
        """The chunk's output (sent on), its units' inputs (kept), its objective share and metrics, the prefix's
        and head's metrics; evaluating, the loss on the last virtual stage and the prefix's share of the aux
        objective on the first are in the objective share."""
        pos = w.xs["positions"][slot.micro]

        def run() -> tuple:
            first = (acts[slot.src, 0], self.zero_head(PREFIX))
            h, pre = self.when(slot.kind == FIRST, lambda: self.embedded(w, w.outer, slot.micro), first)
            y, inputs, obj, met = self.chunk_forward(take(w.blocks, slot.chunk), h, pos, self.units(slot.chunk, stage))
            head = self.zero_head()
            if not self.table.train:
                loss = functools.partial(self.loss_of, w.outer, y, self.micro(w, slot.micro), w.total)
                f_loss, head = self.at_end(slot.kind == LAST, slot.any_last, loss, (jnp.zeros((), F32), head))
                obj = obj + f_loss + self.share(PREFIX, pre) / self.spread
            return y, inputs, obj, self.tally(met, slot.chunk), (pre, head)

        zeros = (jnp.zeros(acts.shape[2:], acts.dtype), acts[0], jnp.zeros((), F32),
                 self.zero_metrics((self.repeats, self.slots)), (self.zero_head(PREFIX), self.zero_head()))
        return self.when(slot.kind > IDLE, run, vary(zeros, self.rows))

    def embedded(self, w: Weights, outer: Any, i: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        """Microbatch ``i``'s embedding, then the model's prefix where it has one (the first virtual stage's
        input), with ``outer`` as the prefix's parameters; and the prefix's metrics, in fp32."""
        model = self.head_model({**outer, "embedding": w.lookup})
        h, metrics = prefixed(model, model.embed(w.xs["inputs"][i]), w.xs["positions"][i])
        return h, jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)

    # -- the backward slot -----------------------------------------------------------------

    def head_grad(self, w: Weights, here: jax.Array, anywhere: jax.Array, y: jax.Array, micro: dict[str, jax.Array],
                  acc_outer: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
        """Loss, its gradient in ``y``, ``acc_outer`` plus the head's gradient, and the head's metrics, on the
        last virtual stage (the sum inside the conditional: its cross-device sum then runs in these ticks only).
        The head's fp8 histories (``precision.fp8_head``) get the largest of the microbatches' updates, as the
        blocks'."""

        def add(a: jax.Array, g: jax.Array, history: bool) -> jax.Array:
            return jnp.maximum(a, g) if history else a + g.astype(a.dtype)

        def run() -> tuple[jax.Array, jax.Array, Any, Any]:
            loss, pull, metrics = jax.vjp(lambda o, y: self.loss_of(o, y, micro, w.total), w.outer, y, has_aux=True)
            d_outer, dy = pull(jnp.ones_like(loss))
            return loss, dy, jax.tree.map(add, acc_outer, d_outer, self.outer_histories), metrics

        return self.at_end(here, anywhere, run, (jnp.zeros((), F32), jnp.zeros_like(y), acc_outer, self.zero_head()))

    def embedding_grad(self, w: Weights, slot: Slot, dh: jax.Array, acc_outer: Any) -> tuple[Any, jax.Array]:
        """``acc_outer`` plus, from the first virtual stage's input gradient ``dh``, the gradients of the model's
        prefix (where it has one: recomputed from the lookup under ``jax.vjp``, its share of the aux objective
        with it) and of the embedding, one-hot(tokens)ᵀ · (the lookup's output gradient), there; and that share.

        A matmul, not the scatter-add that autodiff of the lookup gives: XLA's partitioner cannot split a
        scatter into a sharded operand inside a partly manual ``shard_map``."""

        def run() -> tuple[Any, jax.Array]:
            tokens, acc, de, share = w.xs["inputs"][slot.micro], acc_outer, dh, jnp.zeros((), F32)
            model = self.head_model({**w.outer, "embedding": w.lookup})
            if hasattr(model, "prefix"):

                def prefix(outer: Any, h: jax.Array) -> tuple[jax.Array, jax.Array]:
                    x, metrics = prefixed(self.head_model(outer), h, w.xs["positions"][slot.micro])
                    return x, self.share(PREFIX, jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)) / self.spread

                (_, share), pull = jax.vjp(prefix, w.outer, model.embed(tokens))
                d_outer, de = pull(vary((dh, jnp.ones((), F32)), self.rows))
                acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, d_outer)
            hot = jax.nn.one_hot(tokens, self.model.vocab_size, dtype=de.dtype)
            table = acc["embedding"] + jnp.einsum("bsv,bse->ve", hot, de, preferred_element_type=F32)
            return {**acc, "embedding": table}, share

        return self.at_end(slot.kind == FIRST, slot.any_first, run, (acc_outer, jnp.zeros((), F32)))

    def backward_slot(self, w: Weights, slot: Slot, stage: jax.Array, dy_in: jax.Array, state: Loop) -> tuple:
        """Each unit of the chunk recomputed from its kept input and differentiated, last first (the top
        unit's output gradient: the head's on the last virtual stage, else ``dy_in`` from the next); each
        unit's gradient added to ``acc`` as it comes; split, all but its weight matmuls' (:mod:`weight_split`),
        whose inputs and output gradients it keeps for :meth:`weight_slot`. Returns acc, amax, acc_outer, the
        chunk's input gradient, the loss share, the metrics, the head's and, split, what the units keep for the
        W ([slots, ...] each; else ())."""
        pc, pos, on = take(w.blocks, slot.chunk), w.xs["positions"][slot.micro], slot.kind > IDLE
        n, top, inputs = self.units(slot.chunk, stage), self.slots - 1, state.acts[slot.src]
        cot, split = on.astype(F32), self.table.split  # the aux objective's cotangent: 0 in a masked slot
        outs, ins = self.split_types(w) if split else ((), ())

        def unit(lp: Any, hp: Any, x: jax.Array, k: jax.Array) -> tuple:
            return self.unit_slot(Unit(lp, hp, take(pc.copies, k)), x, pos, k < n)

        def split_unit(lp: Any, hp: Any, x: jax.Array, taps: list, k: jax.Array) -> tuple:
            """B: the unit with its weight matmuls' gradients deferred; their inputs, kept for the W."""
            def run() -> tuple:
                return weight_split.input_grad(lambda: self.layer(Unit(lp, hp, take(pc.copies, k)), x, pos), taps)
            if not self.uneven:
                return run()
            passed = ((x, jnp.zeros((), F32), self.zero_metrics()), weight_split.zeros(ins))
            return self.when(k < n, run, vary(passed, self.rows))

        def down(carry: tuple, k: jax.Array) -> tuple[tuple, tuple]:
            dx, acc, amax, acc_outer, loss, head = carry
            lp, hp, kept = take(pc.params, k), take(pc.histories, k), ()
            if split:  # the weight matmuls' gradients wait for the weight slot
                (y, obj, met), pull, kept = jax.vjp(functools.partial(split_unit, k=k), lp, hp, inputs[k],
                                                    weight_split.zeros(outs), has_aux=True)
            else:
                (y, obj, met), pull = jax.vjp(functools.partial(unit, k=k), lp, hp, inputs[k])
            head_loss, dy_head, acc_outer, head_met = self.head_grad(
                w, (slot.kind == LAST) & (k == top), slot.any_last & (k == top), y, self.micro(w, slot.micro),
                acc_outer,
            )
            dy = jnp.where(k == top, jnp.where(on, jnp.where(slot.kind == LAST, dy_head, dy_in), 0), dx)
            d_lp, d_hp, dx, *dys = pull(vary((dy, cot, jax.tree.map(jnp.zeros_like, met)), self.rows))
            acc = self.add_unit_grad(acc, slot.chunk, k, d_lp)
            amax = self.add_amax(amax, slot.chunk, k, d_hp, on & (k < n))
            head = jax.tree.map(jnp.add, head, head_met)
            return (dx, acc, amax, acc_outer, loss + head_loss + obj, head), (met, (kept, *dys) if split else ())

        def run() -> tuple:
            init = vary((jnp.zeros_like(inputs[0]), state.acc, state.amax, state.acc_outer, jnp.zeros((), F32),
                         self.zero_head()), self.rows)
            (dx, acc, amax, acc_outer, loss, head), (mets, dys) = lax.scan(
                down, init, jnp.arange(self.slots), reverse=True
            )
            return acc, amax, acc_outer, dx, loss, self.tally(mets, slot.chunk), head, dys

        zeros = vary((state.acc, state.amax, state.acc_outer, jnp.zeros_like(inputs[0]), jnp.zeros((), F32),
                      self.zero_metrics((self.repeats, self.slots)), self.zero_head(),
                      weight_split.zeros((ins, outs), (self.slots,)) if split else ()), self.rows)
        if self.skip:
            return self.when(on, run, zeros)
        # Masked: an idle slot's cotangents are zero, so it adds exact zeros to ``acc``; its amaxes are masked.
        acc, amax, *rest = run()
        return acc, amax, *jax.tree.map(lambda o, z: jnp.where(on, o, z), tuple(rest), zeros[2:])

    def weight_slot(self, w: Weights, slot: Slot, stage: jax.Array, kept: Any, acc: Any, amax: Any) -> tuple[Any, Any]:
        """Split schedules: each unit's weight matmuls on the inputs its B kept in ``kept``, differentiated in the
        unit's parameters by their output gradients kept there (:mod:`weight_split`: the weight-gradient matmuls
        alone); returns ``acc`` plus the units' gradients and ``amax`` with their fp8 histories' updates."""
        pc, pos, on = take(w.blocks, slot.chunk), w.xs["positions"][slot.micro], slot.kind > IDLE
        n, x = self.units(slot.chunk, stage), self.unit_input(w)  # the units' own inputs: unread

        def one(carry: tuple, k: jax.Array) -> tuple[tuple, None]:
            acc, amax = carry
            lp, hp, (inputs, dys) = take(pc.params, k), take(pc.histories, k), take(kept, k)

            def grads() -> tuple[Any, Any]:
                _, pull = jax.vjp(lambda lp, hp: weight_split.weight_outputs(
                    lambda: self.layer(Unit(lp, hp, take(pc.copies, k)), x, pos), inputs), lp, hp)
                return pull(jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros_like(d)), dys))  # a masked slot: 0

            zeros = jax.tree.map(jnp.zeros_like, (lp, hp))
            d_lp, d_hp = self.when(k < n, grads, zeros) if self.uneven else grads()
            amax = self.add_amax(amax, slot.chunk, k, d_hp, on & (k < n))
            return (self.add_unit_grad(acc, slot.chunk, k, d_lp), amax), None

        def run() -> tuple[Any, Any]:
            return lax.scan(one, vary((acc, amax), self.rows), jnp.arange(self.slots))[0]

        return self.when(on, run, (acc, amax)) if self.skip else run()

    def unit_input(self, w: Weights) -> jax.Array:
        """Zeros shaped as a unit's input: a microbatch's activations on this device."""
        return vary(jnp.zeros((*w.xs["inputs"].shape[1:], self.model.embed), self.dtype), self.rows)

    def split_types(self, w: Weights) -> tuple[Any, Any]:
        """Split: the types of a unit's weight matmul outputs and distinct inputs (:func:`weight_split.types`)."""
        unit = take(take(w.blocks, 0), 0)
        return weight_split.types(lambda: self.layer(unit, self.unit_input(w), w.xs["positions"][0]))

    @staticmethod
    def add_unit_grad(acc: Any, chunk: jax.Array, k: jax.Array, d_lp: Any) -> Any:
        """``acc`` plus unit ``k``'s gradient ``d_lp``, at chunk ``chunk``'s slot k."""

        def one(a: jax.Array, g: jax.Array) -> jax.Array:
            start = (chunk, k, *([0] * g.ndim))
            old = lax.dynamic_slice(a, start, (1, 1, *g.shape))
            return lax.dynamic_update_slice(a, old + g.astype(a.dtype)[None, None], start)

        return jax.tree.map(one, acc, d_lp)

    @staticmethod
    def add_amax(amax: Any, chunk: jax.Array, k: jax.Array, d_hp: Any, valid: jax.Array) -> Any:
        """``amax`` with unit ``k``'s updated fp8 histories ``d_hp`` (:mod:`jaxscale.precision.fp8`: a history's
        "gradient" is the history with this microbatch's amax pushed in) at chunk ``chunk``'s slot k: the
        largest of the microbatches' (as :func:`jaxscale.precision.fp8.combine`), where ``valid``."""

        def one(a: jax.Array, h: jax.Array) -> jax.Array:
            start = (chunk, k, *([0] * h.ndim))
            old = lax.dynamic_slice(a, start, (1, 1, *h.shape))
            return lax.dynamic_update_slice(a, jnp.where(valid, jnp.maximum(old, h[None, None]), old), start)

        return jax.tree.map(one, amax, d_hp)

    # -- the loop ---------------------------------------------------------------------------

    def tick(self, w: Weights, stage: jax.Array, state: Loop, col: dict[str, jax.Array]) -> tuple[Loop, None]:
        """One row of the table: the forward slot, the backward slot (training), then the two messages."""
        fwd = read_slot(col, stage, "f_")
        y, inputs, f_loss, f_met, (f_pre, f_head) = self.forward_slot(w, fwd, stage, state.acts)
        if not self.table.train:
            acts = self.send_forward(state.acts, y, col["recv_f"][stage])
            return state._replace(acts=acts, loss=state.loss + f_loss,
                                  metrics=jax.tree.map(jnp.add, state.metrics, f_met),
                                  head=jax.tree.map(jnp.add, state.head, (f_pre, f_head))), None
        # The units' inputs kept for the backward, in the slot where the chunk's input arrived.
        state = state._replace(acts=put(state.acts, jnp.where(fwd.kind > IDLE, fwd.src, -1), inputs))
        bwd = read_slot(col, stage, "b_")
        acc, amax, acc_outer, dh, b_loss, b_met, b_head, kept = self.backward_slot(
            w, bwd, stage, state.grads[col["b_grad"][stage]], state
        )
        acc_outer, p_loss = self.embedding_grad(w, bwd, dh, acc_outer)
        cots = state.cots
        if self.table.split:  # the weight slot, after the B slot has kept its matmuls' inputs and output gradients
            cots = jax.tree.map(lambda c, k: put(c, col["b_cot"][stage], k), cots, kept)
            with jax.named_scope("weight_slot"):
                acc, amax = self.weight_slot(w, read_slot(col, stage, "w_"), stage,
                                             jax.tree.map(lambda c: c[col["w_cot"][stage]], cots), acc, amax)
        state = Loop(
            acts=self.send_forward(state.acts, y, col["recv_f"][stage]),
            grads=self.send_backward(state.grads, dh, col["recv_b"][stage]), cots=cots,
            acc=acc, acc_outer=acc_outer, amax=amax, loss=state.loss + b_loss + p_loss,
            metrics=jax.tree.map(jnp.add, state.metrics, b_met),
            head=jax.tree.map(jnp.add, state.head, (f_pre, b_head)),
        )
        return state, None

    def start(self, w: Weights) -> Loop:
        """The loop's state before the first tick: empty buffers, zero gradients."""
        h = (*w.xs["inputs"].shape[1:], self.model.embed)  # a microbatch's activations: rows, length, embed
        train, split = self.table.train, self.table.split

        def zeros(tree: Any) -> Any:  # each typed as varying as its parameter (a TP shard varies over TP's axes)
            return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, F32), varying(a)), tree) if train else {}

        state = Loop(
            acts=jnp.zeros((self.table.act_slots, self.slots, *h), self.dtype),
            grads=jnp.zeros((self.table.grad_slots if train else 1, *h), self.dtype),
            cots=weight_split.zeros(self.split_types(w)[::-1], (self.table.cot_slots, self.slots)) if split else (),
            acc=zeros(w.blocks.params), acc_outer=zeros(w.outer), amax=zeros(w.blocks.histories),
            loss=jnp.zeros((), F32), metrics=self.zero_metrics((self.repeats, self.slots)),
            head=(self.zero_head(PREFIX), self.zero_head()),
        )
        return vary(state, self.rows)

    def quantized(self, blocks: Unit) -> Any:
        """The e4m3 copies of the stage's fp8 weights, made once per step before the loop
        (:func:`jaxscale.precision.fp8.prepare`; none with precision.fp8 off), each varying over the loop's axes as
        the weights do."""
        if not blocks.histories:
            return {}
        copies = fp8.prepare(nnx.merge(self.block_graph, blocks.params, blocks.histories))
        return {path: {name: q.mapped(lambda a: vary(a, self.rows), lambda a: a) for name, q in made.items()}
                for path, made in copies.items()}

    def run(self, outer: Any, blocks: Any, histories: Any, xs: dict[str, jax.Array]) -> tuple:
        """The ``shard_map``'s body: the stage's loop over the table's ticks under the stage's layout.

        ``histories``: the blocks' fp8 amax histories, each stage its own layers' (varying over ``stage``
        alone: an amax inside the stage is the maximum over the devices of that stage,
        :func:`jaxscale.precision.fp8.global_amax`). Returns the loss, each unit slot's metrics, the head's and,
        training,
        the blocks' gradients, their updated histories and the per-stage gradients of the embedding, final norm
        and head (a leading ``stage`` dimension of 1)."""
        with use_layout(jax.sharding.get_abstract_mesh(), self.inner):
            # The embedding and head gathered over the stage's FSDP axes once, before the loop: XLA cannot
            # partition their lookup or scatter against FSDP shards inside the partly manual region.
            outer = jax.tree.map(
                lambda x, a: constrain(x[0], tuple(None if n == "embed" else n for n in a)), outer, self.outer_axes,
                is_leaf=lambda x: isinstance(x, jax.Array),
            )
            copies = self.quantized(Unit(blocks, histories, {}))  # once per step: not per microbatch or tick
            xs = self.own_tokens(xs)
            lookup, blocks, xs = vary((self.lookup_table(outer["embedding"]), blocks, xs), self.rows)
            # The head's fp8 histories vary over ``stage`` alone, as the blocks': its amaxes span the stage's rows.
            outer = jax.tree.map(lambda x, h: x if h else vary(x, self.rows), outer, self.outer_histories)
            w = Weights(outer, lookup, Unit(blocks, histories, copies), xs, self.count_targets(xs["targets"]))
            first = take(take(w.blocks, 0), 0)  # which metrics there are: a first trace of the prefix and a unit
            shapes = jax.eval_shape(lambda: (self.embedded(w, w.outer, 0)[1],
                                             self.unit(first, self.unit_input(w), w.xs["positions"][0])[1]))
            program = dataclasses.replace(self, metric_shapes=(*shapes, self.head_metrics))
            cols = {k: jnp.asarray(a) for k, a in self.table.arrays().items()}
            tick = functools.partial(program.tick, w, lax.axis_index(AXIS))
            state, _ = lax.scan(tick, program.start(w), cols)
            return program.reduce(state)

    def own_tokens(self, xs: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """With SP's axes manual, the device's own part of the sequence of the token ids and targets: it
        embeds those, and the head reads the residual stream there (split on the sequence); the positions
        stay whole, for attention reads them on its gathered input."""
        axes = self.inner.stage.sequence
        if not axes:
            return xs
        n = xs["inputs"].shape[2] // self.inner.size(axes)
        start = lax.axis_index(axes) * n
        return {**xs, **{k: lax.dynamic_slice_in_dim(xs[k], start, n, axis=2) for k in ("inputs", "targets")}}

    # -- what crosses stages ------------------------------------------------------------------

    def _ring(self) -> list[tuple[int, int]]:
        """Stage s sends to s + 1; with v > 1 chunks the last stage's output goes round to stage 0."""
        p = self.stages
        return [(s, (s + 1) % p) for s in range(p)] if self.repeats > 1 else [(s, s + 1) for s in range(p - 1)]

    def send_forward(self, acts: jax.Array, y: jax.Array, recv: jax.Array) -> jax.Array:
        """Each tick: the forward slot's output to the next stage, into its buffer slot ``recv`` (−1: none),
        as the first unit's input there."""
        return put(acts, recv, lax.ppermute(y, AXIS, self._ring())[None], whole=False)

    def send_backward(self, grads: jax.Array, dh: jax.Array, recv: jax.Array) -> jax.Array:
        """Each tick (training): the backward slot's input gradient to the previous stage, into slot ``recv``."""
        return put(grads, recv, lax.ppermute(dh, AXIS, [(b, a) for a, b in self._ring()]))

    def count_targets(self, targets: jax.Array) -> jax.Array:
        """Once per step: the trained targets (≥ 0) of the batch, summed over the manual data and context axes
        (each device's own rows; every stage holds the same), at least 1."""
        trained = jnp.sum(targets >= 0, dtype=F32)
        return jnp.maximum(lax.psum(trained, self.summed) if self.summed else trained, 1.0)

    def reduce(self, state: Loop) -> tuple:
        """Once per step: gradients and loss summed over the manual data and context axes (each device's
        own rows), then loss and the head's metrics over ``stage`` (the head's are the last stage's), the
        model's aux objective's constant part added (:meth:`Channel.constant`). Each unit slot's metrics,
        their microbatches' mean (averaged over the devices of the stage's rows, each holding its own rows'),
        stay with their stage, [v·slots, ...], as the stack is stored."""
        m = self.microbatches
        layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]) / m, state.metrics)
        acc, acc_outer, loss = self.scatter(state.acc) if self.table.train else state.acc, state.acc_outer, state.loss
        amax = state.amax
        if self.summed:
            loss = lax.psum(loss, self.summed)
            if self.table.train:  # the head's fp8 histories: the largest amaxes (evaluating: none kept)
                acc_outer = jax.tree.map(lambda a, h: (lax.pmax if h else lax.psum)(a, self.summed), acc_outer,
                                         self.outer_histories)
            amax = lax.pmax(amax, self.summed)  # the same on every device of a stage (global amaxes)
        head = jax.tree.map(lambda a: a / m, state.head)
        if self.summed:  # a loop manual over data axes: each device's rows' means, averaged (MoE's: the same)
            head, layers = lax.pmean((head, layers), self.summed)
        loss, head = lax.psum((loss, head), AXIS)
        loss = loss + self.channel.constant(self.metric_shapes)
        if not self.table.train:
            return loss, layers, head
        return loss, layers, head, acc, amax, jax.tree.map(lambda a: a[None], acc_outer)

    def scatter(self, acc: Any) -> Any:
        """Once per step: the blocks' gradients summed over the manual data and context axes that split no
        block parameter; over those that do (FSDP's), already on the shards (``visit``: reduce-scattered layer
        by layer), or (the blocks entered gathered over them) each device's own sum handed out whole, in a
        leading dimension that :func:`~jaxscale.parallel.pipeline.sum_shards` reduces onto the shards."""

        def one(g: jax.Array, dims: tuple[tuple[str, ...], ...], shards: tuple[tuple[str, ...], ...]) -> jax.Array:
            split = {a for axes in dims for a in axes}
            rest = tuple(a for a in self.summed if a not in split and a not in {a for s in shards for a in s})
            g = lax.psum(g, rest) if rest else g
            return g[None] if split and not self.visit else g

        leaves, tree = jax.tree.flatten(acc)
        return tree.unflatten([one(*a) for a in zip(leaves, self.gathers, self.shards, strict=True)])

    @staticmethod
    def sum_stage_copies(d_outer: Any) -> Any:
        """Once per step, outside the ``shard_map``: the embedding's, final norm's and head's gradients of each
        stage's copy ([stage, ...]) summed over ``stage`` (the head's fp8 histories: zeros but on the last stage)."""
        return jax.tree.map(lambda d: jnp.sum(d, axis=0), d_outer)
