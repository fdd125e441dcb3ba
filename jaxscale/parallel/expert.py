"""Expert parallelism (EP): each device holds some experts; tokens reach them and come back by all-to-all.

The rules map the experts' ``expert`` dimension to mesh axes (the "EP axes",
``expert: expert`` in the ``ep*`` presets); each device keeps ``E / ep`` experts'
weights, which is what EP saves: the expert weights, their gradients and Adam
state divided by ``ep`` (docs/formulas.md, "Model state per device": "EP divides the
routed experts by e"). Outside the MoE blocks the EP axes act as data parallelism: the
rules shard ``batch`` over them too, so each device routes its own sequences.

Per MoE layer, in a ``jax.shard_map`` manual over every mesh axis (with in
and out specs from the rules, so XLA gathers no auto-axis shard around the
collectives):

* capacity dispatch: the device scatters its ``b`` sequences into fixed-size
  buffers ``[b, E, C, h]`` (:func:`jaxscale.ops.routing.dispatch`), an
  **all-to-all** over the EP axes sends each expert's slice to the device
  holding it (``[ep·b, E/ep, C, h]``), the experts run, and a second
  all-to-all brings the outputs back to be combined. Each all-to-all moves
  ``(ep−1)/ep · b·E·C·h·bytes`` per device; with ``E·C ≈ cf·k·s`` the layer's
  forward sends ``2·cf·k·b·s·h·bytes·(ep−1)/ep``, the backward the same again.
  That is docs/formulas.md's ``2·k·b·s·h·bytes·(ep−1)/ep`` each way times the
  capacity factor: a fixed-size buffer carries its empty slots too
  (exactly, ``E·C / (k·s)`` in place of cf, ``C`` being rounded up).
  ``b`` is the sequences per device: the global batch over
  ``data · fsdp · expert``.
* dropless dispatch (``dropless_exchange: rows``, the default): the counts per
  expert are exchanged first, then exactly the routed rows move to their
  experts' shards and back (:mod:`jaxscale.parallel.exchange`):
  ``2·k·b·s·h·bytes·(ep−1)/ep`` times the routing imbalance each way.
  ``dropless_exchange: all_gather`` **all-gathers** the EP group's tokens (and
  their routing), runs its own experts' rows through grouped matmuls, and
  **reduce-scatters** the partial outputs back: ``2·(ep−1)·b·s·h·bytes``
  forward and the same backward, ``ep/k`` times the all-to-all's bytes; kept as
  the comparison (the rows exchange compiles on every backend: one ``ragged_all_to_all``
  each way on GPU and TPU, chunked all-to-alls on CPU).

The experts' MLP dimension may be sharded too (``expert_mlp: tensor``): every
tensor rank then dispatches the same tokens, runs its slice of each expert and
the partial outputs are summed at the layer's exit (an all-reduce, or under
sequence parallelism a reduce-scatter onto the sequence, after the sequence was
all-gathered on entry: Megatron's pattern). Weight shards on other axes (FSDP on
``embed``) are all-gathered inside, their gradients reduce-scattered.

Routing (router, top-k, capacity slots and the auxiliary losses) runs before,
under the partitioner, with whole-batch statistics, so every layout routes
and drops exactly as one device does.

**Inside a pipeline stage** no ``shard_map`` nests in the stage's loop; the loop
is manual over every axis instead (:attr:`jaxscale.layout.stage_plan.StagePlan.expert`):
each device holds its rows and its experts' shard, routing sums its statistics
over the stage's row axes (:func:`token_axes`, so they are each microbatch's),
and the per-device body, :func:`local_experts`, runs as it is, its all-to-alls
(or the dropless exchange's counts, rows and ``pmax`` of trips over the EP
axes alone) among the devices of one stage: they take the same branch of each
conditional, so a stage's idle slots are skipped.

The layouts this needs (the EP axes among the batch's, ``act_embed``
unsharded, the sequence split over all or none of ``expert_mlp``'s axes) are
checked once, when the trainer is built (:meth:`jaxscale.layout.rules.Layout.validate`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxscale.config.axes import RESIDUAL, ROUTING, W_IN, W_OUT
from jaxscale.config.read import MoEConfig
from jaxscale.layout.sharding import active, constrain, gather_shards, spec, stage
from jaxscale.ops import routing as kernels
from jaxscale.parallel import exchange
from jaxscale.precision import fp8

Weight = jax.Array | fp8.Operand


def _specs(w: Weight, s: PartitionSpec) -> Weight:
    """The ``shard_map`` specs of an expert weight laid out as ``s``; of an fp8 one, its per-expert scales and
    histories split as its experts, its output's history whole."""
    experts = PartitionSpec(s[0])
    return fp8.mapped(
        w, lambda _: s, scale=lambda _: experts, history=lambda _: PartitionSpec(s[0], None),
        grad_history=lambda _: PartitionSpec(),
    )


