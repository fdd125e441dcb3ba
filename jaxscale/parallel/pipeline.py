"""Pipeline parallelism (PP): the layer stack split over the ``stage`` mesh
axis, one SPMD loop of ticks.

When the rules put ``layers`` on ``stage`` (size p > 1), the loss of the
model is computed by :func:`objective` instead of the plain forward:
embedding, the stacked blocks, final norm, output head and loss all run
inside one ``jax.shard_map`` that is manual over ``stage`` (and, unless
the partitioner runs an MoE model's experts, over the batch axes and the
context axes, whose ring attention then runs its per-device kernel
inside the loop: the stage's layout names them,
:class:`~jaxscale.layout.rules.Stage`). **Experts inside a stage**
(``model.moe.impl=shard_map``): each device keeps its shard of the
experts over the EP axes
(:attr:`~jaxscale.layout.stage_plan.StagePlan.expert`), and expert
parallelism's per-device body exchanges the tokens among the stage's
devices (:func:`jaxscale.parallel.expert.local_experts`); the routing
statistics are summed over the stage's row axes
(:attr:`~jaxscale.layout.rules.Stage.tokens`), so they are each
microbatch's. **FSDP inside a stage** at FSDP's price: batch axes that
split block parameters (fsdp on ``embed``) are manual too
(:attr:`~jaxscale.layout.stage_plan.StagePlan.gathered`); the stage's
blocks enter the ``shard_map`` gathered over them (once a step, by the
partitioner, which keeps TP's split), each device accumulates its own
rows' gradients, whole, and hands them out one per device, summed onto
the shards once after the loop
(:meth:`~jaxscale.parallel.stage_fsdp.Fsdp.sum_shards`): no FSDP
collective runs in a tick. With ``pipeline.fsdp=visit`` the blocks enter
as shards instead and each layer is gathered when a slot runs it, its
gradient reduce-scattered right after its backward
(:meth:`~jaxscale.parallel.stage_fsdp.Fsdp.gather`): one layer held
whole, the collectives in the busy slots' conditionals. **TP and SP
inside a stage**: where that leaves only TP's axes to the partitioner,
they are manual too
(:attr:`~jaxscale.layout.stage_plan.StagePlan.tensor`, whose plan says
where they cannot be): each device keeps its shard of the blocks (and of
their gradients) and the projections write TP's all-reduces, or SP's
all-gathers and reduce-scatters, among the devices of one stage
(:mod:`jaxscale.parallel.sequence`); the embedding, final norm and head
stay whole on each device (with TP alone each of a stage's TP devices
runs the head on the whole microbatch; with SP on its own part of the
sequence). With no axis left to the partitioner, idle slots are skipped
(:mod:`~jaxscale.parallel.stage_gate`). With v chunks per stage
(``pipeline.repeats``) stage s runs layer groups ``c·p + s`` for c < v,
the *virtual stages* a microbatch visits in turn round the ring, and
stores exactly those, one after the other
(:class:`~jaxscale.config.stage_layers.Storage`: the stack's order is
the chunks' order, so no parameter moves between stages in a step; with
v = 1, layers ``[s·L/p, (s+1)·L/p)``). With
``pipeline.layers_per_stage`` the virtual stages differ in size: each is
a chunk of as many slots as the largest, its unused slots the identity;
a tick then lasts as long as the largest chunk, whose slots every stage
keeps room for.

**The loop** (:mod:`jaxscale.parallel.schedules` builds its table as
data; each stage's program is a
:class:`~jaxscale.parallel.stage_program.StageProgram`): the batch is
cut into m microbatches (``pipeline.microbatches``; row r of microbatch
i is row r·m + i, so no device changes rows). Each tick every stage runs
at most one *forward slot* and then one *backward slot*, each IDLE,
FIRST, MIDDLE or LAST by the table: an idle slot is skipped by a
conditional (or, with mesh axes left to the partitioner inside a stage,
computed on zeros and masked), the first virtual stage embeds its
microbatch's tokens (and runs the model's ``prefix``, if any: DeepSeek's
dense blocks), the last one runs the final norm, the output head and the
loss (and the model's ``ahead``, if any: DeepSeek's multi-token
prediction). The forward slot keeps the input of every layer of its
chunk; the backward slot recomputes each layer from its input under
``jax.vjp``, last layer first, and adds the parameter gradients to fp32
accumulators; its input gradient goes to the previous stage. Both
messages of a tick (the forward's output, the backward's input gradient)
travel by ``ppermute`` at the end of the tick and wait in slots of the
receiver's buffers until used. The schedule (``pipeline.schedule``:
gpipe, circular, 1f1b, interleaved_1f1b, zb_h1) is only which slot runs
what; zb_h1 splits the backward slot into the input gradient and a
third, weight-gradient slot of the weight matmuls alone
(:mod:`~jaxscale.parallel.stage_slots`,
:mod:`jaxscale.parallel.weight_split`).

**Memory**: a stage keeps the layer inputs of its in-flight microbatches
(``Table.act_slots`` of them: m for GPipe, at most 2p for 1F1B in
lock-step ticks, whatever m; L/(p·v) layers' b·s·h each) plus,
transiently, one layer's residuals inside the backward slot. The logits
of one microbatch live only inside the last stage's backward slot (none
with ``model.loss_chunk``). **One recompute**: each layer runs forward
twice per microbatch (the forward slot, then the backward slot's
``vjp``); neither ``model.remat``'s policy nor ``selective``'s attention
checkpoint applies inside a stage (the stage's layout has a ``stage``),
so no layer is recomputed twice.

**What it communicates**, b·s·h the bytes of one microbatch's
activations on a device: collective-permute of 2 messages per tick
(forward and backward), 2·ticks·b·s·h bytes in all, where the playbook
counts 2·v·m·b·s·h (the bubble's ticks send zeros, as an SPMD loop
must); once per step, the gradients of the embedding and head
(replicated over ``stage``) are summed over ``stage`` and, for the
manual data and context axes, the block gradients over those axes.
Nothing else crosses ``stage``: no stage sees another's activations but
its neighbour's. Inside a stage the other axes stay with the partitioner
(TP's where not manual; with partitioner experts, GShard's dispatch and
FSDP; once per step the embedding table is moved to the lookup's layout,
split on its width,
:meth:`~jaxscale.parallel.stage_ends.Ends.lookup_table`); in every layer
the keys and values are all-gathered over ``context`` (the ring's kernel
on every device's blocks) and their gradients reduce-scattered.

**Gradients for autodiff**: :func:`objective` is a ``jax.custom_vjp``
whose forward runs the training table (every forward and backward, loss
and gradients at once) and whose backward only scales the gradients
computed there by the loss's cotangent; evaluation (no gradient) runs a
forward-only table, the loss in the last stage's forward slot.
**Metrics** (:mod:`jaxscale.parallel.stage_metrics`): whatever the
model's unit returns, each unit slot keeps, their microbatches' mean;
they leave the loop with their stage and are reduced as the model's
``hidden`` reduces them, in the model's layer order, then joined by the
head's (the model's ``ahead``). The model's ``aux_loss`` of them enters
each unit's and each head's objective as its share, so their gradients
flow through the same backward slots; the metrics returned are not
differentiable. MoE's per-layer statistics (``moe_layers``) come back in
the stack's storage order, the head's after them: the routing biases
(stored in the same order) are updated from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxscale.config import stage_layers
from jaxscale.config.read import ConfigError, PipelineConfig
from jaxscale.layout import stage_plan
from jaxscale.layout.rules import TOKENS, Stage
from jaxscale.layout.sharding import Layout, Rules, active, constrain, is_axes, layout_of, logical_axes, vary
from jaxscale.layout.stage_plan import Blocks, StagePlan
from jaxscale.parallel import schedules
from jaxscale.parallel.schedules import Table
from jaxscale.parallel.stage_ends import HeadLoss
from jaxscale.parallel.stage_fsdp import Fsdp
from jaxscale.parallel.stage_metrics import Channel, reduction, whole
from jaxscale.parallel.stage_program import AXIS, Result, StageProgram
from jaxscale.precision import fp8

__all__ = ["AXIS", "objective", "settings", "table", "vary"]

BATCH = ("inputs", "positions", "targets")


def settings(place: Layout) -> PipelineConfig:
    """The pipeline settings the active layout carries (ConfigError if
    ``use_rules`` was given none)."""
    if place.pipeline is None:
        raise ConfigError(
            f"rules '{place.name}' put layers on '{AXIS}' ({place.stages} "
            "stages) but no pipeline settings are in effect: "
            "use_rules(mesh, rules, pipeline=config.pipeline)")
    return place.pipeline


def table(config: PipelineConfig, p: int, train: bool = True) -> Table:
    """The loop's table for ``config`` on p stages (which
    ``Layout.validate`` has checked it can run)."""
    m = config.microbatches or p
    return schedules.build(config.schedule, p, m, config.repeats, train)


class Parts(NamedTuple):
    """The model as the pipeline splits it: its stacked blocks, and the
    rest (embedding, final norm, head)."""

    graph: Any  # the model's graph, its blocks' shapes, the rest's state
    block_shapes: Any
    rest: Any
    block_graph: Any  # one stacked unit's graph
    blocks: Any  # the blocks' parameters as stored, [slots, ...]
    block_axes: Any  # and their logical axes
    histories: Any  # the blocks' fp8 amax histories (empty: fp8 off)
    history_axes: Any
    outer: Any  # the rest's parameters (pure dict), their logical axes
    outer_axes: Any
    outer_histories: Any  # like outer: True at the head's fp8 histories


def split_model(model: Any) -> Parts:
    """``model``'s blocks (``model.blocks``, stacked; their fp8 histories
    apart) apart from the rest."""
    graph, blocks_state, rest = nnx.split(
        model, nnx.PathContains("blocks"), ...)
    block_graph, histories, block_state = nnx.split(
        model.blocks, fp8.Fp8Meta, ...)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          blocks_state)
    is_history = jax.tree.map(
        lambda v: isinstance(v, fp8.Fp8Meta), rest,
        is_leaf=lambda x: isinstance(x, nnx.Variable))
    return Parts(
        graph, shapes, rest, block_graph, nnx.to_pure_dict(block_state),
        logical_axes(block_state), nnx.to_pure_dict(histories),
        logical_axes(histories), nnx.to_pure_dict(rest), logical_axes(rest),
        nnx.to_pure_dict(is_history),
    )


def plan_of(place: Layout, model: Any, block_axes: list) -> StagePlan:
    """The stage's plan (:mod:`jaxscale.layout.stage_plan`): the one
    ``Layout.validate`` checked when the trainer was built, from the same
    pipeline settings and model parts; nothing is refused here."""
    explicit_tp = getattr(model, "explicit_tp", False)
    blocks = Blocks.of(model.config, block_axes, explicit_tp)
    return stage_plan.plan(place, settings(place), blocks)


def stage_of(plan: StagePlan) -> Stage:
    """What the code traced inside the stage's loop must know."""
    return Stage(plan.manual, plan.ring, plan.tensor, plan.split,
                 plan.sequence, expert=plan.expert,
                 expert_mlp=plan.expert_mlp, ulysses=plan.ulysses)


