"""Pipeline schedules as data: which forward and backward each stage runs at each tick, and where messages wait.

A schedule is first an *order*: for each stage, the list of operations it runs, ``F(i, c)`` (the
forward of microbatch i through its chunk c of layers) and ``B(i, c)`` (that chunk's backward).
With p stages and v chunks per stage (``pipeline.repeats``) there are v·p *virtual stages*;
chunk c of stage s is virtual stage g = c·p + s, so a microbatch goes round the ring of stages v
times (layers are grouped in that order, :mod:`jaxscale.parallel.pipeline`). The orders:

* ``gpipe`` (v = 1) and ``circular`` (v ≥ 2): every forward (microbatch by microbatch, one round of
  the ring after another), then every backward in the reverse order: what autodiff of a forward
  loop runs. A stage holds the inputs of all v·m of its forwards until their backwards.
* ``1f1b`` (v = 1): stage s runs 2·(p − s − 1) forwards (warm-up: in lock-step ticks a microbatch's
  round trip to the last stage and back takes that many), then alternates one forward and one
  backward, then finishes the backwards.
* ``interleaved_1f1b`` (v ≥ 2, Megatron-LM's): microbatches in groups of p go through chunk 0,
  then chunk 1, ...; stage s warms up with 2·(p − s − 1) + (v − 1)·p forwards, then alternates.
* ``zb_h1`` (v = 1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward split into
  ``B(i, c)``, the chunk's input gradient (what the previous stage waits for), and ``W(i, c)``, its
  weight gradient (which nobody waits for). Stage s warms up with p − s − 1 forwards, then runs s
  pairs F, B (their W put off), then triples F, B, W, then B, W, and ends with the s W it put off:
  they fill the ticks where 1F1B's stage s waits for the last backwards to come down.

:func:`build` then runs the orders in lock-step *ticks*, the unit of the SPMD loop: each tick a
stage runs at most one forward and then at most one backward, each as soon as its input is there
(sent by a neighbour in an earlier tick; a backward may follow its own forward in the same tick),
and never out of the stage's order. A schedule that splits the backward (``zb_h1``) runs a B alone in
its tick and a W with the F that follows it: here a B recomputes its chunk (2 forwards' time) and a W
is its weight matmuls alone (1, :mod:`jaxscale.parallel.weight_split`), so that every tick is about as
long as a B, and a W placed in a tick where the stage would wait costs nothing. Per microbatch a stage
then runs two ticks where 1F1B runs one twice as long; the bubble is (p − 1)·(F + B) of the step
where 1F1B's is (p − 1)·(F + B + W) (:func:`formula_bubble`). Messages sent in tick t (the
forward's output to the next virtual stage, the backward's input gradient to the previous one) are
written into a *slot* of the receiver's buffer at the end of tick t and freed when read for the last
time; slots are reused greedily, so the buffers are as small as the schedule allows: the ``1f1b`` stash stays at
at most 2p microbatches whatever m (a message moves one stage a tick, so the round trip from
stage s to the last and back takes 2·(p − 1 − s) ticks), where ``gpipe`` keeps m.

A stage keeps, for each microbatch in flight, the inputs of every layer of the chunk (the forward
slot writes them where its input arrived; the first virtual stage's slot is taken when its forward
runs), so that its backward recomputes each layer once from its input. The last virtual stage's
backward also runs the final norm, the output head and the loss: the head runs once per
microbatch, on the last stage only, and its logits never outlive the tick. Split, the B keeps each
layer's weight matmuls' inputs and output gradients (a *cotangent slot*, ``cot_slots`` of them, from the B
to the W; :mod:`jaxscale.parallel.weight_split`) and the W runs those matmuls' weight gradients alone: the
layer inputs are freed at the B, and W costs the weight-gradient matmuls (:meth:`Table.cost`).

Everything here is NumPy: the tables are built while the step is traced, and the planner and the
benchmark count ticks, bubble and stash from them without jax.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import numpy as np

from jaxscale.config.schema import SPLIT, Schedule

Kind = Literal["F", "B", "W"]
SCHEDULES: tuple[Schedule, ...] = typing.get_args(Schedule)

# What a slot runs (:mod:`jaxscale.parallel.stage_program`): nothing, or the first, a middle or the last virtual stage.
IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a stage: forward, backward (split: input gradient) or weight gradient of ``micro``
    through the stage's chunk ``chunk``."""

    kind: Kind
    micro: int
    chunk: int


