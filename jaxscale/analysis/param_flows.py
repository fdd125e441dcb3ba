"""The analytic model's traffic of each parameter: its gradient's reduction, ZeRO's gathers and scatters, the
embedding's lookup, a pipelined model's stage copies (the rules: :mod:`jaxscale.analysis.communication`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxscale.analysis.blocks import layers_run
from jaxscale.analysis.flows import Flow, flow, gradient_all_reduce, gradient_bytes
from jaxscale.analysis.params import Param, Split, Step, dtype_bytes, pipeline_ticks, split, stack_layers
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import Layout


def _gathers_table(table: float, bsh: float, ids: float, n: int) -> bool:
    """Whether XLA's partitioner gathers the table sharded over ``n`` devices to look rows up, rather than look
    them up on the shards and move the activations (all-to-all).

    It dry-runs each way of partitioning the lookup (``GatherPartitionMethodsOrderedByCost`` in XLA's
    gather_scatter_handler.cc) and keeps the one whose largest buffer is smallest, a buffer's cost being one
    instruction's result plus its operands (``SpmdPartitioner::MemoryCostInBytes``): on the shards, the lookup
    (the table's shard, every device's ids, ``bsh``) or the all-to-all (``bsh`` in and out); gathered, the
    all-gather (shard and table) or the lookup (table, the device's ids, ``bsh``). Ties keep the shards.
    """
    on_shards = max(table / n + n * ids + bsh, 2 * bsh)
    gathered = table + max(table / n, ids + bsh)
    return gathered < on_shards


def _embedding_flows(sp: Split, layout: Layout, step: Step, bsh: float, ids: float, pbytes: int, gbytes: int,
                     sp_axes: Sequence[str], vocab_axes: Sequence[str]) -> list[Flow]:
    """The lookup table: rows are looked up where they live, the activations move, or where the table is small
    next to them it is gathered (:func:`_gathers_table`; see the module docstring)."""
    micro = step.microbatches
    table, grad = sp.whole * pbytes, sp.whole * gbytes
    lookup = "embedding lookup: activations"
    out: list[Flow] = []
    if sp_axes:  # the table is gathered whole
        full, full_grad = table * layout.size(vocab_axes), grad * layout.size(vocab_axes)
        out += flow("embedding table", "all-gather", sp.gathered, table, 1, layout, "forward", False)
        out += flow("embedding table", "all-gather", vocab_axes, full, 1, layout, "forward", False)
        kind = "reduce-scatter" if sp.gathered else "all-reduce"
        if sp.scattered and bsh < full_grad:
            # ZeRO-1/2 hold a slice of the gradient: the partitioner sends the looked-up activations' gradients
            # to the slice's owners (smaller than the table) and reduces only that slice over the vocabulary.
            out += flow("embedding gradient", "all-reduce", vocab_axes, full_grad / layout.size(sp.scattered), 1,
                         layout, "backward", True)
            out += flow(lookup + " (for the gradient)", "all-to-all", sp.scattered, bsh, micro, layout, "backward",
                         True)
            return out + flow("embedding gradient", kind, sp.gathered + sp.reduced, full_grad, 1, layout, "backward",
                              True)
        # Else the whole table's gradient is reduced over every axis (ZeRO-1/2 then keep their slice of it).
        out += flow("embedding gradient", "all-reduce", vocab_axes, full_grad, 1, layout, "backward", True)
        return out + flow("embedding gradient", kind, sp.gathered + sp.scattered + sp.reduced, full_grad, 1, layout,
                          "backward", True)
    if sp.gathered and not sp.reduced and _gathers_table(table, bsh, ids, layout.size(sp.gathered)):
        # The table is gathered (once) and looked up locally; its whole gradient is reduce-scattered onto the
        # shards each microbatch (an all-reduce sliced to 1/n on XLA:CPU). Under HSDP (the table replicated over
        # axes that split the ids) the compiled step kept the all-to-all where this rule would gather: not modelled.
        out += flow("embedding table", "all-gather", sp.gathered, table, 1, layout, "forward", False)
        return out + flow("embedding gradient", "reduce-scatter", sp.gathered, grad, micro, layout, "backward", True)
    if sp.gathered:
        out += flow(lookup, "all-to-all", sp.gathered, bsh, micro, layout, "forward", False)
        out += flow(lookup, "all-to-all", sp.gathered, bsh, micro, layout, "backward", False)
        # Each device scatters its rows' gradients into its slice of the table: summed over the replicas (HSDP).
        return out + gradient_all_reduce("embedding gradient", sp.reduced, grad / layout.size(sp.gathered), micro,
                                          layout)
    if sp.scattered:
        out += flow(lookup + " (for the gradient)", "all-to-all", sp.scattered, bsh, micro, layout, "backward", True)
    shard = grad / layout.size(sp.scattered)
    return out + gradient_all_reduce("embedding gradient", sp.reduced, shard, micro, layout)


def param_flows(p: Param, m: ModelConfig, layout: Layout, step: Step, bsh: float,
                 stage_gathered: tuple[str, ...] = (), stage_tensor: tuple[str, ...] = (),
                 masked: bool = False) -> list[Flow]:
    """Gradient reduction, ZeRO gathers and the embedding's lookup traffic of one parameter; ``stage_gathered``:
    the axes over which a pipeline stage gathers its blocks itself
    (:attr:`~jaxscale.layout.stage_plan.StagePlan.gathered`), ``stage_tensor`` its manual TP axes
    (:attr:`~jaxscale.layout.stage_plan.StagePlan.tensor`); ``masked``: a stage computes its idle slots
    (not :attr:`~jaxscale.layout.stage_plan.StagePlan.skip`)."""
    pbytes, gbytes = dtype_bytes(step.dtypes(m).compute), gradient_bytes(m, step)  # gathers move the compute copy
    sp = split(p, layout, step, stack_layers(m, step))  # uneven stages: every slot, as masked slots run
    sp_axes = layout.sequence_axes
    out: list[Flow] = []
    if layout.pipelined and not p.in_layers:
        out += _pipeline_outer_flows(p, sp, layout, step, pbytes, bool(stage_gathered), stage_tensor)
    elif p.is_embedding:
        looked = bsh * (1 + layers_run(m) - m.layers)  # DeepSeek's prediction depths look up the tokens ahead too
        ids = looked / (m.embed * dtype_bytes(m.dtype)) * 4  # a microbatch's int32 token ids on a device
        out += _embedding_flows(sp, layout, step, looked, ids, pbytes, gbytes, sp_axes, layout.mesh_axes(("vocab",)))
    else:
        out += _layer_flows(p, m, layout, step, sp, pbytes, gbytes, stage_gathered, masked)
    return out + _update_flows(p, layout, step, sp, pbytes)


def _layer_flows(p: Param, m: ModelConfig, layout: Layout, step: Step, sp: Split, pbytes: int, gbytes: int,
                 stage_gathered: tuple[str, ...], masked: bool) -> list[Flow]:
    """A weight other than the embedding and (pipelined) the outer ones: ZeRO-3's gathers, forward and again
    backward, and its gradient's reduction, each microbatch, or as a pipeline stage gathers (``pipeline.fsdp``:
    once a step, each visit, each tick; ``stage_gathered``, ``masked`` as :func:`param_flows`)."""
    sp_axes = layout.sequence_axes
    out: list[Flow] = []
    unit, grad = sp.unit * pbytes, sp.unit * gbytes
    runs = step.microbatches * sp.count
    in_sp = bool(sp_axes) and p.in_sp_region
    fsdp_runs, regather = runs, 1  # gathers and scatters over the parameter's token axes; backward gathers
    manual = p.in_layers and layout.pipelined and bool(sp.gathered) and set(sp.gathered) <= set(stage_gathered)
    visit = manual and layout.pipeline is not None and layout.pipeline.fsdp == "visit"
    once = manual and not visit
    if visit:
        # Each layer gathered as a slot runs it: every microbatch visits each of the stage's layers once
        # forward and once backward (the backward's gather serving the recomputed forward and the vjp), or
        # with idle slots masked every slot of every tick; its fp32 gradient reduce-scattered after its backward.
        visits = pipeline_ticks(layout, step) / step.repeats if masked else step.pipeline_microbatches
        fsdp_runs, grad = runs * visits, sp.unit * 4
    elif once:
        # FSDP inside a stage: the stage's layers gathered once before the loop, their gradients
        # reduce-scattered once after it (the gathered weights serve every slot, forward and backward),
        # exposed: the loop waits for the gather, the scatter waits for the loop.
        fsdp_runs = runs
    elif p.in_layers and layout.pipelined:
        # Every tick each slot runs a chunk (1/v of the stage's layers), computed and masked when idle
        # (a stage with partitioner axes), gathering and scattering as it goes: the forward slot gathers
        # once, the backward slot once more (each layer's vjp keeps its gathered weights from its
        # recomputed forward to its backward, as compiled). Over the manual data axes the loop sums the
        # gradient and reduces it once, after the loop.
        fsdp_runs = runs * pipeline_ticks(layout, step) / step.repeats
        regather = 1
    if sp.gathered:
        # once a step, before the pipeline's loop: nothing to hide behind
        out += flow(p.path, "all-gather", sp.gathered, unit, fsdp_runs if p.in_layers else 1, layout, "forward",
                     not once)
        # SP's shard_map keeps it, and the experts' (model.moe.impl: shard_map), unless recomputed
        kept = in_sp or ("expert" in p.axes and m.moe is not None and m.moe.impl == "shard_map")
        if p.in_layers and not once and (visit or not kept or m.remat != "none"):
            out += flow(p.path, "all-gather", sp.gathered, unit, regather * fsdp_runs, layout, "backward", True)
    return out + _layer_gradient_flows(p, layout, sp, grad, runs, fsdp_runs, in_sp and not visit, once)


def _layer_gradient_flows(p: Param, layout: Layout, sp: Split, grad: float, runs: float, fsdp_runs: float,
                          in_sp: bool, once: bool) -> list[Flow]:
    """A weight's gradient (``grad`` bytes) reduced: over FSDP's axes ``fsdp_runs`` times, ZeRO-2's scattered
    and the replicas each microbatch (``runs``); ``in_sp``: inside SP's shard_map, summed whole over the replicas
    and then scattered; ``once``: a pipeline stage's FSDP, scattered once after the loop."""
    out: list[Flow] = []
    if in_sp:  # inside the shard_map: summed over the replicas whole, then scattered
        out += flow(p.path + " gradient", "all-reduce", sp.reduced, grad, runs, layout, "backward", True)
        out += flow(p.path + " gradient", "reduce-scatter", sp.scattered + sp.gathered, grad, runs, layout,
                     "backward", True)
    else:
        shard = grad / layout.size(sp.gathered)
        out += flow(p.path + " gradient", "reduce-scatter", sp.gathered, grad, fsdp_runs, layout, "backward",
                     not once)
        out += flow(p.path + " gradient", "reduce-scatter", sp.scattered, shard, runs, layout, "backward", True)
        # gathered once a step, the stage sums the whole gradient over the other row axes before FSDP's scatter
        held = (grad if once else shard) / layout.size(sp.scattered)
        out += gradient_all_reduce(p.path + " gradient", sp.reduced, held, runs, layout)
    return out


