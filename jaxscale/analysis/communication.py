"""The analytic model's communication: every collective of a train step, without compiling.

Communication (wire bytes per device per step, :func:`communication`), counted as
:mod:`jaxscale.analysis.hlo` counts the compiled step (:func:`jaxscale.analysis.hlo.wire_bytes`:
all-reduce 2·(n−1)/n·size, all-gather and reduce-scatter (n−1)/n of the whole, all-to-all
(n−1)/n, permute its size), one :class:`Flow` per collective the step runs:

* gradients: summed over the mesh axes that split the tokens but not the parameter: an
  all-reduce (DP), or a reduce-scatter onto the optimizer layout and an all-gather of the
  updated parameters (ZeRO-1/2): 2·(N−1)/N·Ψ·4; ZeRO-3 gathers every layer's parameters
  forward and again backward and reduce-scatters the gradients: 3·(N−1)/N·Ψ·4. jaxscale
  reduces the gradients of every microbatch (the accumulator lives in the gradient layout),
  so these run ``train.microbatches`` times a step, and ZeRO-1 re-gathers each microbatch's
  reduced gradient to accumulate it. Inside SP's shard_map a weight's gradient is summed over
  the replicas at its gathered size before it is scattered over ``fsdp``, and the gathered
  weight is kept for the backward (gathered again only under remat). A gradient is summed in the
  dtype its matmul makes it (:func:`gradient_bytes`): ``precision.grads_reduce`` where it is wider
  than the compute dtype (bf16 compute: fp32 sums with ``float32``, bf16 with ``bfloat16``); the
  ZeRO-1 re-gather moves the accumulator's dtype (``grads_reduce``); gathers of parameters move
  the compute copy's dtype (:func:`jaxscale.config.dtypes.resolve`: ``precision.params``, auto ``model.dtype``);
* the embedding table is not gathered: the partitioner looks rows up on the shards and
  moves the looked-up activations (all-to-all, b·s·h, forward and backward) and the token
  ids; each device's slice of the table's gradient is all-reduced over the replicas (HSDP) each
  microbatch; unless the table is small next to the activations (ZeRO-3 at long sequences: the
  partitioner keeps the way with the smaller largest buffer, :func:`_gathers_table`): then the
  table is gathered once and its gradient reduce-scattered each microbatch; under TP a
  vocabulary-parallel lookup all-reduces b·s·h, under SP the table itself is gathered over
  ``tensor`` and its gradient all-reduced (under ZeRO-1/2 too, unless a
  microbatch's looked-up activations are smaller than the table: then their gradients go
  to the slice's owners, all-to-all, as the compiled step does); the output head is gathered
  once forward under ZeRO-3 (and reused backward);
* TP (Megatron): per layer 2 all-reduces of b·s·h forward; backward XLA reduces the input
  gradient of each column-parallel projection separately (q, k, v, gate, up: 5 b·s·h where
  Megatron sums first: 2); SP: 2 all-gathers + 2 reduce-scatters of b·s·h each way; under
  remat the backward redoes the layer's collectives up to the attention output (TP: 1
  all-reduce; SP: 2 all-gathers, 1 reduce-scatter); with ``model.tp_overlap`` each SP
  collective is t−1 collective-permutes of b·s·h/t, counted as hidden by its matmuls;
* CP ring: 2·(c−1)·b·(s/c)·g·d_h per layer forward, as much backward plus the fp32 key and value
  gradients, which travel c hops (the last brings them home); inside a pipeline stage K and V are
  all-gathered instead (forward, and once more in the backward slot) and their fp32 gradients
  reduce-scattered (:mod:`jaxscale.parallel.ring_attention`); CP Ulysses over u devices: four all-to-alls
  of the device's q, k, v and output forward, four backward (kv heads fewer than u replicated first), USP
  both, the ring over the rest of c (:mod:`jaxscale.analysis.context_flows`); with CP a gradient is all-reduced over
  the context axes and then over the data axes (two all-reduces, as compiled); PP: a
  microbatch's b·s·h per loop tick (``Table.ticks`` of them, the bubble's included) each way; each
  stage's copy of the embedding, final norm and head gathered once, its fp32 gradient
  reduce-scattered over the stage's axes inside the conditionals that run the head and the
  embedding's gradient (m times a step; counted here as the compiled loop's T ticks, the runs
  :mod:`jaxscale.analysis.hlo` reads for an instruction in a loop) and summed over the stages once
  (:func:`_pipeline_outer_flows`); no block moves between stages (stored in the chunks' order);
  inside a stage the layers' collectives run on the busy slots where idle slots are skipped (the runs
  executed: ``hlo`` counts a tick's conditionals so, :func:`jaxscale.analysis.inspect.branch_runs`), in every
  slot of every tick where they are masked; where the stage is manual over TP's axes it holds the embedding
  and head whole: no vocabulary-parallel lookup or head collective (nor SP's final-norm gather); FSDP inside a
  stage (``pipeline.fsdp``): ``step`` gathers the stage's blocks once and reduce-scatters their gradients once,
  ``visit`` gathers each layer as a slot runs it (2·m times a step where idle slots are skipped) and
  reduce-scatters its fp32 gradient after its backward (m), ``tick`` gathers and scatters in every slot of
  every tick; EP: dispatch +
  combine all-to-all of
  k·b·s·h per MoE layer each way (docs/formulas.md), at the capacity factor, or for the dropless rows
  exchange times the routing imbalance :data:`EP_IMBALANCE` (dropless by all-gather: ``ep·b·s·h`` gathered
  and reduce-scattered, :func:`_expert_flows`); DeepSeek's prediction depths as MoE layers more.

Checked on XLA:CPU in fp32 (tests/test_analytic.py): CPU runs bf16 matmuls in f32, so its
activation collectives are f32 and do not compare. The embedding lookup's
traffic is what the partitioner chose in the tested layouts; it varies with the layout
(with accumulation under HSDP x SP it gathers and permutes instead), a few % of a large
model's traffic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxscale.analysis.blocks import layers_run, moe_layers
from jaxscale.analysis.context_flows import context_flows
from jaxscale.analysis.flows import Flow, flow
from jaxscale.analysis.params import Param, Split, Step, dtype_bytes, pipeline_ticks, split, stack_layers
from jaxscale.config.read import ModelConfig, MoEConfig
from jaxscale.layout.rules import Layout
from jaxscale.layout.stage_plan import assumed

# The max/mean rows a device sends an expert shard in the dropless exchange, as the planner assumes it: a router
# balanced by its bias or auxiliary loss (measured per layer at run time: the moe load metrics).
EP_IMBALANCE = 1.25


def _gradient_all_reduce(what: str, axes: Sequence[str], size: float, runs: float, layout: Layout) -> list[Flow]:
    """A gradient summed over ``axes``: XLA reduces over the context axes first, then over the rest.

    The partial sums over the sequence (context parallelism) and over the batch are two
    all-reduces of the whole gradient, not one over their product (seen in the compiled step).
    """
    context = [a for a in axes if a in layout.context_axes]
    rest = [a for a in axes if a not in context]
    flows = flow(what, "all-reduce", context, size, runs, layout, "backward", True)
    return flows + flow(what, "all-reduce", rest, size, runs, layout, "backward", True)


def gradient_bytes(m: ModelConfig, step: Step) -> int:
    """Bytes of a gradient element as devices sum it: the weight-gradient matmul's output dtype, the wider of
    ``model.dtype`` and ``precision.grads_reduce`` (:attr:`jaxscale.config.dtypes.Dtypes.grad_bytes`)."""
    return step.dtypes(m).grad_bytes


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
        return out + _gradient_all_reduce("embedding gradient", sp.reduced, grad / layout.size(sp.gathered), micro,
                                          layout)
    if sp.scattered:
        out += flow(lookup + " (for the gradient)", "all-to-all", sp.scattered, bsh, micro, layout, "backward", True)
    shard = grad / layout.size(sp.scattered)
    return out + _gradient_all_reduce("embedding gradient", sp.reduced, shard, micro, layout)


def _param_flows(p: Param, m: ModelConfig, layout: Layout, step: Step, bsh: float,
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
        if in_sp and not visit:  # inside the shard_map: summed over the replicas whole, then scattered
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
            out += _gradient_all_reduce(p.path + " gradient", sp.reduced, held, runs, layout)
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
    return out + _gradient_all_reduce(p.path + " gradient", rows, shard / layout.size(sp.scattered), micro, layout)


def _stage_flows(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, bsh: float,
                 stage_sp: tuple[str, ...] = ()) -> list[Flow]:
    """The pipeline's stage boundaries each tick (the blocks are stored in the chunks' order: none move); with
    SP's axes manual in a stage (``stage_sp``) a message is the device's part of the sequence."""
    stages, micro, flows = layout.mesh_axes(("layers",)), step.microbatches, []
    if not stages:
        return []
    ticks = pipeline_ticks(layout, step)
    size = bsh / step.pipeline_microbatches / layout.size(stage_sp)
    for phase in ("forward", "backward"):
        flows += flow("PP: stage boundary", "collective-permute", stages, size, ticks * micro, layout, phase, False)
    return flows


def communication(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step,
                  imbalance: float = EP_IMBALANCE) -> list[Flow]:
    """Every collective of the step, as :class:`Flow`s (see the module docstring for what is counted);
    ``imbalance``: the dropless exchange's routing imbalance (a cluster file's ``ep_imbalance``)."""
    cbytes = dtype_bytes(m.dtype)
    rows = step.global_batch / layout.ways(("batch",)) / step.microbatches
    s_local = step.seq_len / layout.ways(("length",))
    bsh = rows * s_local * m.embed * cbytes  # one microbatch's hidden states on a device
    micro = step.microbatches
    # uneven stages: the slots, as masked ones run; DeepSeek's prediction depths: one block each
    layers = (stack_layers(m, step) + layers_run(m) - m.layers) / layout.ways(("layers",))
    flows: list[Flow] = []
    stage = assumed(layout, m, [p.axes for p in params if p.in_layers])
    gathered = stage.gathered
    stage_tensor = stage.tensor if layout.pipelined else ()
    whole = bool(stage_tensor)  # the stage holds the embedding and head whole over its manual TP axes
    masked = not stage.skip
    for p in params:
        flows += _param_flows(p, m, layout, step, bsh, gathered, stage_tensor, masked)

    tensor = [a for a in layout.mesh_axes(("heads",)) if a not in layout.token_axes]
    sp = layout.sequence_axes
    runs = micro * layers  # a layer's activation collectives, in units of bsh
    recompute = m.remat != "none"  # the backward recomputes the layer up to its last collective
    head_runs = lookup_runs = micro  # the head's input gradient, the vocabulary-parallel lookup
    stage_remat = False  # the backward slot recomputes its chunk's forward (pipeline)
    if layout.pipelined:
        # Each busy slot runs a microbatch (bsh / m) through 1/v of the stage's layers, and where a stage has
        # partitioner axes every slot of every tick does (the bubble's computed and masked); the backward slot
        # recomputes its chunk whole (no layer remat inside a stage), and embeds again on the first
        # virtual stage; the head runs in the backward slot.
        ticks = pipeline_ticks(layout, step)
        if masked:
            runs *= ticks / (step.pipeline_microbatches * step.repeats)
        head_runs, lookup_runs = ticks * micro, 2 * ticks * micro
        stage_remat, recompute = True, False
    if sp:
        def sp_flow(what: str, kind: str, count: float, phase: str) -> list[Flow]:
            if not m.tp_overlap:
                return flow(what, kind, sp, bsh, count, layout, phase, False)
            # Collective matmul: t − 1 permutes of one chunk per all-gather / reduce-scatter, hidden by its matmuls.
            t = layout.size(tuple(sp))
            return flow(what, "collective-permute", sp, bsh / t, (t - 1) * count, layout, phase, True)

        for phase in ("forward", "backward"):
            flows += sp_flow("SP: norm output", "all-gather", 2 * runs, phase)
            flows += sp_flow("SP: block output", "reduce-scatter", 2 * runs, phase)
        if recompute:
            flows += sp_flow("SP: recomputed norm outputs", "all-gather", 2 * runs, "backward")
            flows += sp_flow("SP: recomputed attention output", "reduce-scatter", runs, "backward")
        if stage_remat:  # the backward slot's recomputed chunk: each layer's two gathers and two scatters again
            flows += sp_flow("SP: recomputed stage forward", "all-gather", 2 * runs, "backward")
            flows += sp_flow("SP: recomputed stage forward", "reduce-scatter", 2 * runs, "backward")
        if not whole:
            flows += sp_flow("SP: final norm output", "all-gather", micro, "forward")
            flows += sp_flow("SP: final norm output", "reduce-scatter", micro, "backward")
    elif tensor:
        flows += flow("TP: attention and MLP out", "all-reduce", tensor, bsh, 2 * runs, layout, "forward", False)
        flows += flow("TP: q, k, v, gate, up input gradients", "all-reduce", tensor, bsh, 5 * runs, layout,
                       "backward", False)
        # The recomputed stage forward all-reduces twice a layer; a recomputed layer, up to its attention output.
        flows += flow("TP: recomputed forward", "all-reduce", tensor, bsh, (2 * stage_remat + recompute) * runs,
                       layout, "backward", False)
        size = bsh / step.pipeline_microbatches if layout.pipelined else bsh
        if not whole:
            flows += flow("TP: vocabulary-parallel lookup", "all-reduce", tensor, size, lookup_runs, layout,
                           "forward", False)
            flows += flow("TP: head input gradient", "all-reduce", tensor, size, head_runs, layout, "backward",
                           False)

    flows += context_flows(m, layout, rows * s_local, runs, stage_remat)
    flows += _stage_flows(m, params, layout, step, bsh, tuple(a for a in sp if a in stage_tensor))

    if m.moe is not None and layout.mesh_axes(("expert",)):
        moe_runs = layers * (moe_layers(m) + layers_run(m) - m.layers) / layers_run(m)
        # what the backward recomputes of a layer's forward runs its exchange again (full and save_dots keep no
        # routed rows; a pipeline's backward slot recomputes its chunk)
        again = stage_remat or m.remat not in ("none", "selective")
        flows += _expert_flows(m.moe, layout, bsh, micro * moe_runs, again, imbalance)
    return flows


def _expert_flows(moe: MoEConfig, layout: Layout, bsh: float, runs: float, recomputed: bool = False,
                  imbalance: float = EP_IMBALANCE) -> list[Flow]:
    """Expert parallelism's traffic, ``runs`` MoE layers a step (:mod:`jaxscale.parallel.expert`), each way:
    capacity dispatch, an all-to-all there and back of the buffers, ``k·b·s·h`` at the capacity factor; the
    dropless rows exchange (:mod:`jaxscale.parallel.exchange`), the routed rows, ``k·b·s·h`` times the routing
    ``imbalance`` (the compiled step's trips are the routing's at run time); the dropless all-gather path, the EP
    group's tokens gathered and the outputs reduce-scattered, ``ep·b·s·h`` each. ``recomputed``: the backward runs
    the forward's exchange again (all-gather path: its gather), as lowered under full and save_dots remat."""
    experts = layout.mesh_axes(("expert",))
    if moe.dispatch == "dropless" and moe.dropless_exchange != "rows":
        ep = layout.size(experts)
        flows: list[Flow] = []
        for phase in ("forward", "backward"):
            flows += flow("EP: tokens gathered", "all-gather", experts, ep * bsh, runs, layout, phase, False)
            flows += flow("EP: outputs scattered", "reduce-scatter", experts, ep * bsh, runs, layout, phase, False)
        return flows + flow("EP: tokens gathered again (recomputed)", "all-gather", experts, ep * bsh,
                            runs * recomputed, layout, "backward", False)
    factor = moe.capacity_factor if moe.dispatch == "capacity" else imbalance
    routed = moe.top_k * bsh * factor
    flows = [f for phase in ("forward", "backward") for f in
             flow("EP: dispatch and combine", "all-to-all", experts, routed, 2 * runs, layout, phase, False)]
    return flows + flow("EP: dispatch and combine (recomputed)", "all-to-all", experts, routed, 2 * runs * recomputed,
                        layout, "backward", False)


def summarize_flows(flows: Sequence[Flow]) -> dict[str, Any]:
    """Wire bytes per device per step: total, by kind and by mesh axes (as :func:`jaxscale.analysis.hlo.summarize`)."""
    by_kind: dict[str, float] = {}
    by_axes: dict[str, float] = {}
    for f in flows:
        by_kind[f.kind] = by_kind.get(f.kind, 0.0) + f.wire_bytes
        key = ",".join(f.axes)
        by_axes[key] = by_axes.get(key, 0.0) + f.wire_bytes
    return {"total": sum(f.wire_bytes for f in flows), "by_kind": by_kind, "by_axes": by_axes}
