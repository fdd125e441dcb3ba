"""A pipeline stage's slots: what one stage runs in one tick, each
returning named values.

The *forward slot* (:meth:`Slots.forward_slot`): the first virtual stage
embeds its microbatch and runs the model's ``prefix`` if it has one;
every chunk keeps the input of each of its units; evaluating, the last
virtual stage's loss. The *backward slot* (:meth:`Slots.backward_slot`):
each unit recomputed from its kept input under ``jax.vjp``, last unit
first, the top unit's output gradient the head's on the last virtual
stage (:meth:`~jaxscale.parallel.stage_ends.Ends.head_grad`), else the
next stage's. A schedule that splits the backward (``Table.split``:
ZB-H1) runs there every gradient but the weight matmuls', keeping their
inputs and output gradients (:mod:`~jaxscale.parallel.weight_split`),
and a third, *weight slot* (:meth:`Slots.weight_slot`) runs those
matmuls' weight gradients alone. Idle slots are skipped or masked by the
stage's gate (:mod:`~jaxscale.parallel.stage_gate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.sharding import vary
from jaxscale.parallel import weight_split
from jaxscale.parallel.schedules import FIRST, IDLE, LAST, Table
from jaxscale.parallel.stage_ends import Ends
from jaxscale.parallel.stage_metrics import PREFIX, Metrics
from jaxscale.parallel.stage_state import Loop, Slot, Unit, Weights, read, take
from jaxscale.parallel.stage_units import Units

F32 = jnp.float32


class Forward(NamedTuple):
    """What a forward slot gives."""

    y: jax.Array  # the chunk's output, sent on
    inputs: jax.Array  # each unit slot's input, kept for the backward
    obj: jax.Array  # its share of the objective (evaluating: the loss)
    metrics: Metrics  # each unit slot's, at the chunk's [v, slots, ...]
    prefix: Metrics  # the prefix's metrics (first virtual stage)
    head: Metrics  # evaluating, the head's (last virtual stage)


class Backward(NamedTuple):
    """What a backward slot gives."""

    acc: Any  # the blocks' gradients, this chunk's units' added
    amax: Any  # their fp8 histories, this microbatch's amaxes in
    acc_outer: Any  # the outer gradients, the head's added
    dx: jax.Array  # the chunk's input gradient, sent back
    loss: jax.Array  # the loss and aux objective's share here
    metrics: Metrics  # each unit slot's, at the chunk's [v, slots, ...]
    head: Metrics  # the head's metrics (last virtual stage)
    kept: Any  # split: what the units keep for W, [slots, ...]; else ()


class Grads(NamedTuple):
    """The blocks' gradients and fp8 histories (the weight slot's)."""

    acc: Any
    amax: Any


class Down(NamedTuple):
    """The backward's carry from unit to unit, last unit first."""

    dx: jax.Array  # the gradient in the unit's output
    acc: Any
    amax: Any
    acc_outer: Any
    loss: jax.Array
    head: Metrics