def fsdp_of(place: Layout, plan: StagePlan, block_axes: list) -> Fsdp:
    """The stage's blocks over FSDP's (and TP's, EP's) axes."""

    def per_dim(axes: tuple, among: tuple[str, ...]) -> tuple:
        return tuple(tuple(a for a in place.mesh_axes((n,)) if a in among)
                     for n in axes[1:])

    split = (*plan.tensor, *plan.expert)
    return Fsdp(
        gathers=tuple(per_dim(axes, plan.gathered) for axes in block_axes),
        shards=tuple(per_dim(axes, split) for axes in block_axes),
        block_axes=tuple(block_axes), visit=plan.visit)


def build(mesh: Mesh, place: Layout, parts: Parts, model: Any,
          head_loss: HeadLoss, head_metrics: Any) -> StageProgram:
    """The training program of each stage for this step."""
    config, c = settings(place), model.config
    p = place.stages
    block_axes = jax.tree.leaves(parts.block_axes, is_leaf=is_axes)
    plan = plan_of(place, model, block_axes)
    rules = place.rules
    inner = Rules(rules.name, {
        name: tuple(a for a in to if a not in plan.manual)
        for name, to in rules.params.items()})
    inner_layout = dataclasses.replace(
        layout_of(mesh, inner), pipeline=config, stage=stage_of(plan))
    # stacked slots (padded with uneven stages)
    layers = jax.tree.leaves(parts.blocks)[0].shape[0]
    counts = stage_layers.counts(config, c, p)
    return StageProgram(
        table=table(config, p), stages=p, repeats=config.repeats,
        microbatches=config.microbatches or p, counts=counts,
        slots=layers // (p * config.repeats), plan=plan,
        fsdp=fsdp_of(place, plan, block_axes), inner=inner_layout,
        dtype=jnp.dtype(c.dtype), model=c, graph=parts.graph,
        block_shapes=parts.block_shapes, rest=parts.rest,
        block_graph=parts.block_graph, outer_axes=parts.outer_axes,
        outer_histories=parts.outer_histories, head_loss=head_loss,
        head_metrics=head_metrics,
        channel=Channel(model.aux_loss, reduction(model), sum(counts)),
        stash_on_host=config.offload_stash,
    )


