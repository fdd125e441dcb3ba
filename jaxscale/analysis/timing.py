"""The analytic model's time: a cluster's devices and networks, and the seconds of a step on them.

Every term is a measured rate (a cluster file of ``configs/clusters/``, written by hand from
published figures or by ``jaxscale plan --calibrate``, :mod:`jaxscale.analysis.calibrate`):

* **matmuls** (:func:`matmul_seconds`): each of a layer's projections and the output head at
  the shape one device runs (tokens of one microbatch x the weight's dimensions divided by
  the axes that shard it), forward once and backward twice, at ``peak_flops`` times the
  efficiency the cluster's ``matmul_efficiency`` table gives for a cube of as many FLOPs
  (side (M·N·K)^(1/3); interpolated in log2, clamped at the ends);
* **attention** (causal scores and values): a fused kernel (``cudnn``, ``blockwise``, ``ring``)
  at the ``attention_efficiency`` of the sequence block a device holds (``s / context``);
  XLA's ``dot`` attention computes the whole s x s scores (twice the causal FLOPs) as batched
  matmuls, at the ``matmul_efficiency`` of a layer's batch of them, and writes and reads its
  scores at the memory bandwidth;
* **memory-bound work** at ``memory_bandwidth``: norms, residual adds, RoPE and SwiGLU's
  elementwise product (forward, backward twice), the cross-entropy's logits, the weights'
  cast to the compute dtype, the gradient accumulator and the optimizer update; under
  ``model.tp_overlap`` the collective matmuls' slot copies, slices and ring accumulators
  (:func:`collective_matmul_elements`), whose matmuls run one per ring step on 1/t of the tokens;
* **recomputation**: ``save_dots`` redoes the memory-bound forward (``offload_dots`` too, plus the
  transfers to and from host memory its compute does not hide: :mod:`jaxscale.analysis.host_link`),
  ``full`` the whole layer forward, the pipeline's stage recompute the whole stage forward, the chunked loss
  (``model.loss_chunk``) the head's forward;
* **collectives** (:func:`collective_seconds`): per run a latency (``latency_intra`` /
  ``latency_inter`` per step of a log2 tree, twice for an all-reduce; one step for a
  permute) plus wire bytes over the bandwidth of the slowest link the group crosses (within
  a node / ICI, across nodes / DCN; across nodes a ring all-gather, reduce-scatter or
  all-reduce brings each node's share in once over the NICs of all the group's devices in
  the node, :func:`collective_seconds`); measured per collective kind where the cluster file
  has a ``collectives`` table. Weight all-gathers are costed in the compute dtype (the
  master shard is cast before it is gathered);
* **overlap**, as XLA's latency-hiding scheduler places it: a flow marked ``overlap``
  (ZeRO-3 gathers of the next layer, gradient reductions, the CP ring, TP collective
  matmuls under ``model.tp_overlap``) hides behind the compute of its phase (forward or
  backward), per link level, except its first run in each microbatch, which has nothing
  to hide behind; TP/SP, EP, PP and the post-update gathers are on the critical path.
  Hidden is not free on a GPU: NCCL's kernels take SMs from the matmuls they overlap, so
  ``overlap_cost`` of the hidden time is added (``contention``; 0 on TPUs, whose DMA
  engines move the data);
* the pipeline bubble (:func:`pipeline_loop`): the loop's ticks, each as long as its busiest
  stage's forward and backward slots (the backward recomputes its chunk; the head on the last
  stage, the embedding's gradient on the first), less the work they hold; where a stage has
  partitioner axes every slot is computed every tick, so the bubble is masked compute; elsewhere TP's
  collectives, counted on the busy slots, stretch by the loop's ticks against its work as compute does.

:func:`step_time` returns the parts, the exposed seconds by kind (``exposed.<kind>``) and
the MFU; :func:`load_cluster` reads and checks a cluster file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.analysis import host_link, muon_cost
from jaxscale.analysis.blocks import attention, layers_run, moe_layers, projections, routed_per_token
from jaxscale.analysis.cluster import Cluster
from jaxscale.analysis.flows import Flow
from jaxscale.analysis.params import Param, Step, dtype_bytes, pipeline_table
from jaxscale.analysis.ring_imbalance import busiest
from jaxscale.config.flops import flops_per_token
from jaxscale.config.read import MESH_AXES, ModelConfig
from jaxscale.layout.rules import Layout
from jaxscale.layout.stage_plan import assumed
from jaxscale.parallel import schedules
from jaxscale.parallel.schedules import FIRST, IDLE, LAST


def _strides(mesh: Mapping[str, int]) -> dict[str, int]:
    """Device-id stride of each mesh axis: devices are numbered along the mesh, ``tensor`` fastest."""
    stride_of = {}
    stride = 1
    for axis in reversed(MESH_AXES):
        stride_of[axis] = stride
        stride *= mesh[axis]
    return stride_of


def crosses_nodes(axes: Sequence[str], mesh: Mapping[str, int], devices_per_node: int) -> bool:
    """Whether a group over ``axes`` spans nodes: devices are numbered along the mesh, ``tensor`` fastest."""
    stride_of = _strides(mesh)
    return any(stride_of[a] * mesh[a] > devices_per_node for a in axes if mesh[a] > 1)


def members_per_node(axes: Sequence[str], mesh: Mapping[str, int], devices_per_node: int) -> int:
    """How many devices of one group over ``axes`` share a node (each with its own NIC)."""
    stride_of = _strides(mesh)
    inside = 1
    for a in axes:
        if mesh[a] > 1 and stride_of[a] < devices_per_node:
            inside *= min(mesh[a], devices_per_node // stride_of[a])
    return inside


# -- compute -------------------------------------------------------------------------------


def ring_steps(m: ModelConfig, layout: Layout) -> int:
    """How many pieces a collective matmul (``model.tp_overlap``) cuts each SP projection into: the SP ways, or 1."""
    return layout.size(layout.sequence_axes) if m.tp_overlap and layout.sequence_axes else 1


def _matmuls(m: ModelConfig, layout: Layout, tokens: float) -> list[tuple[float, float, float, float]]:
    """(count, M, N, K) of one layer's projections on one device for ``tokens`` tokens of a microbatch
    (:func:`jaxscale.analysis.blocks.projections`; MoE and dense MLPs averaged over the layers).

    Under collective matmuls each projection runs as one matmul per ring step, on 1/t of the tokens.
    """
    t_f, h = layout.ways(("mlp",)), m.embed
    r = ring_steps(m, layout)
    out = [(c * r, tokens / r, n / layout.ways((n_name,)), k / layout.ways((k_name,)))
           for c, n, n_name, k, k_name in projections(m)]
    moe = m.moe
    if moe is None:
        return [*out, (2 * r, tokens / r, m.mlp / t_f, h), (r, tokens / r, h, m.mlp / t_f)]
    out += _routed_matmuls(m, layout, tokens)
    f, frac = moe.mlp or m.mlp, _moe_share(m)
    if moe.shared_experts:
        shared = moe.shared_experts * f
        out += [(2 * frac, tokens, shared / t_f, h), (frac, tokens, h, shared / t_f)]
    dense = 1 - frac
    return [*out, (2 * dense, tokens, m.mlp / t_f, h), (dense, tokens, h, m.mlp / t_f)]


def _moe_share(m: ModelConfig) -> float:
    """The share of the layers run that are MoE blocks (DeepSeek's prediction depths count as MoE blocks)."""
    return (moe_layers(m) + layers_run(m) - m.layers) / layers_run(m)


def _routed_matmuls(m: ModelConfig, layout: Layout, tokens: float) -> list[tuple[float, float, float, float]]:
    """(count, M, N, K) of one layer's routed experts (gate and up, down) on one device, averaged over the layers:
    the device's E/ep experts see ep·M·k/E tokens each; none for a dense model."""
    moe = m.moe
    if moe is None:
        return []
    ep, f, frac = layout.ways(("expert",)), moe.mlp or m.mlp, _moe_share(m)
    t_e = layout.ways(("expert_mlp",)) if layout.axes_of("expert_mlp") else layout.ways(("mlp",))
    routed = tokens * routed_per_token(m) / f * ep / moe.experts
    local = moe.experts / ep
    return [(2 * local * frac, routed, f / t_e, m.embed), (local * frac, routed, m.embed, f / t_e)]


def matmul_seconds(cluster: Cluster, count: float, mm: float, n: float, k: float) -> float:
    """Forward of ``count`` (M, N, K) matmuls: 2·M·N·K FLOPs each at the efficiency of a cube of their size."""
    return count * 2 * mm * n * k / (cluster.peak_flops * cluster.matmul_eff((mm * n * k) ** (1 / 3)))


def collective_matmul_elements(m: ModelConfig, layout: Layout) -> tuple[float, float]:
    """Elements per token a forward of the collective matmuls (``model.tp_overlap``) reads and writes in device
    memory beyond their matmuls: (per layer, for the output head), 0 without them.

    As :mod:`jaxscale.parallel.collective_matmul` writes them: an all-gather matmul (q, k, v; gate, up; the head
    under the plain loss) zero-fills its output and copies each step's partial product into its slot (a
    dynamic-update-slice: write, read, write of the output); a matmul reduce-scatter (attention out, MLP down)
    slices each step's rows off its input (read, write) and adds its partial sum to the ring's accumulator
    t − 1 times, an add XLA folds into the matmul (cuBLAS's C operand, beta = 1: one more read of a 1/t
    piece of b·s·h). The backward's transposes move as many again.
    """
    t = ring_steps(m, layout)
    if t == 1:
        return 0.0, 0.0
    t_q, t_kv, t_f = layout.ways(("heads",)), layout.ways(("kv_heads",)), layout.ways(("mlp",))
    gathered = (m.heads / t_q + 2 * m.kv_heads / t_kv) * m.head_dim + 2 * m.mlp / t_f
    scattered_in = m.heads * m.head_dim / t_q + m.mlp / t_f
    per_layer = 3 * gathered + 2 * scattered_in + 2 * (t - 1) / t * m.embed
    head = 0.0 if m.loss_chunk else 3 * m.vocab_size / layout.ways(("vocab",))
    return per_layer, head


def _memory_bound_bytes(m: ModelConfig, layout: Layout, token_layers: float) -> float:
    """Bytes the memory-bound forward moves on one device for ``token_layers`` tokens through a layer each. Per
    token and layer, in elements: 2 norms (read, write), 2 residual adds (2 reads, 1 write), RoPE on q and k
    (read, write), SwiGLU's silu·product (2 reads, 1 write)."""
    att, sp = attention(m), layout.size(layout.sequence_axes)
    elems = (10 * m.embed) / sp + 2 * (att.q / layout.ways(("heads",)) + att.k / layout.ways((att.kv_name,)))
    elems += 3 * (m.moe.mlp or m.mlp if m.moe else m.mlp) / layout.ways(("mlp",))
    return token_layers * elems * dtype_bytes(m.dtype)


def _compute(m: ModelConfig, params: Sequence[Param] | None, layout: Layout, step: Step,
             cluster: Cluster) -> dict[str, float]:
    """Seconds of the step's compute on one device: forward, backward and recomputation, by part."""
    cbytes = dtype_bytes(m.dtype)
    ways_tokens = layout.ways(("batch",)) * layout.ways(("length",))
    tokens = step.global_batch * step.seq_len / ways_tokens  # through this device's layers in a step
    passes = step.microbatches * (step.pipeline_microbatches if layout.pipelined else 1)
    micro = tokens / passes
    layers = layers_run(m) / layout.ways(("layers",))  # DeepSeek's prediction depths: one block each
    depths = layers_run(m) - m.layers  # ... and the head again, after a projection of [embedding; hidden]
    s_block = step.seq_len / layout.ring_size  # the keys a device's queries meet at once (Ulysses: all of them)
    t_v = layout.ways(("vocab",))

    fwd_mm = passes * layers * sum(matmul_seconds(cluster, *mm) for mm in _matmuls(m, layout, micro))
    r = 1 if m.loss_chunk else ring_steps(m, layout)  # the chunked loss runs the head outside the shard_map
    head = passes * matmul_seconds(cluster, r, micro / r, m.vocab_size / t_v, m.embed)
    head = head * (1 + depths) + passes * matmul_seconds(cluster, depths, micro, m.embed, 2 * m.embed)
    fused = m.attention in ("blockwise", "ring", "cudnn")
    fwd_attn = _attention_seconds(m, layout, step, cluster, fused, tokens, micro, layers)
    fwd_mem = _memory_bound_bytes(m, layout, tokens * layers)
    cm_layer, cm_head = collective_matmul_elements(m, layout)
    cm_layers = tokens * layers * cm_layer * cbytes  # forward; the backward's transposes as much again
    fwd_cm = cm_layers + tokens * cm_head * cbytes
    if not fused:  # s x s fp32 scores written and read 4 times
        fwd_mem += tokens * s_block * m.heads / layout.ways(("heads",)) * layers * 4 * 4
    logits = tokens * m.vocab_size / t_v * 20  # fp32 logits, log-sum-exp, softmax gradient; bf16 copy
    update, weights = _update_bytes(m, params, layout, step, passes) if params is not None else (0.0, 0.0)
    bw = cluster.memory_bandwidth
    newton_schulz = 0.0 if params is None or step.muon is None else muon_cost.seconds(
        params, layout, step.muon, lambda *mm: matmul_seconds(cluster, *mm))
    forward = fwd_mm + head + fwd_attn + (fwd_mem + fwd_cm + logits / 4 + weights) / bw
    backward = 2 * (fwd_mm + head) + 2.5 * fwd_attn + (2 * fwd_mem + fwd_cm + 3 * logits / 4 + weights) / bw
    # save_dots and save_named keep no routed expert's matmul (a grouped or batched one): the backward runs the
    # experts' forward again (their hidden for the down projection's gradient, their outputs for the gates')
    routed_mm = passes * layers * sum(matmul_seconds(cluster, *mm) for mm in _routed_matmuls(m, layout, micro))
    recompute = {"none": 0.0, "save_dots": fwd_mem / bw + routed_mm, "save_named": fwd_mem / bw + routed_mm,
                 "offload_dots": fwd_mem / bw + routed_mm,
                 "full": fwd_mm + fwd_attn + (fwd_mem + cm_layers) / bw}[m.remat]
    if m.remat == "offload_dots" and params is not None and cluster.host_bandwidth > 0:
        moved = host_link.offloaded_bytes(m, params, layout, step)
        recompute += host_link.exposed_seconds(moved, cluster.host_bandwidth, forward, backward)
    if layout.pipelined:  # the backward slot recomputes its chunk once; no layer remat inside a stage
        recompute = fwd_mm + fwd_attn + (fwd_mem + cm_layers) / bw
    if m.loss_chunk:  # the chunked loss recomputes each chunk's logits in its backward
        recompute += head
    pipeline = {}
    if layout.pipelined:  # one slot of the loop: a chunk (1/v of the stage) on one microbatch
        pipeline = _slot_seconds(passes * step.repeats, passes, fwd_mm, fwd_attn, head,
                                 (fwd_mem, cm_layers, weights, logits), bw)
    return {
        "forward": forward,
        "backward": backward + recompute,
        "recompute": recompute,
        "matmul": 3 * (fwd_mm + head),
        "attention": 3.5 * fwd_attn,
        "memory_bound": (3 * fwd_mem + 2 * fwd_cm + logits + 2 * weights) / bw,
        "optimizer": update / bw + newton_schulz,
        **pipeline,
    }


def _attention_seconds(m: ModelConfig, layout: Layout, step: Step, cluster: Cluster, fused: bool, tokens: float,
                       micro: float, layers: float) -> float:
    """Seconds of the forward's attention scores and values on one device (causal: half of QK and PV): a ``fused``
    kernel at the cluster's attention efficiency, or the whole square, a microbatch's heads batched, at the
    efficiency of a matmul cube of as many FLOPs."""
    s_block = step.seq_len / layout.ways(("length",))
    t_q, att = layout.ways(("heads",)), attention(m)
    attn_flops = 2 * tokens * step.seq_len * m.heads / t_q * att.score_dim * layers  # causal: half of QK and PV
    ring = layout.ring_size if m.attention == "ring" else 1  # packed documents: each hop waits for the busiest
    attn_flops *= busiest(step.documents, ring, step.ring_balance)
    if fused:
        return attn_flops / (cluster.peak_flops * cluster.attention_eff(s_block))
    side = (micro * s_block * m.heads / t_q * att.score_dim) ** (1 / 3)
    return 2 * attn_flops / (cluster.peak_flops * cluster.matmul_eff(side))


def _update_bytes(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, passes: float
                  ) -> tuple[float, float]:
    """Bytes one device moves a step for the optimizer's update (master and moments read and written, the
    gradient read, the accumulator) and for casting its layers' weights to the compute copy each pass (two
    copies only)."""
    names = step.dtypes(m)
    pbytes, cbytes = dtype_bytes(names.master), dtype_bytes(m.dtype)
    opt = sum(p.size / layout.ways(p.axes, "optimizer") for p in params)
    grads = sum(p.size / layout.ways(p.axes, "gradients") for p in params)
    held = sum(p.size / layout.ways(p.axes) for p in params if p.in_layers)  # cast before any gather
    moments = muon_cost.optimizer_state(params, layout, step.muon, 4)  # Adam's two, Muon's one (fp32)
    update = opt * (2 * pbytes + pbytes + cbytes) + 2 * moments  # master and moments read+write, gradient read
    update += grads * 2 * pbytes * max(0, step.microbatches - 1)  # the accumulator
    weights = passes * held * (pbytes + cbytes) if names.two_copies else 0.0
    return update, weights


def _slot_seconds(chunks: float, passes: float, fwd_mm: float, fwd_attn: float, head: float,
                  memory: tuple[float, float, float, float], bw: float) -> dict[str, float]:
    """One slot of a pipeline's loop, a chunk (1/v of the stage) on one microbatch, of ``chunks`` a step: its
    forward, its backward (recomputing its forward), the last stage's head and the first's embedding gradient;
    ``memory``: the forward's memory-bound, collective matmul, weight-cast and logits bytes."""
    fwd_mem, cm_layers, weights, logits = memory
    return {
        "chunk_forward": (fwd_mm + fwd_attn + (fwd_mem + cm_layers + weights) / bw) / chunks,
        "chunk_backward": (3 * fwd_mm + 3.5 * fwd_attn + (3 * fwd_mem + 2 * cm_layers + weights) / bw) / chunks,
        "head": (3 * head + logits / bw) / passes,  # forward and backward, on the last stage
        "embedding_gradient": head / passes,  # the one-hot matmul, on the first stage
    }


def pipeline_loop(table: schedules.Table, comp: Mapping[str, float], masked: bool,
                  chunks: Sequence[int] | None = None) -> float:
    """Seconds of one pass of the pipeline loop (:mod:`jaxscale.parallel.schedules`): each tick as long as
    its busiest stage's slots.

    A forward slot runs a chunk forward, a backward slot recomputes it and runs its backward; the
    last virtual stage's backward runs the head and loss too, the first's the embedding gradient.
    A schedule that splits the backward (``Table.split``, ZB-H1) runs in its B slot the recompute and the input
    gradients, 2/3 of the backward, and in its W slot the weight matmuls' gradients alone, the other third
    (:mod:`jaxscale.parallel.weight_split`, :meth:`schedules.Table.cost`).
    ``masked`` (a stage with mesh axes left to the partitioner): every slot is computed every tick,
    the head and embedding branches on every stage in the ticks where one needs them. ``chunks``: the
    layers of each virtual stage where they differ (``comp``'s chunk is the average one): a slot skips
    its chunk's unused layer slots, or computes them all (as many as the largest chunk's) when masked.
    """
    f, b, head, embed = (comp[k] for k in ("chunk_forward", "chunk_backward", "head", "embedding_gradient"))
    fk, bk, wk = table.f_kind, table.b_kind, table.w_kind
    b, w = (2 * b / 3, b / 3) if table.split else (b, 0.0)
    sizes = np.asarray(chunks if chunks is not None else [1] * (table.p * table.v), float)
    sizes /= sizes.mean()
    if masked:
        top = sizes.max()
        return float((top * (f + b + w) + head * (bk == LAST).any(axis=1) + embed * (bk == FIRST).any(axis=1)).sum())
    stage = np.arange(table.p)
    f_size, b_size, w_size = (sizes[np.maximum(chunk, 0) * table.p + stage]
                              for chunk in (table.f_chunk, table.b_chunk, table.w_chunk))
    busy = f * f_size * (fk > IDLE) + b * b_size * (bk > IDLE) + head * (bk == LAST) + embed * (bk == FIRST)
    busy += w * w_size * (wk > IDLE)
    return float(busy.max(axis=1).sum())


# -- communication -------------------------------------------------------------------------


def flow_kind(f: Flow) -> str:
    """What a collective is for, as the reasons name it: TP, CP, PP, EP, FSDP gather, gradients, ZeRO gather."""
    for prefix, name in (("TP", "TP"), ("SP", "TP"), ("CP", "CP"), ("PP", "PP"), ("EP", "EP")):
        if f.what.startswith(prefix):
            return name
    if f.what.startswith("embedding lookup"):
        return "embedding"
    if f.phase == "update":
        return "ZeRO gather"
    if "gradient" in f.what:
        return "gradients"
    return "FSDP gather"


def collective_seconds(f: Flow, cluster: Cluster, inter: bool, per_node: int = 1) -> tuple[float, float]:
    """(seconds of all its runs, seconds of one run) of a flow at its link level.

    Across nodes, a ring all-gather, reduce-scatter or all-reduce over ``per_node`` devices of each of k
    nodes moves (k − 1)/k of the data into each node once, shared by the node's ``per_node`` NICs, while
    the rest of each device's wire bytes stay on NVLink / ICI: the slower of the two links sets the time
    (NCCL's rings enter and leave a node on a different NIC per channel). An all-to-all sends the part
    for other nodes through each device's own NIC; a permute crossing nodes sends all of it.
    """
    level = "inter" if inter else "intra"
    wire = f.wire_bytes / f.runs
    steps = 1 if f.kind == "collective-permute" else math.ceil(math.log2(f.n)) * (2 if f.kind == "all-reduce" else 1)
    measured = (cluster.collectives or {}).get(level, {}).get(f.kind)
    if measured:
        latency, bandwidth = measured
        one = latency * steps + wire / bandwidth
    elif not inter:
        one = cluster.latency_intra * steps + wire / cluster.intra_bandwidth
    else:
        g, n = per_node, f.n
        if f.kind in ("all-gather", "reduce-scatter", "all-reduce"):
            k = n / g
            nic = wire * ((k - 1) / k) / ((n - 1) / n) / g
        elif f.kind == "all-to-all":
            nic = wire * (n - g) / (n - 1)
        else:
            nic = wire
        one = cluster.latency_inter * steps + max(nic / cluster.inter_bandwidth,
                                                  (wire - nic) / cluster.intra_bandwidth)
    return one * f.runs, one


def step_time(
    m: ModelConfig, flows: Sequence[Flow], layout: Layout, step: Step, cluster: Cluster,
    params: Sequence[Param] | None = None,
) -> dict[str, float]:
    """Predicted seconds per step: compute by part, bubble, communication and what of it is exposed, by kind."""
    devices = math.prod(layout.mesh.values())
    tokens = step.global_batch * step.seq_len
    model_flops = flops_per_token(m, step.seq_len) * tokens
    comp = _compute(m, params, layout, step, cluster)
    compute = comp["forward"] + comp["backward"] + comp["optimizer"]
    bubble, stretch = 0.0, 1.0
    if layout.pipelined:  # the loop's ticks against the work they hold: idle or masked slots
        masked = not assumed(layout, m, [p.axes for p in params or () if p.in_layers]).skip
        loop = step.microbatches * pipeline_loop(pipeline_table(layout, step), comp, masked, step.layers_per_stage)
        bubble = max(0.0, loop - comp["forward"] - comp["backward"])
        if not masked and comp["forward"] + comp["backward"] > 0:
            # TP's collectives run in the busy slots (as counted): the bubble's ticks wait for them as for compute
            stretch = loop / (comp["forward"] + comp["backward"])
    exposed: dict[str, float] = {}
    hidden: dict[tuple[str, bool], list[tuple[str, float]]] = {}
    total_comm = 0.0
    for f in flows:
        inter = crosses_nodes(f.axes, layout.mesh, cluster.devices_per_node)
        kind = flow_kind(f)
        per_node = members_per_node(f.axes, layout.mesh, cluster.devices_per_node)
        seconds, one = collective_seconds(f, cluster, inter, per_node)
        total_comm += seconds
        if not f.overlap:
            exposed[kind] = exposed.get(kind, 0.0) + seconds * (stretch if kind == "TP" else 1.0)
            continue
        first = min(seconds, one * step.microbatches)  # the first of each microbatch has nothing to hide behind
        exposed[kind] = exposed.get(kind, 0.0) + first
        hidden.setdefault((f.phase, inter), []).append((kind, seconds - first))
    contention = 0.0
    for (phase, _), items in hidden.items():
        budget = comp["backward"] if phase == "backward" else comp["forward"]
        overlapped = sum(s for _, s in items)
        spill = overlapped - budget
        contention += cluster.overlap_cost * min(overlapped, budget)
        if spill > 0:  # shared out over the kinds in proportion to their time
            for kind, s in items:
                exposed[kind] = exposed.get(kind, 0.0) + spill * s / overlapped
    exposed_total = sum(exposed.values())
    total = compute + bubble + exposed_total + contention
    out = {
        "compute": compute,
        **{k: comp[k] for k in ("matmul", "attention", "memory_bound", "optimizer", "recompute")},
        "bubble": bubble,
        "contention": contention,
        "communication": total_comm,
        "exposed": exposed_total,
        **{f"exposed.{k}": v for k, v in sorted(exposed.items()) if v > 0},
        "total": total,
        "mfu": model_flops / devices / cluster.peak_flops / total,
        "tokens_per_sec": tokens / total,
    }
    return out