def _interleaved_item(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """Megatron's k-th forward (or backward) of a stage: (microbatch, chunk), microbatches in groups of p."""
    chunk = (k // p) % v
    return (k // (p * v)) * p + k % p, v - 1 - chunk if backward else chunk


def _zb_h1(p: int, m: int, stage: int) -> list[Op]:
    """ZB-H1's operations of ``stage``: p − s − 1 forwards, s pairs F, B, triples F, B, W, pairs B, W, the s W left."""
    warm = min(p - stage - 1, m)
    deferred = min(stage, m - warm)
    ops = [Op("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        ops += [Op("F", warm + i, 0), Op("B", i, 0)] + ([Op("W", i - deferred, 0)] if i >= deferred else [])
    for i in range(m - warm, m):
        ops += [Op("B", i, 0), Op("W", i - deferred, 0)]
    return ops + [Op("W", i, 0) for i in range(m - deferred, m)]


def order(schedule: str, p: int, m: int, v: int, stage: int) -> list[Op]:
    """The operations of ``stage`` in the order it runs them."""
    if schedule == "zb_h1":
        return _zb_h1(p, m, stage)
    if schedule in ("gpipe", "circular"):
        forwards = [Op("F", i, c) for c in range(v) for i in range(m)]
        return forwards + [Op("B", op.micro, op.chunk) for op in reversed(forwards)]
    if schedule == "1f1b":
        f = [Op("F", i, 0) for i in range(m)]
        b = [Op("B", i, 0) for i in range(m)]
        warm = min(2 * (p - stage - 1), m)
    elif schedule == "interleaved_1f1b":
        f = [Op("F", *_interleaved_item(k, p, v, False)) for k in range(m * v)]
        b = [Op("B", *_interleaved_item(k, p, v, True)) for k in range(m * v)]
        warm = min(2 * (p - stage - 1) + (v - 1) * p + 0, m * v)
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    steady = [op for pair in zip(f[warm:], b, strict=False) for op in pair]
    return f[:warm] + steady + b[len(f) - warm :]


@dataclasses.dataclass(frozen=True)
class Table:
    """The loop's program, one row per tick and one column per stage (``-1``: nothing).

    ``f_kind``/``b_kind``: the branch of the forward/backward slot (IDLE, FIRST: from the tokens,
    MIDDLE, LAST: with head and loss); ``*_micro``, ``*_chunk``: what it works on; ``f_src``,
    ``b_src``: the activation slot of its inputs (the first virtual stage's forward embeds the tokens);
    ``b_grad``: the gradient slot holding its output's gradient (the last virtual stage takes the
    loss's); ``recv_f``/``recv_b``: the slot where the message arriving at the end of the tick goes.
    Split schedules (``split``): the backward slot computes the input gradient and writes what its layers'
    weight gradients need (their matmuls' inputs and output gradients) into cotangent slot ``b_cot``; the
    *weight slot* ``w_*`` reads that alone (``w_cot``; ``w_src`` is −1); elsewhere every ``w_*``/``b_cot``
    entry is idle (−1).
    """

    p: int
    m: int
    v: int
    schedule: str
    train: bool
    f_kind: np.ndarray
    f_micro: np.ndarray
    f_chunk: np.ndarray
    f_src: np.ndarray
    b_kind: np.ndarray
    b_micro: np.ndarray
    b_chunk: np.ndarray
    b_src: np.ndarray
    b_grad: np.ndarray
    recv_f: np.ndarray
    recv_b: np.ndarray
    act_slots: int
    grad_slots: int
    w_kind: np.ndarray
    w_micro: np.ndarray
    w_chunk: np.ndarray
    w_src: np.ndarray
    w_cot: np.ndarray
    b_cot: np.ndarray
    cot_slots: int  # cotangent slots: a chunk's layers' output gradients kept from a B to its W (0 unless split)

    @property
    def ticks(self) -> int:
        return self.f_kind.shape[0]

    @property
    def split(self) -> bool:
        """Whether the backward is split into B and W slots (a split schedule's training table)."""
        return self.schedule in SPLIT and self.train

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-tick columns the loop scans over, int32."""
        names = ("f_kind", "f_micro", "f_chunk", "f_src", "b_kind", "b_micro", "b_chunk", "b_src", "b_grad",
                 "recv_f", "recv_b", "w_kind", "w_micro", "w_chunk", "w_src", "w_cot", "b_cot")
        return {n: getattr(self, n).astype(np.int32) for n in names}

    def cost(self, forward: float = 1.0, backward: float = 3.0, input_grad: float = 2.0, weight_grad: float = 1.0
             ) -> float:
        """Step time in forward-chunk units: each tick lasts as long as its busiest stage's slots.

        A backward costs ``backward`` (default 3: each layer recomputed from its input, then the
        backward's two matmuls per forward matmul). Split, a B costs ``input_grad`` (default 2: the
        recompute, then the input gradients) and a W ``weight_grad`` (default 1: the weight matmuls'
        gradients alone, :mod:`jaxscale.parallel.weight_split`): the unsplit backward's 3 in all (XLA's FLOPs
        of a layer of benchmarks/pp_bubble.py: B 1.82, W 0.93, unsplit 2.76 forwards). The paper's terms are
        1, 1 and 1.
        """
        b = input_grad if self.split else backward
        busy = forward * (self.f_kind > IDLE) + b * (self.b_kind > IDLE) + weight_grad * (self.w_kind > IDLE)
        return float(busy.max(axis=1).sum())

    def work(self, forward: float = 1.0, backward: float = 3.0, input_grad: float = 2.0, weight_grad: float = 1.0
             ) -> float:
        """The v·m chunks' work in the units of :meth:`cost`: what a stage computes with no bubble."""
        return self.m * self.v * (forward + (input_grad + weight_grad if self.split else backward))

    def bubble(self, forward: float = 1.0, backward: float = 3.0, input_grad: float = 2.0, weight_grad: float = 1.0
               ) -> float:
        """The step's time lost to the schedule, counted from the table: 1 − :meth:`work` / :meth:`cost`.

        The playbook's bubble on the same terms: (p − 1)/(v·m + p − 1) of the step when every tick is
        as long as one chunk's forward and backward.
        """
        weights = (forward, backward, input_grad, weight_grad)
        return 1.0 - self.work(*weights) / self.cost(*weights)


def formula_bubble(p: int, m: int, v: int, schedule: str = "1f1b") -> float:
    """The idle fraction of ``schedule``: (p − 1) / (v·m + p − 1) (the playbook's, a forward and a backward per
    tick), or for ZB-H1 as :func:`build` ticks it (a B alone, a W with the next F) (p − 1)·(F + B) over
    m·(F + B + W) + (p − 1)·(F + B), in :meth:`Table.cost`'s terms F 1, B 2, W 1. (The paper's, Qi et al.'s, with
    F = B = W and free-running stages: (p − 1)·(F + B − W) over m·(F + B + W) + (p − 1)·(F + B − W).)"""
    if schedule in SPLIT:
        return 3 * (p - 1) / (4 * m + 3 * (p - 1))
    return (p - 1) / (v * m + p - 1)


class _Slots:
    """Greedy slot allocation: a slot is free again from the tick its last reader runs."""

    def __init__(self) -> None:
        self.free_from: list[int] = []

    def take(self, written: int, last_read: int) -> int:
        for slot, free in enumerate(self.free_from):
            if free <= written:
                self.free_from[slot] = last_read
                return slot
        self.free_from.append(last_read)
        return len(self.free_from) - 1


def build(schedule: str, p: int, m: int, v: int, train: bool = True) -> Table:
    """The lock-step table of ``schedule``; ``train=False`` runs the forwards only, the loss in the last one.

    The arguments are the ones :meth:`jaxscale.layout.rules.Layout.validate` accepts: v > 1 for the interleaved
    schedules only, m ≥ p, and m a multiple of p for ``interleaved_1f1b``."""
    last, single = v * p - 1, schedule in SPLIT and train  # split: a B alone, a W with the next F
    orders = [order(schedule, p, m, v, s) for s in range(p)]
    if not train:
        orders = [[op for op in ops if op.kind == "F"] for ops in orders]
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro, virtual stage) -> tick
    at: list[list[list[Op]]] = []
    position = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        t = len(at)
        if t > 4 * (v * m + p) + 8:
            raise RuntimeError(f"schedule {schedule} deadlocks at p={p} m={m} v={v}")
        row: list[list[Op]] = [[] for _ in range(p)]
        for s in range(p):
            kinds: set[str] = set()
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                g = op.chunk * p + s
                if op.kind in kinds or (single and kinds and {op.kind, *kinds} != {"F", "W"}):
                    break
                if op.kind == "F":
                    ready = g == 0 or done.get(("F", op.micro, g - 1), t) < t
                elif op.kind == "W":
                    ready = done.get(("B", op.micro, g), t) < t
                else:
                    ready = done.get(("F", op.micro, g), t + 1) <= t and (
                        g == last or done.get(("B", op.micro, g + 1), t) < t
                    )
                if not ready:
                    break
                row[s].append(op)
                kinds.add(op.kind)
                position[s] += 1
            for op in row[s]:
                done[op.kind, op.micro, op.chunk * p + s] = t
        at.append(row)
    return _table(schedule, p, m, v, train, at, done)


def _table(
    schedule: str, p: int, m: int, v: int, train: bool, at: list[list[list[Op]]], done: dict[tuple[str, int, int], int]
) -> Table:
    ticks, last = len(at), v * p - 1
    cols = {n: np.full((ticks, p), -1) for n in ("f_micro", "f_chunk", "f_src", "b_micro", "b_chunk", "b_src",
                                                 "b_grad", "recv_f", "recv_b", "w_micro", "w_chunk", "w_src",
                                                 "w_cot", "b_cot")}
    kinds = {k: np.zeros((ticks, p), int) for k in "FBW"}
    acts, grads, cots = ([_Slots() for _ in range(p)] for _ in range(3))
    # Activation slots: written when the previous virtual stage's forward runs (the first virtual
    # stage's as its own forward starts), read until the backward (training; split: B) or the forward.
    reader = "B" if train else "F"
    inputs = [(done["F", micro, g - 1] if g else done["F", micro, g] - 1, done[reader, micro, g], micro, g)
              for (kind, micro, g) in done if kind == "F"]
    act_slot: dict[tuple[int, int], int] = {}  # (micro, virtual stage) -> slot of its inputs on its stage
    for written, read, micro, g in sorted(inputs):
        act_slot[micro, g] = acts[g % p].take(written, read)
        if g:
            cols["recv_f"][written, g % p] = act_slot[micro, g]
    # Gradient slots: written by the next virtual stage's backward, read by this one's.
    outputs = [(done["B", micro, g + 1], done["B", micro, g], micro, g)
               for (kind, micro, g) in done if kind == "B" and g < last]
    grad_slot: dict[tuple[int, int], int] = {}
    for written, read, micro, g in sorted(outputs):
        grad_slot[micro, g] = grads[g % p].take(written, read)
        cols["recv_b"][written, g % p] = grad_slot[micro, g]
    # Cotangent slots (split): written by a chunk's B, read by its W.
    kept = sorted((done["B", micro, g], done["W", micro, g], micro, g) for (kind, micro, g) in done if kind == "W")
    cot_slot = {(micro, g): cots[g % p].take(written, read) for written, read, micro, g in kept}
    for t, row in enumerate(at):
        for s, ops in enumerate(row):
            for op in ops:
                g, k = op.chunk * p + s, op.kind.lower()
                kinds[op.kind][t, s] = FIRST if g == 0 else LAST if g == last else MIDDLE
                cols[k + "_micro"][t, s], cols[k + "_chunk"][t, s] = op.micro, op.chunk
                cols[k + "_src"][t, s] = act_slot.get((op.micro, g), -1) if op.kind != "W" else -1
                if op.kind == "B":
                    cols["b_grad"][t, s] = grad_slot.get((op.micro, g), -1)
                    cols["b_cot"][t, s] = cot_slot.get((op.micro, g), -1)
                if op.kind == "W":
                    cols["w_cot"][t, s] = cot_slot[op.micro, g]
    return Table(
        p, m, v, schedule, train, f_kind=kinds["F"], b_kind=kinds["B"], w_kind=kinds["W"], **cols,
        act_slots=max(1, *(len(a.free_from) for a in acts)), grad_slots=max(1, *(len(g.free_from) for g in grads)),
        cot_slots=max(len(c.free_from) for c in cots),
    )