def microbatches(x: jax.Array, m: int) -> jax.Array:
    """[rows, ...] as [m, rows / m, ...]: row r of microbatch i is row
    r·m + i, so each device keeps its rows."""
    cut = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return constrain(cut, (None, *TOKENS))


def shard_mapped(program: StageProgram, mesh: Mesh,
                 rules: Rules) -> Callable[..., Result]:
    """``program`` on every stage: a ``shard_map`` manual over its axes,
    the embedding and head entering each stage as its own copy (a leading
    ``stage`` dimension), their gradients summed over ``stage`` after it.
    The stacked blocks enter as they are stored
    (:class:`~jaxscale.config.stage_layers.Storage`): stage s's shard is
    its v chunks one after the other, [v·slots, ...], seen as
    [v, slots, ...] where it runs."""
    plan, fsdp, v = program.plan, program.fsdp, program.repeats
    data = tuple(a for a in program.summed
                 if a not in plan.ring and a not in plan.tensor)
    batch = PartitionSpec(None, data or None, plan.ring or None)
    stacked = PartitionSpec(AXIS)

    def local(outer: Any, blocks: Any, histories: Any,
              xs: dict[str, jax.Array]) -> Result:
        chunks, hist = (
            jax.tree.map(
                lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), t)
            for t in (blocks, histories))
        out = program.run(outer, chunks, hist, xs)
        if not program.table.train:
            return out
        flat = jax.tree.map(lambda h: h.reshape(-1, *h.shape[2:]),
                            out.histories)
        return out._replace(grads=fsdp.stored(out.grads), histories=flat)

    def run(outer: Any, blocks: Any, histories: Any,
            xs: dict[str, jax.Array]) -> Result:
        per_stage = jax.tree.map(
            lambda w: jnp.broadcast_to(w[None], (program.stages, *w.shape)),
            outer)
        tree = jax.tree.structure(blocks)
        # TP's axes: each device keeps its shard of the blocks and of their
        # gradients; so do FSDP's under visit (gathered layer by layer
        # inside). Else the blocks enter gathered over FSDP's axes and each
        # device's gradient leaves whole, one per device.
        block_specs = tree.unflatten(fsdp.block_specs(AXIS))
        history_specs = jax.tree.map(lambda _: stacked, histories)
        outs = Result(PartitionSpec(), stacked, PartitionSpec())
        if program.table.train:
            grads = tree.unflatten(fsdp.grad_specs(AXIS))
            outs = outs._replace(grads=grads, histories=history_specs,
                                 outer=stacked)
        ins = (stacked, block_specs, history_specs,
               dict.fromkeys(xs, batch))
        out = jax.shard_map(
            local, mesh=mesh, in_specs=ins, out_specs=outs,
            axis_names=set(plan.manual),
        )(per_stage, blocks, histories, xs)
        if not program.table.train:
            return out
        return out._replace(
            grads=fsdp.sum_shards(out.grads, mesh, rules),
            outer=program.sum_stage_copies(out.outer))

    return run