def _gathered(w: Weight, s: PartitionSpec, keep: tuple[str, ...], grads: jnp.dtype | None) -> Weight:
    """:func:`gather_shards` of an expert weight; an fp8 one's float8 values gathered as they are (1 byte each)."""
    return fp8.mapped(w, lambda a: gather_shards(a, s, keep, grads), float8=lambda q: gather_shards(q, s, keep))


class Exchange(NamedTuple):
    """Where one device's experts sit among its peers, for :func:`local_experts`."""

    ep: tuple[str, ...]  # the EP axes (manual): experts split over them, tokens exchanged among them
    shards: int  # their size
    partial: tuple[str, ...]  # manual axes splitting the experts' MLP with the tokens whole: partial sums
    every: tuple[str, ...]  # the manual axes a dropless exchange's trip count is agreed over
    ragged: bool  # whether the devices compile lax.ragged_all_to_all (exchange.ragged_compiles)


def local_experts(
    x: jax.Array, local: kernels.Routing, weights: tuple[Weight, ...], moe: MoEConfig, seq_capacity: int,
    where: Exchange, grads: jnp.dtype | None = None, f8: fp8.Inputs | None = None,
) -> jax.Array:
    """One device's part of the routed experts, in a trace already manual over ``where``'s axes: its tokens
    ``x`` [b, s, h] (whole sequences) routed by ``local``, its experts' ``weights`` (its EP shard, its slice of
    the experts' MLP), the exchange among the EP group; the gated sum of each token's experts (partial sums
    summed over ``where.partial``)."""
    ep, w_gate, w_up, w_down = where.ep, *weights
    if where.partial:
        # Megatron's "f": the tokens enter the expert-MLP-parallel region here, so the backward
        # sums their partial gradients once, on [b, s, h], not on the dispatched buffers.
        x = lax.pcast(x, where.partial, to="varying")
    if moe.dispatch == "capacity":
        buf = kernels.dispatch(x, local, moe.experts, seq_capacity)
        if ep:
            buf = lax.all_to_all(buf, ep, split_axis=1, concat_axis=0, tiled=True)
        out = kernels.swiglu(buf, w_gate, w_up, w_down, grads, f8)
        if ep:
            out = lax.all_to_all(out, ep, split_axis=0, concat_axis=1, tiled=True)
        y = kernels.combine(out, local)
    elif ep and moe.dropless_exchange == "rows" and where.ragged:
        y = exchange.ragged_rows(x, local, weights, ep, where.shards, f8)
    elif ep and moe.dropless_exchange == "rows":
        y = exchange.dropless_rows(x, local, weights, ep, where.shards, where.every, f8)
    elif ep:
        x, local = (lax.all_gather(a, ep, axis=0, tiled=True) for a in (x, local))
        first = lax.axis_index(ep) * w_gate.shape[0]
        y = kernels.dropless(x, local, w_gate, w_up, w_down, first, f8)
        y = lax.psum_scatter(y, ep, scatter_dimension=0, tiled=True)
    else:
        y = kernels.dropless(x, local, w_gate, w_up, w_down, f8=f8)
    return lax.psum(y, where.partial) if where.partial else y


