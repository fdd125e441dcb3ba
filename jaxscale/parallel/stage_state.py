"""A pipeline stage's state: what it reads unchanged through the loop of ticks, what it carries from
tick to tick, and the buffer operations on them (:mod:`jaxscale.parallel.stage_program` runs the loop).

Everything here is typed for the inside of the stage's ``shard_map``: :func:`vary` marks values as each
device's own over manual axes, so autodiff inserts no sum over them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.parallel.schedules import FIRST, LAST


def on_host(buf: jax.Array) -> bool:
    """Whether ``buf`` lives in host memory (``pipeline.offload_stash``'s buffer of kept layer inputs)."""
    return jax.typeof(buf).memory_space == jax.memory.Space.Host


def read(buf: jax.Array, i: Any) -> jax.Array:
    """``buf[i]`` on the device (brought from host memory where ``buf`` lives there)."""
    return jax.device_put(buf[i], jax.memory.Space.Device) if on_host(buf) else buf[i]


def put(buf: jax.Array, slot: jax.Array, x: jax.Array, whole: bool = True) -> jax.Array:
    """``buf`` with ``x`` in ``slot`` (unchanged for slot −1): the whole slot, or its leading part; a buffer in
    host memory is read and written there (the choice between ``x`` and the old entry made on the device)."""
    i = jnp.maximum(slot, 0)
    old = read(buf, i) if whole else lax.dynamic_slice_in_dim(read(buf, i), 0, x.shape[0])
    new = jnp.where(slot >= 0, x, old)[None]
    start = (i, *([0] * (buf.ndim - 1)))
    return lax.dynamic_update_slice(buf, jax.device_put(new, jax.memory.Space.Host) if on_host(buf) else new, start)


def take(tree: Any, i: jax.Array) -> Any:
    """Entry ``i`` of every leaf's leading dimension."""
    return jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, i, keepdims=False), tree)


class Unit(NamedTuple):
    """A stacked unit's state (pure dicts), or a chunk's or the stage's (leading [v, slots] or [slots])."""

    params: Any  # its parameters
    histories: Any  # its fp8 amax histories (:mod:`jaxscale.precision.fp8`; empty with precision.fp8=off)
    copies: Any  # its weights' e4m3 copies, made once per step (:meth:`~jaxscale.parallel.stage_units.Units.quantized`)


class Weights(NamedTuple):
    """What a stage reads, unchanged through the loop."""

    outer: Any  # its copy of the embedding, final norm and head (pure dict)
    lookup: jax.Array  # the embedding table as the lookup reads it (:meth:`.stage_ends.Ends.lookup_table`)
    blocks: Unit  # its chunks of the stacked blocks, [v, slots, ...]
    xs: dict[str, jax.Array]  # inputs, positions, targets: [m, rows, length]
    total: jax.Array  # the batch's trained targets (targets ≥ 0; at least 1): :meth:`StageProgram.count_targets`


class Slot(NamedTuple):
    """One stage's forward or backward slot in a tick, from the table."""

    kind: jax.Array  # IDLE, FIRST, MIDDLE or LAST (the virtual stage's place in the ring)
    micro: jax.Array  # the microbatch
    chunk: jax.Array  # the stage's chunk (virtual stage chunk·p + stage)
    src: jax.Array  # the buffer slot its input waits in (and its layers' inputs are kept in)
    any_first: jax.Array  # whether some stage runs a FIRST slot of this kind in this tick
    any_last: jax.Array  # whether some stage runs a LAST slot of this kind in this tick


class Loop(NamedTuple):
    """The loop's state, carried from tick to tick."""

    acts: jax.Array  # [act_slots, slots, rows, length, embed]: each kept microbatch's layer inputs
    grads: jax.Array  # [grad_slots, rows, length, embed]: input gradients received, awaiting their backward
    cots: Any  # split: what B keeps for W (weight_split: matmul inputs, output gradients), [cot_slots, slots, ...]
    acc: Any  # the blocks' gradients, fp32, [v, slots, ...]
    acc_outer: Any  # the embedding's, final norm's and head's gradients, fp32
    amax: Any  # the blocks' fp8 histories with each microbatch's amaxes pushed in, the largest kept
    loss: jax.Array  # the objective's share of this device
    metrics: dict[str, Any]  # each unit slot's metrics, summed over its microbatches, [v, slots, ...]
    head: Any  # the prefix's and the head's metrics (the model's prefix and predictions ahead), summed


def read_slot(col: dict[str, jax.Array], stage: jax.Array, prefix: str) -> Slot:
    kinds = col[prefix + "kind"]
    mine = [col[prefix + k][stage] for k in ("kind", "micro", "chunk", "src")]
    return Slot(*mine, jnp.any(kinds == FIRST), jnp.any(kinds == LAST))