def objective(model: Any, batch: dict[str, jax.Array],
              head_loss: HeadLoss) -> tuple[jax.Array, dict[str, Any]]:
    """The training objective of a pipelined richer-form model on
    ``batch`` and its metrics.

    Mean cross-entropy plus the model's ``aux_loss`` of its metrics (as
    the trainer's objective). ``head_loss(model, y, micro)`` is the mean
    loss of the stack's output ``y`` on one microbatch ``micro`` (final
    norm, head, cross-entropy) and the metrics of the model's predictions
    ahead, run on the last stage. Differentiable in the model's
    parameters. The metrics are the prefix's, the stack's reduced as the
    model's ``hidden`` does, then the head's
    (:func:`~jaxscale.parallel.stage_metrics.whole`): MoE's per-layer
    statistics (``moe_layers``) the stack's as stored, then the head's.
    """
    mesh, place = active()
    parts = split_model(model)
    c = model.config
    y = jax.ShapeDtypeStruct((*batch["inputs"].shape, c.embed), c.dtype)
    head_metrics = jax.eval_shape(
        lambda y, b: head_loss(model, y, b)[1], y,
        {k: batch[k] for k in BATCH})
    train = build(mesh, place, parts, model, head_loss, head_metrics)
    xs = {k: microbatches(batch[k], train.microbatches) for k in BATCH}
    pipelined = differentiable(train, parts, mesh, place)
    # stored with each stage's chunks together: no reshuffle
    loss, metrics = pipelined(parts.outer, parts.blocks, parts.histories, xs)
    return loss, jax.tree.map(lax.stop_gradient, metrics)