def _update_flows(p: Param, layout: Layout, step: Step, sp: Split, pbytes: int) -> list[Flow]:
    """The optimizer's side: ZeRO-1 re-gathers each microbatch's reduced gradient to accumulate it, and every
    ZeRO stage gathers the updated parameter over the token axes its optimizer state is split on."""
    out: list[Flow] = []
    updated = [a for a in layout.mesh_axes(p.axes, "optimizer") if a in layout.token_axes and a not in sp.held]
    shard_all = sp.whole / layout.size(sp.gathered) * pbytes
    if step.microbatches > 1 and not sp.scattered:  # ZeRO-1: each microbatch's sum is re-gathered to accumulate
        accumulator = sp.whole / layout.size(sp.gathered) * dtype_bytes(step.reduce_dtype)
        out += flow(p.path + " gradient", "all-gather", updated, accumulator, step.microbatches, layout, "update",
                     False)
    return out + flow(p.path + " (updated)", "all-gather", updated, shard_all, 1, layout, "update", False)


def _pipeline_outer_flows(p: Param, sp: Split, layout: Layout, step: Step, pbytes: int, manual: bool,
                          tensor: tuple[str, ...] = ()) -> list[Flow]:
    """The embedding, final norm and head of a pipelined model (:mod:`jaxscale.parallel.pipeline`).

    Each stage gets its own copy gathered over the stage's axes once (no lookup traffic); each
    microbatch's fp32 gradient is summed over them inside the conditional that runs the head or the
    embedding's gradient (counted T times, as the loop's trip count gives it): the embedding's
    one-hot matmul all-reduces the whole table, the head's vjp reduce-scatters onto its shards (as
    compiled); once a step the per-stage accumulators are summed over ``stage`` and then reduced
    over the data axes. Where the loop is manual over the stage's FSDP axes (``manual``) each device adds up
    its own rows' gradient and the sum over those axes runs once, after the loop: an all-reduce, and the
    stages' copies are then summed whole. A stage manual over TP's axes (``tensor``) holds its copy whole
    over them too (gathered over them once, on its FSDP shard); over SP's, each device holds its part of the
    sequence: the gradient is summed over them with the data axes.
    """
    micro = step.microbatches
    split = [a for a in sp.held if a in tensor]
    sp = dataclasses.replace(sp, whole=sp.whole * layout.size(split))
    whole, shard = sp.whole * pbytes, sp.whole / layout.size(sp.gathered) * 4
    ticks = pipeline_ticks(layout, step)
    out = flow(p.path + " (stage copy)", "all-gather", sp.gathered, whole, micro, layout, "forward", False)
    out += flow(p.path + " (stage copy)", "all-gather", split, whole / layout.size(sp.gathered), micro, layout,
                "forward", False)
    kind = "all-reduce" if p.is_embedding or manual else "reduce-scatter"
    runs = micro if manual else ticks * micro
    out += flow(p.path + " gradient", kind, sp.gathered, sp.whole * 4, runs, layout, "backward", True)
    out += flow("PP: " + p.path + " gradient summed over stages", "all-reduce", layout.mesh_axes(("layers",)),
                sp.whole * 4 if manual else shard, micro, layout, "backward", False)
    out += flow(p.path + " gradient", "reduce-scatter", sp.scattered, shard, micro, layout, "backward", True)
    rows = (*sp.reduced, *(a for a in layout.sequence_axes if a in tensor and a not in sp.reduced))
    return out + gradient_all_reduce(p.path + " gradient", rows, shard / layout.size(sp.scattered), micro, layout)