class Slots(Ends, Units):
    """The slots of a stage's program
    (:class:`~jaxscale.parallel.stage_program.StageProgram`)."""

    table: Table
    repeats: int
    tally: Callable[[Metrics, jax.Array], Metrics]

    def forward_slot(self, w: Weights, slot: Slot, stage: jax.Array,
                     acts: jax.Array) -> Forward:
        """The chunk's forward; evaluating, the loss on the last virtual
        stage and the prefix's share of the aux objective on the first
        are in its objective share."""
        pos = w.xs["positions"][slot.micro]

        def run() -> Forward:
            first = (read(acts, (slot.src, 0)), self.zero_head(PREFIX))
            h, pre = self.gate.when(
                slot.kind == FIRST,
                lambda: self.embedded(w, w.outer, slot.micro), first)
            n = self.units(slot.chunk, stage)
            chunk = self.chunk_forward(take(w.blocks, slot.chunk), h, pos, n)
            obj, head = chunk.obj, self.zero_head()
            if not self.table.train:
                loss = functools.partial(
                    self.loss_of, w.outer, chunk.y,
                    self.micro(w, slot.micro), w.total)
                f_loss, head = self.gate.at_end(
                    slot.kind == LAST, slot.any_last, loss,
                    (jnp.zeros((), F32), head))
                obj = obj + f_loss + self.share(PREFIX, pre) / self.spread
            met = self.tally(chunk.metrics, slot.chunk)
            return Forward(chunk.y, chunk.inputs, obj, met, pre, head)

        zeros = Forward(
            jnp.zeros(acts.shape[2:], acts.dtype), read(acts, 0),
            jnp.zeros((), F32), self.zero_metrics((self.repeats, self.slots)),
            self.zero_head(PREFIX), self.zero_head())
        return self.gate.when(slot.kind > IDLE, run, vary(zeros, self.rows))

    def unit_vjp(self, pc: Unit, pos: jax.Array, n: jax.Array, k: jax.Array,
                 x: jax.Array, types: tuple[Any, Any]) -> tuple:
        """Unit ``k`` of a chunk under ``jax.vjp`` from its input ``x``:
        its outputs, their pullback, and (split: B, its weight matmuls'
        gradients deferred) their inputs, kept for the weight slot."""
        lp, hp = take(pc.params, k), take(pc.histories, k)
        if not self.table.split:

            def unit(lp: Any, hp: Any, x: jax.Array) -> tuple:
                lk = Unit(lp, hp, take(pc.copies, k))
                return self.unit_slot(lk, x, pos, k < n)

            return (*jax.vjp(unit, lp, hp, x), ())
        outs, ins = types

        def split_unit(lp: Any, hp: Any, x: jax.Array, taps: list) -> tuple:
            def run() -> tuple:
                lk = Unit(lp, hp, take(pc.copies, k))
                return weight_split.input_grad(
                    lambda: self.layer(lk, x, pos), taps)

            def passed() -> tuple:
                zero = (x, jnp.zeros((), F32), self.zero_metrics())
                return vary((zero, weight_split.zeros(ins)), self.rows)

            return self.used(k < n, run, passed)

        taps = weight_split.zeros(outs)
        return jax.vjp(split_unit, lp, hp, x, taps, has_aux=True)

    @staticmethod
    def output_grad(slot: Slot, head_dy: jax.Array,
                    dy_in: jax.Array) -> jax.Array:
        """The chunk's output gradient: the head's on the last virtual
        stage, else the next stage's (``dy_in``); zero in an idle slot."""
        received = jnp.where(slot.kind == LAST, head_dy, dy_in)
        return jnp.where(slot.kind > IDLE, received, 0)

    def backward_slot(self, w: Weights, slot: Slot, stage: jax.Array,
                      dy_in: jax.Array, state: Loop) -> Backward:
        """Each unit of the chunk recomputed from its kept input and
        differentiated, last first; each unit's gradient added to ``acc``
        as it comes; split, all but its weight matmuls'."""
        pc, on = take(w.blocks, slot.chunk), slot.kind > IDLE
        pos, n = w.xs["positions"][slot.micro], self.units(slot.chunk, stage)
        inputs, split = read(state.acts, slot.src), self.table.split
        types = self.split_types(w) if split else ((), ())
        cot = on.astype(F32)  # the aux objective's: 0 in a masked slot

        def down(carry: Down, k: jax.Array) -> tuple[Down, tuple]:
            (y, obj, met), pull, kept = self.unit_vjp(
                pc, pos, n, k, inputs[k], types)
            top = k == self.slots - 1
            head = self.head_grad(
                w, (slot.kind == LAST) & top, slot.any_last & top, y,
                self.micro(w, slot.micro), carry.acc_outer)
            dy = jnp.where(top, self.output_grad(slot, head.dy, dy_in),
                           carry.dx)
            zeros = jax.tree.map(jnp.zeros_like, met)
            d_lp, d_hp, dx, *dys = pull(vary((dy, cot, zeros), self.rows))
            acc = self.add_unit_grad(carry.acc, slot.chunk, k, d_lp)
            amax = self.add_amax(carry.amax, slot.chunk, k, d_hp,
                                 on & (k < n))
            loss = carry.loss + head.loss + obj
            heads = jax.tree.map(jnp.add, carry.head, head.metrics)
            out = Down(dx, acc, amax, head.acc_outer, loss, heads)
            return out, (met, (kept, *dys) if split else ())

        def run() -> Backward:
            init = vary(Down(jnp.zeros_like(inputs[0]), state.acc,
                             state.amax, state.acc_outer, jnp.zeros((), F32),
                             self.zero_head()), self.rows)
            last, (mets, dys) = lax.scan(
                down, init, jnp.arange(self.slots), reverse=True)
            return Backward(last.acc, last.amax, last.acc_outer, last.dx,
                            last.loss, self.tally(mets, slot.chunk),
                            last.head, dys)

        kept = weight_split.zeros(types[::-1], (self.slots,)) if split else ()
        zeros = vary(Backward(
            state.acc, state.amax, state.acc_outer, jnp.zeros_like(inputs[0]),
            jnp.zeros((), F32), self.zero_metrics((self.repeats, self.slots)),
            self.zero_head(), kept), self.rows)
        # Masked: an idle slot's cotangents are zero, so it adds exact zeros
        # to ``acc``; its amaxes are masked.
        return self.gate.slot(on, run, zeros, exact=("acc", "amax"))

    def weight_slot(self, w: Weights, slot: Slot, stage: jax.Array,
                    kept: Any, grads: Grads) -> Grads:
        """Split schedules: each unit's weight matmuls on the inputs its B
        kept in ``kept``, differentiated in the unit's parameters by their
        output gradients kept there (the weight-gradient matmuls alone);
        ``grads`` plus the units' gradients and fp8 histories' updates."""
        pc, on = take(w.blocks, slot.chunk), slot.kind > IDLE
        pos, n = w.xs["positions"][slot.micro], self.units(slot.chunk, stage)
        x = self.unit_input(w)  # the units' own inputs: unread

        def one(carry: Grads, k: jax.Array) -> tuple[Grads, None]:
            lp, hp = take(pc.params, k), take(pc.histories, k)
            inputs, dys = take(kept, k)

            def weights(lp: Any, hp: Any) -> Any:
                lk = Unit(lp, hp, take(pc.copies, k))
                return weight_split.weight_outputs(
                    lambda: self.layer(lk, x, pos), inputs)

            def grads() -> tuple[Any, Any]:
                _, pull = jax.vjp(weights, lp, hp)
                # a masked slot's output gradients: 0
                return pull(jax.tree.map(
                    lambda d: jnp.where(on, d, jnp.zeros_like(d)), dys))

            d_lp, d_hp = self.used(
                k < n, grads, lambda: jax.tree.map(jnp.zeros_like, (lp, hp)))
            amax = self.add_amax(carry.amax, slot.chunk, k, d_hp,
                                 on & (k < n))
            acc = self.add_unit_grad(carry.acc, slot.chunk, k, d_lp)
            return Grads(acc, amax), None

        def run() -> Grads:
            init = vary(grads, self.rows)
            return lax.scan(one, init, jnp.arange(self.slots))[0]

        return self.gate.slot(on, run, grads, exact=Grads._fields)