def differentiable(train: StageProgram, parts: Parts, mesh: Mesh,
                   place: Layout) -> Callable[..., tuple]:
    """The pipeline as a ``jax.custom_vjp`` of the outer parts, blocks,
    histories and microbatches: its forward runs the training table
    (loss and gradients at once), its backward scales those gradients by
    the loss's cotangent; without gradients, the evaluation table."""
    evaluate = dataclasses.replace(
        train, table=table(place.pipeline, train.stages, train=False))
    dtypes = jax.tree.map(lambda w: w.dtype, (parts.outer, parts.blocks))
    storage = stage_layers.Storage(train.counts, train.stages)

    def metrics_of(out: Result) -> dict[str, Any]:
        prefix, head = out.head
        return whole(train.channel.fold, prefix, out.layers, head, storage)

    @jax.custom_vjp
    def pipelined(outer: Any, blocks: Any, histories: Any,
                  xs: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        run = shard_mapped(evaluate, mesh, place.rules)
        out = run(outer, blocks, histories, xs)
        return out.loss, metrics_of(out)

    def pipelined_fwd(outer: Any, blocks: Any, histories: Any,
                      xs: dict[str, jax.Array]) -> tuple[tuple, tuple]:
        run = shard_mapped(train, mesh, place.rules)
        out = run(outer, blocks, histories, xs)
        grads = (out.outer, out.grads)
        return (out.loss, metrics_of(out)), (grads, out.histories)

    def pipelined_bwd(res: tuple, cotangents: tuple) -> tuple:
        # The gradients the loop computed, times the loss's cotangent (the
        # metrics are not differentiable); the histories' "gradients" are
        # their updates (jaxscale/precision/fp8/state.py), as they are: the
        # blocks' and the head's.
        grads, new_histories = res
        g = cotangents[0]
        blocks = jax.tree.map(lambda _: False, parts.blocks)
        kept = (parts.outer_histories, blocks)
        grads = jax.tree.map(
            lambda d, dt, h: d if h else (d * g).astype(dt),
            grads, dtypes, kept)
        return (*grads, new_histories, None)

    pipelined.defvjp(pipelined_fwd, pipelined_bwd)
    return pipelined
