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
  dtype its matmul makes it (:func:`~jaxscale.analysis.flows.gradient_bytes`): ``precision.grads_reduce``
  where it is wider than the compute dtype (bf16 compute: fp32 sums with ``float32``, bf16 with ``bfloat16``); the
  ZeRO-1 re-gather moves the accumulator's dtype (``grads_reduce``); gathers of parameters move
  the compute copy's dtype (:func:`jaxscale.config.dtypes.resolve`: ``precision.params``, auto ``model.dtype``);
* the embedding table is not gathered: the partitioner looks rows up on the shards and
  moves the looked-up activations (all-to-all, b·s·h, forward and backward) and the token
  ids; each device's slice of the table's gradient is all-reduced over the replicas (HSDP) each
  microbatch; unless the table is small next to the activations (ZeRO-3 at long sequences: the
  partitioner keeps the way with the smaller largest buffer,
  :func:`~jaxscale.analysis.param_flows._gathers_table`): then the table is gathered once and its gradient
  reduce-scattered each microbatch; under TP a
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
  (:func:`~jaxscale.analysis.param_flows._pipeline_outer_flows`); no block moves between stages (stored in the
  chunks' order);
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

from collections.abc import Sequence

from jaxscale.analysis import muon_cost
from jaxscale.analysis.blocks import layers_run, moe_layers
from jaxscale.analysis.context_flows import context_flows
from jaxscale.analysis.flows import Flow, flow
from jaxscale.analysis.param_flows import param_flows
from jaxscale.analysis.params import Param, Step, dtype_bytes, pipeline_ticks, stack_layers
from jaxscale.config.read import ModelConfig, MoEConfig
from jaxscale.layout.rules import Layout
from jaxscale.layout.stage_plan import assumed

# The max/mean rows a device sends an expert shard in the dropless exchange, as the planner assumes it: a router
# balanced by its bias or auxiliary loss (measured per layer at run time: the moe load metrics).
EP_IMBALANCE = 1.25




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
        flows += param_flows(p, m, layout, step, bsh, gathered, stage_tensor, masked)

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
        flows += _sp_flows(m, layout, bsh, micro, runs, recompute, stage_remat, whole)
    elif tensor:
        flows += _tp_flows(layout, step, tensor, bsh, runs, recompute, stage_remat, whole, lookup_runs, head_runs)

    flows += context_flows(m, layout, rows * s_local, runs, stage_remat)
    flows += _stage_flows(m, params, layout, step, bsh, tuple(a for a in sp if a in stage_tensor))

    if m.moe is not None and layout.mesh_axes(("expert",)):
        moe_runs = layers * (moe_layers(m) + layers_run(m) - m.layers) / layers_run(m)
        # what the backward recomputes of a layer's forward runs its exchange again (full and save_dots keep no
        # routed rows; a pipeline's backward slot recomputes its chunk)
        again = stage_remat or m.remat not in ("none", "selective")
        flows += _expert_flows(m.moe, layout, bsh, micro * moe_runs, again, imbalance)
    if step.muon is not None:  # the moves to and from Muon's owner devices
        flows += muon_cost.flows(params, layout, step.muon)
    return flows


def _sp_flows(m: ModelConfig, layout: Layout, bsh: float, micro: int, runs: float, recompute: bool,
              stage_remat: bool, whole: bool) -> list[Flow]:
    """Sequence parallelism's gathers and scatters of the hidden states, ``runs`` a layer's activation
    collectives (in units of ``bsh``); with ``model.tp_overlap`` each is a ring of permutes hidden by its matmuls;
    ``whole``: the stage holds the final norm whole (no final gather)."""
    sp, flows = layout.sequence_axes, []

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
    return flows


def _tp_flows(layout: Layout, step: Step, tensor: Sequence[str], bsh: float, runs: float, recompute: bool,
              stage_remat: bool, whole: bool, lookup_runs: float, head_runs: float) -> list[Flow]:
    """Megatron TP's all-reduces of the hidden states over ``tensor``: the blocks' (``runs`` a layer's activation
    collectives, in units of ``bsh``), the vocabulary-parallel lookup's and the head's input gradient's, unless
    the stage holds them ``whole``."""
    flows = flow("TP: attention and MLP out", "all-reduce", tensor, bsh, 2 * runs, layout, "forward", False)
    flows += flow("TP: q, k, v, gate, up input gradients", "all-reduce", tensor, bsh, 5 * runs, layout,
                  "backward", False)
    # The recomputed stage forward all-reduces twice a layer; a recomputed layer, up to its attention output.
    flows += flow("TP: recomputed forward", "all-reduce", tensor, bsh, (2 * stage_remat + recompute) * runs,
                  layout, "backward", False)
    size = bsh / step.pipeline_microbatches if layout.pipelined else bsh
    if not whole:
        flows += flow("TP: vocabulary-parallel lookup", "all-reduce", tensor, size, lookup_runs, layout,
                      "forward", False)
        flows += flow("TP: head input gradient", "all-reduce", tensor, size, head_runs, layout, "backward", False)
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