def token_axes() -> tuple[str, ...]:
    """The manual mesh axes a batch's tokens are spread over where an MoE layer is traced: inside a pipeline
    stage, its row axes (:attr:`jaxscale.layout.rules.Stage.tokens`; none where the partitioner runs the experts);
    elsewhere none (routing runs under the partitioner on the whole batch)."""
    current = stage()
    return () if current is None else current.tokens


def experts(
    x: jax.Array,
    routing: kernels.Routing,
    weights: tuple[Weight, ...],
    moe: MoEConfig,
    seq_capacity: int,
    grads: jnp.dtype | None = None,
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """Routed experts' output for tokens ``x`` [batch, length, embed] under the active rules, by shard_map;
    ``grads``: the weight gradients' dtype (:func:`jaxscale.precision.policy.einsum`; the grouped matmuls of
    ``dropless`` keep autodiff's); ``f8``: the buffers' fp8 histories, whole on every device (an amax is
    then the whole batch's), with fp8 weights (:mod:`jaxscale.models.routing`).

    Inside a pipeline stage (:func:`jaxscale.layout.sharding.stage`) the loop is already manual over every axis
    and each device holds its rows and its experts' shard (:attr:`jaxscale.layout.stage_plan.StagePlan.expert`):
    :func:`local_experts` runs there as it is, its collectives among the stage's devices."""
    mesh, place = active()
    current = stage()
    if current is not None:
        ep = current.expert
        where = Exchange(ep, place.size(ep), current.expert_mlp, ep, exchange.ragged_compiles(mesh))
        return local_experts(x, routing, weights, moe, seq_capacity, where, grads, f8)
    ep, mlp = place.expert_axes, place.mesh_axes(("expert_mlp",))
    seq = place.mesh_axes((RESIDUAL[1],))
    w_specs = tuple(spec(place, a) for a in (W_IN, W_IN, W_OUT))
    keep = ep + mlp
    partial = tuple(a for a in mlp if a not in seq)  # the tokens are whole there: partial sums of the experts
    where = Exchange(ep, place.size(ep), partial, mesh.axis_names, exchange.ragged_compiles(mesh))

    def body(x: jax.Array, index: jax.Array, gate: jax.Array, slot: jax.Array, f8: Any, *ws: Weight) -> jax.Array:
        # Whole sequences on every device: capacity is counted per sequence.
        if seq:
            x, index, gate, slot = (lax.all_gather(a, seq, axis=1, tiled=True) for a in (x, index, gate, slot))
        ws = tuple(_gathered(w, s, keep, grads) for w, s in zip(ws, w_specs, strict=True))
        y = local_experts(x, kernels.Routing(index, gate, slot), ws, moe, seq_capacity, where, grads, f8)
        if seq and set(seq) <= set(mlp):
            y = lax.psum_scatter(y, seq, scatter_dimension=1, tiled=True)
        elif seq:
            n = y.shape[1] // place.size(seq)
            y = lax.dynamic_slice_in_dim(y, lax.axis_index(seq) * n, n, axis=1)
        return y

    x_spec, r_spec = spec(place, RESIDUAL), spec(place, ROUTING)
    whole = jax.tree.map(lambda _: PartitionSpec(), f8)
    specs = tuple(_specs(w, s) for w, s in zip(weights, w_specs, strict=True))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, r_spec, r_spec, r_spec, whole, *specs), out_specs=x_spec)
    x = constrain(x, RESIDUAL)
    index, gate, slot = (constrain(a, ROUTING) for a in routing)
    return fn(x, index, gate, slot, f8, *weights)
