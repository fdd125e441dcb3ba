"""The analytic model's memory: bytes per device of a train step, by part, without compiling.

Memory (bytes per device, :func:`memory`), by the mixed-precision policy
(:mod:`jaxscale.precision.policy`; docs/formulas.md "Model state"), each part divided by the mesh axes
its layout shards it over (TP, PP and EP split; ZeRO-1/2/3 add the data-parallel axes to the
optimizer state, gradients and parameters in turn):

* the compute copy (``params``) in its dtype, laid out by the parameter rules; the master
  (``master``, fp32) and Adam's moments (``optimizer``, 8Ψ in fp32) by the optimizer's; with
  one copy (fp32 training) the parameters are the master and ``master`` is 0; the gradients
  in the compute copy's dtype; with gradient accumulation one more gradient-sized
  accumulator (``precision.grads_reduce``, fp32), which compiles in the optimizer's layout
  (XLA shards the loop's carry as the update after the loop reads it: ZeRO-1 too, where the
  gradients are whole), and under ZeRO-1 each microbatch's sum gathered whole to the
  gradients' layout before the carry keeps its shard (counted with ``gradients``);
* activations: the residuals every layer keeps for its backward (:func:`~jaxscale.analysis.activations.layer_residuals`,
  per token, by remat policy, in the dtypes and logical axes the model gives them: so TP,
  SP and CP divide exactly what they shard) times the layers this device holds; the
  scores mask of dot-product attention once (under PP one bool s x s); the batch;
* under PP (:mod:`jaxscale.parallel.pipeline`) a layer runs one pipeline microbatch at a time; the
  loop keeps the stage inputs its schedule has in flight (``Table.act_slots``; ZB-H1 also, from a B to its W,
  its layers' weight matmul inputs and output gradients, :func:`~jaxscale.analysis.activations.split_kept`,
  ``cot_slots``) and fp32 gradient
  accumulators as its carry, and each backward slot recomputes one chunk from its stashed input
  with no remat inside (:func:`_pipeline`);
* the transient peak: the larger of one layer's backward and the loss. The layer backward: its
  unreduced weight gradient and the larger of its MLP's peak (without remat the residuals copied
  out of the stack, :func:`~jaxscale.analysis.activations.sliced_backward`; under full recomputation its recomputed
  residuals,
  :func:`~jaxscale.analysis.activations.recomputed_backward`; both with the norms' recomputed pieces and SwiGLU's
  gradient buffers,
  the MLP's backward buffers of :mod:`~jaxscale.analysis.activations`) and its attention's (its residuals' cotangents,
  with blockwise or
  ring attention the kernel's score tiles, :func:`tile_buffers`, with ``dot`` the masked scores).
  The loss: the logits and their gradient in the compute dtype (of ``model.loss_chunk`` tokens per
  sequence when chunked; XLA fuses the fp32 upcast, exponentials and softmax into the reductions and the
  gradient), and the gathered head or SP's gathered embedding table (below);
* the output head gathered over the token axes (ZeRO-3) and its whole gradient; under SP the
  embedding table gathered whole (its shard_map looks rows up in the whole table) and its gradient,
  reduced whole (:mod:`jaxscale.analysis.communication`). The gradient is held through the layers'
  backward, the gathered table at the loss (as compiled on the test model: one vocab x embed buffer
  at the layer backward's peak);

Korthikanti et al.'s 34·s·b·h + 5·a·s²·b bytes per layer (:func:`jaxscale.analysis.formulas.korthikanti`)
count what jaxscale keeps around norms and the MLP (:mod:`jaxscale.ops.lean`: a norm's input
and statistics, SwiGLU's gate and up); jaxscale keeps in addition both the scores and the
probabilities of ``dot`` attention, or the kernel's output next to the output projection's
input under flash-style attention; without remat the weights cast to the compute dtype too. Under
SP the all-gathered norm output is saved whole (Megatron re-gathers it in the backward),
save_dots keeps the attention projection's partial sums whole (before the reduce-scatter),
and without remat the shard_map keeps its weight operands (gathered, under FSDP).

The layer's widths are the model's (:mod:`jaxscale.analysis.blocks`: grouped attention or MLA with its latents,
dense and MoE layers averaged); DeepSeek's prediction depths keep their blocks' residuals and weights
(:func:`_prediction_depths`) and their losses' logits; MoE layers keep the dropless rows and, under no remat, the
experts' shard_map its gathered weights; the dropless exchange's buffers are ep x the rows
(:func:`_exchange_buffers`).

Checked on XLA:CPU in fp32 (tests/test_analytic.py, tests/test_deepseek.py): CPU runs bf16 matmuls in f32, so its
bf16 buffers do not compare, and it expands dropless's grouped matmuls into a dense matmul per expert (E x the
rows' buffers), which GPUs and TPUs do not: not modelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxscale.analysis import muon_cost
from jaxscale.analysis.activations import (
    FLASH_ATTENTION,
    SCORES,
    TILED_ATTENTION,
    Activation,
    attention_accumulators,
    layer_residuals,
    recomputed_backward,
    saved_dots_backward,
    sliced_backward,
    split_kept,
)
from jaxscale.analysis.blocks import mlp_per_token, moe_layers
from jaxscale.analysis.params import Param, Step, dtype_bytes, layer_elems, pipeline_table, split, stack_layers
from jaxscale.config.axes import LOGITS, MLP_AXES, RESIDUAL
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import TOKENS, Layout
from jaxscale.layout.stage_plan import StagePlan, assumed


def attention_tile(m: ModelConfig, layout: Layout, seq_len: int) -> int:
    """The tokens per side of the score tile that blockwise and ring attention compute at once
    (:func:`jaxscale.parallel.ring_attention._plan`): ``model.attention_block``, or the ring's chunk
    (``s/2c`` on a causal ring of ``c`` devices, the whole sequence without one) when that is shorter."""
    ring = layout.ring_size if m.attention == "ring" else 1
    return min(m.attention_block, seq_len // (2 * ring) if ring > 1 else seq_len)


def tile_buffers(m: ModelConfig, layout: Layout, step: Step, rows: float) -> float:
    """Bytes per device of the score tiles blockwise and ring attention hold at once, at their peak: the
    backward of one tile (:func:`jaxscale.parallel.ring_attention._grad_tile`) of ``rows`` sequences
    (of the whole mesh), ``[rows, heads, tile, tile]`` each, all query heads (a kv head's group
    in one einsum), on the device's batch and head shards (TP splits heads, and Ulysses' all-to-alls; the ring
    splits neither, the tile is a chunk's).

    Four are live as the scores' gradient is written: the probabilities recomputed from the scores
    and the log-sum-exp (fp32; the scores' buffer is free by then), the probabilities' gradient
    (fp32, a matmul's output) and the scores' gradient in the two layouts the matmuls for ``dq`` and
    ``dk`` read (one fusion each, the cast to the compute dtype in it). The forward of a tile holds
    two at most (scores and masked scores, or scores and probabilities): never the larger. None for
    ``dot`` (its s x s buffers are residuals and the attention peak's gradient) and ``cudnn`` (its
    tiles stay on chip).
    """
    if m.attention not in TILED_ATTENTION:
        return 0.0
    tile = attention_tile(m, layout, step.seq_len)
    per_tile = rows * m.heads * tile * tile / layout.ways(("batch", "heads")) / layout.size(layout.ulysses_axes)
    return per_tile * (2 * 4 + 2 * dtype_bytes(m.dtype))


def _bytes_of(act: Activation, m: ModelConfig) -> int:
    return 4 if act.dtype == "fp32" else dtype_bytes(m.dtype)


def _per_device(act: Activation, rows: float, step: Step, m: ModelConfig, layout: Layout) -> float:
    """Bytes on one device of an activation of ``rows`` sequences (of the whole mesh) kept once."""
    return rows * step.seq_len * act.per_token * _bytes_of(act, m) / layout.ways(act.axes)


def _recomputed_peak(m: ModelConfig, layout: Layout, step: Step, rows: float, select: float = 0.0) -> float:
    """Bytes per device at the larger of :func:`~jaxscale.analysis.activations.recomputed_backward`'s peaks, the
    attention's with the
    kernel's score tiles (:func:`tile_buffers`) and ``select`` (dot attention's masked scores)."""
    mlp, attention = (sum(_per_device(r, rows, step, m, layout) for r in peak)
                      for peak in recomputed_backward(m, step.seq_len))
    return max(mlp, attention + tile_buffers(m, layout, step, rows) + select)


def _layers_here(m: ModelConfig, layout: Layout, step: Step) -> float:
    """Layers held on a device: of the padded stack with uneven pipeline stages."""
    return stack_layers(m, step) / layout.ways(("layers",))


def memory(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step) -> dict[str, float]:
    """Predicted bytes per device of the compiled step, by part; ``total`` is their sum."""
    compute, master = step.copies(m)
    pbytes, mbytes = dtype_bytes(compute), dtype_bytes(master)  # the compute copy (and gradients), the master
    cbytes, rbytes = dtype_bytes(m.dtype), dtype_bytes(step.reduce_dtype)
    grad_kind = "optimizer" if step.microbatches == 1 else "gradients"
    # ZeRO-1's accumulation: each microbatch's sum is gathered back to the (whole) gradients' layout
    regathered = sum(p.size / layout.ways(p.axes, "gradients") for p in params
                     if layout.ways(p.axes, "gradients") < layout.ways(p.axes, "optimizer"))

    def state(kind: str, nbytes: int) -> float:
        return sum(p.size / layout.ways(p.axes, kind) for p in params) * nbytes

    micro_rows = step.global_batch / step.microbatches  # sequences in one forward/backward, all devices
    pipelined = layout.pipelined
    rows = micro_rows / step.pipeline_microbatches if pipelined else micro_rows  # through a layer at once
    layers = _layers_here(m, layout, step)
    residuals = layer_residuals(m, m.remat, step.seq_len)
    per_layer = sum(_per_device(r, rows, step, m, layout) for r in residuals)
    kept_weights = _kept_weights(m, params, layout, step, compute)
    per_layer += kept_weights * cbytes
    depths = m.deepseek.mtp_depth if m.deepseek else 0
    # dot attention's causal mask: broadcast to the scores (bool) and, at the attention's peak, the select's fp32
    # output; recomputed under full remat, where the step keeps one bool s x s from an iota
    select = 0.0 if m.attention in FLASH_ATTENTION else _per_device(
        Activation("mask", m.heads * step.seq_len, SCORES, "fp32"), rows, step, m, layout)
    everything = _layer_peak(m, layout, step, rows, select)
    # the exchange's buffers: in the backward, and kept by every MoE layer where it keeps its routed rows (none,
    # selective; save_dots saves no grouped matmul, so autodiff recomputes the exchange) and by prediction depths
    exchange = _exchange_buffers(m, layout, step, rows)
    moe_here = layers * moe_layers(m) / m.layers * (m.remat in ("none", "selective")) + depths
    layer_backward = everything + kept_weights * cbytes + exchange
    layer_backward += layer_elems(params, layout, reduced=False) * pbytes
    loss, head, table = _loss(m, params, layout, step, micro_rows, pbytes)
    activations = layers * per_layer + _prediction_depths(m, params, layout, step, rows)
    activations += exchange * moe_here
    out = {
        "params": state("params", pbytes),
        "master": state("optimizer", mbytes) if compute != master else 0.0,
        "optimizer": muon_cost.optimizer_state(params, layout, step.muon, mbytes),  # Adam's two moments, Muon's one
        "gradients": state(grad_kind, pbytes) + (regathered * rbytes if step.microbatches > 1 else 0.0),
        "accumulator": state("optimizer", rbytes) if step.microbatches > 1 else 0.0,
        "pipeline accumulator": 0.0,
        "pipeline copies": 0.0,
        "activations": activations,
        "transient": max(layer_backward, loss),
        "embedding": table,
        "head": head,
        "batch": 3 * 4 * step.global_batch * step.seq_len / layout.ways(TOKENS),
    }
    if m.attention not in FLASH_ATTENTION:
        out["mask"] = float(step.seq_len**2) if m.remat == "full" else select / 4
    if pipelined:
        _pipeline(m, params, layout, step, rows, out)
    out["total"] = sum(out.values())
    return out


def _kept_weights(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, compute: str) -> float:
    """Elements of the weights a layer keeps for its backward without remat (copies, not the parameters
    themselves): SP's and the experts' shard_map operands, gathered, or the weights cast to ``compute``."""
    if m.remat != "none":
        return 0.0
    stack = stack_layers(m, step)
    kept_weights = 0.0
    if layout.sequence_axes:  # SP's shard_map keeps its (gathered) weight operands
        kept_weights = sum(split(p, layout, step, stack).unit for p in params if p.in_layers and p.in_sp_region)
    elif m.dtype != compute:  # the weights cast to the compute dtype
        kept_weights = layer_elems(params, layout, reduced=True)
    if m.moe is not None and m.moe.impl == "shard_map":
        # the experts' shard_map keeps its weight operands, gathered over the token axes
        kept_weights += sum(s.unit for s in (split(p, layout, step, stack) for p in params
                                              if p.in_layers and "expert" in p.axes) if s.gathered)
    return kept_weights


def _layer_peak(m: ModelConfig, layout: Layout, step: Step, rows: float, select: float) -> float:
    """Bytes per device of one layer's backward at its peak, before its kept weights, the exchange's buffers and
    its weights' gradients: the recomputed layer's peak under full remat; else its ``none`` residuals with the
    attention's tiles and the causal mask's ``select`` beside the cotangents (an upper bound of the attention's
    peak), or the MLP's peak where larger."""
    if m.remat == "full":
        return _recomputed_peak(m, layout, step, rows, select)
    everything = sum(_per_device(r, rows, step, m, layout) for r in layer_residuals(m, "none", step.seq_len))
    everything += tile_buffers(m, layout, step, rows) + select
    dots = saved_dots_backward(m, step.seq_len)  # offload_dots: a layer's outputs back on the device
    mlp = {"none": sliced_backward(m, step.seq_len), "save_dots": dots, "offload_dots": dots}
    if m.remat in mlp:
        everything = max(everything, sum(_per_device(r, rows, step, m, layout) for r in mlp[m.remat]))
    return everything


def _loss(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, micro_rows: float, pbytes: int
          ) -> tuple[float, float, float]:
    """Bytes per device at the loss (with the gathered tables below), the gathered head, the gathered table.

    The logits and their gradient in the compute dtype (of one chunk with ``model.loss_chunk``): the plain loss's
    forward and backward, compiled alone for compile-only devices (:mod:`jaxscale.analysis.target`), hold 2 x the
    compute dtype per logit on XLA:GPU (H100, 8192 tokens; 1 x at 4096 and below) and 1 x on libtpu (v5e); XLA:CPU
    1.6 fp32 buffers (``benchmarks/loss_memory.py``). The fp32 upcast, the exponentials and the softmax are fused,
    never whole. Each prediction depth's loss holds its logits' two fp32 residuals beside. One whole vocab x embed
    table: the output head gathered over the token axes (ZeRO-3), or under SP the embedding table gathered whole
    to look rows up. Its whole gradient is held through the layers' backward (its reduction overlaps them), the
    gathered copy at the loss only (as compiled at the layer backward's peak: one vocab x embed buffer, the
    gradient)."""
    stack = stack_layers(m, step)
    vocab = Activation("logits", m.vocab_size, LOGITS)
    loss = 2 * _per_device(vocab, micro_rows, step, m, layout)
    if m.loss_chunk:  # chunked cross-entropy (jaxscale/ops/loss.py): one chunk of logits at a time
        loss *= m.loss_chunk / step.seq_len
    depths = m.deepseek.mtp_depth if m.deepseek else 0
    loss += 2 * depths * _per_device(dataclasses.replace(vocab, dtype="fp32"), micro_rows, step, m, layout)
    sp = bool(layout.sequence_axes)
    heads = [p for p in params if not p.in_layers and "vocab" in p.axes and (not p.is_embedding or m.tie_embeddings)]
    head = 0.0 if sp else sum(s.whole for s in (split(p, layout, step, stack) for p in heads) if s.gathered) * pbytes
    table = sum(split(p, layout, step, stack).whole * layout.size(layout.mesh_axes(("vocab",)))
                for p in params if p.is_embedding) * pbytes if sp else 0.0
    return loss + head + table, head, table


def _exchange_buffers(m: ModelConfig, layout: Layout, step: Step, rows: float) -> float:
    """Bytes per device that one MoE layer's dropless rows exchange (:mod:`jaxscale.parallel.exchange`) holds
    beyond the routed rows :func:`~jaxscale.analysis.activations.layer_residuals` counts: its buffers are sized for
    the worst case (every choice
    to one shard), ``ep`` times the rows: the rows arriving, their SwiGLU's gate, up and hidden, their outputs.
    0 without expert parallelism or the exchange."""
    moe, ep = m.moe, layout.ways(("expert",))
    if moe is None or moe.dispatch != "dropless" or moe.dropless_exchange != "rows" or ep == 1:
        return 0.0
    per_token = (ep - 1) * moe.top_k * (2 * m.embed + 3 * (moe.mlp or m.mlp))
    return _per_device(Activation("exchange buffers", per_token, RESIDUAL), rows, step, m, layout)


def _prediction_depths(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, rows: float) -> float:
    """Bytes per device that DeepSeek's multi-token prediction depths keep for the backward (none without): each
    runs one MoE block outside the layer scan, so under no remat policy (its ``none`` residuals as a MoE layer's),
    with three norms more (their inputs, statistics and outputs), and keeps its weights as gathered over the token
    axes (ZeRO-3)."""
    if m.deepseek is None or not m.deepseek.mtp_depth:
        return 0.0
    moe_block = dataclasses.replace(m, layers=1, deepseek=dataclasses.replace(m.deepseek, dense_layers=0))
    kept = [*layer_residuals(moe_block, "none", step.seq_len), Activation("norms' inputs, outputs", 6 * m.embed,
            RESIDUAL), Activation("norms' statistics", 3, RESIDUAL[:2], "fp32")]
    residuals = sum(_per_device(r, rows, step, m, layout) for r in kept)
    stack = stack_layers(m, step)
    weights = sum(s.whole for s in (split(p, layout, step, stack) for p in params if p.path.startswith("mtp."))
                  if s.gathered)
    return m.deepseek.mtp_depth * residuals + weights * dtype_bytes(m.dtype)


def _top_layer_at_loss(m: ModelConfig) -> list[Activation]:
    """What the last stage's top layer holds at the loss in its backward slot beyond its ``none`` residuals,
    per token. Its recomputed forward is linearized: each of its two norms keeps its normalized input (fp32,
    2h); the final norm keeps its input (the layer's output), normalized input and output (3h); SwiGLU the
    gate's sigmoid and silu (2f; 5f in all); the residual stream's cotangent is zero-initialised (h); and
    blockwise and ring attention's backward accumulators
    (:func:`~jaxscale.analysis.activations.attention_accumulators`).

    As compiled (pp; seq_len 32, 512: these; at 2048 XLA:CPU's YNNPACK reductions also materialise each of
    the three norms' statistic and scale broadcast to the width, 6h more, not counted)."""
    h, fe = m.embed, mlp_per_token(m)
    held = [
        Activation("norms' normalized inputs", 2 * h, RESIDUAL, "fp32"),
        Activation("final norm's input, normalized input, output", 3 * h, RESIDUAL, "fp32"),
        Activation("gate's sigmoid and silu", 2 * fe, MLP_AXES, "fp32"),
        Activation("residual stream's zero cotangent", h, RESIDUAL),
    ]
    return held + attention_accumulators(m)


def stash(m: ModelConfig, layout: Layout, step: Step, rows: float | None = None) -> float:
    """A pipelined stage's stash: its chunk's layer inputs for each microbatch in flight (``Table.act_slots``),
    two buffers of each (``rows``: the sequences through a layer at once; default, a pipeline microbatch's)."""
    rows = step.global_batch / step.microbatches / step.pipeline_microbatches if rows is None else rows
    x = _per_device(Activation("stage input", m.embed, RESIDUAL), rows, step, m, layout)
    return 2 * pipeline_table(layout, step).act_slots * _layers_here(m, layout, step) / step.repeats * x


def _pipeline(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, rows: float,
              out: dict[str, float]) -> None:
    """A pipelined stage's activations, transient and loop state (:mod:`jaxscale.parallel.pipeline`), into ``out``.

    The loop keeps, for each microbatch in flight, the inputs of the chunk's L/(p·v) layers, and the
    gradients waiting for a backward (``Table.act_slots``, ``grad_slots``; XLA:CPU holds two buffers
    per slot across a tick, as compiled), and the backward slot's copy of its chunk's inputs; its
    accumulators and copies: :func:`_pipeline_state`. With FSDP inside a stage
    (:attr:`~jaxscale.layout.stage_plan.StagePlan.gathered`) and ``pipeline.fsdp=visit``, one layer gathered
    at a time and its fp32 gradient before the reduce-scatter are transient.
    ``model.remat`` is not applied inside a stage: the backward slot recomputes one layer
    at a time from its input and holds that layer's ``none`` residuals for one microbatch, with either
    the head's loss (the last layer of the last stage: three logits-sized buffers, the exponentials,
    the gradient and its transpose, and :func:`_top_layer_at_loss`) or the layer backward's gradient
    buffers (the larger of :func:`~jaxscale.analysis.activations.recomputed_backward`'s peaks, the attention's with
    blockwise or ring
    attention's score tiles, :func:`tile_buffers`), whichever is larger, and one layer's gathered
    weights or unreduced weight gradient.

    What XLA keeps of ``dot`` attention's s x s buffers there (the recomputed forward and the backward
    are one computation, so nothing is a saved residual): three fp32 of one microbatch's scores at
    once, counted as ``none``'s scores and probabilities and the attention peak's scores' gradient. In
    the forward, the softmax's exponentials (held to the backward, the division by their sum fused
    into the readers) and the probabilities in the two layouts that the value matmul and its
    transpose read; in the backward, the exponentials, the probabilities' gradient as its matmul
    writes it and transposed to the scores' layout. The causal mask is one bool s x s from an iota,
    fused into the select and its transpose: not the mask broadcast to the scores and the select's
    fp32 output that the layer scan keeps (:func:`memory`'s ``mask``). Where XLA:CPU puts the backward's
    division by the sum in the loop fusion that transposes the probabilities' gradient instead of in
    the softmax backward's YNNPACK fusion, a fourth fp32 score-sized buffer is live, not counted (the
    model is then low by one: 0.80 to 0.92 of compiled on the test model at seq_len 128 to 384). The
    shapes decide: with two sequences per device and microbatch the YNNPACK fusion takes it at
    seq_len 256 to 1024, not at 128 or 192; with one, at 512, not at 256 or 384; with four, at 192.
    """
    table = pipeline_table(layout, step)
    compute, _ = step.copies(m)
    pbytes = dtype_bytes(compute)
    x = _per_device(Activation("stage input", m.embed, RESIDUAL), rows, step, m, layout)
    none = sum(_per_device(r, rows, step, m, layout) for r in layer_residuals(m, "none", step.seq_len))
    cotangents = _recomputed_peak(m, layout, step, rows) - none
    chunk = _layers_here(m, layout, step) / step.repeats  # the largest chunk's: every stage keeps room for it
    logits = _per_device(Activation("logits", m.vocab_size, LOGITS), rows, step, m, layout)
    loss = logits * (dtype_bytes(m.dtype) + 8) / dtype_bytes(m.dtype)
    if m.loss_chunk:
        loss *= m.loss_chunk / step.seq_len
    loss += sum(_per_device(r, rows, step, m, layout) for r in _top_layer_at_loss(m))
    stage = assumed(layout, m, [p.axes for p in params if p.in_layers])
    # the backward slot copies its chunk's inputs out of the stash, held through the slot
    kept = sum(_per_device(a, rows, step, m, layout) for a in split_kept(m))  # a layer's, from its B to its W
    out["activations"] = (stash(m, layout, step, rows) + (2 * table.grad_slots + chunk) * x
                          + 2 * table.cot_slots * chunk * kept)
    gathered = stage.gathered
    visit = bool(gathered) and stage.visit
    layer = layer_elems(params, layout, reduced=False)
    out["transient"] = none + max(loss, cotangents) + layer * (pbytes + (4 if visit else 0))
    out.update(_pipeline_state(params, layout, stage, pbytes))
    out["head"] = out["embedding"] = 0.0  # the stage's own copies, gathered before the loop: counted above
    if m.attention not in FLASH_ATTENTION:  # the causal mask: one bool s x s, fused into the select and its transpose
        out["mask"] = float(step.seq_len**2)


def _pipeline_state(params: Sequence[Param], layout: Layout, stage: StagePlan, pbytes: int) -> dict[str, float]:
    """A pipelined stage's loop state beside the parameters: ``pipeline accumulator`` and ``pipeline copies``.

    The fp32 gradient accumulators of the stage's blocks (handed on as the gradients where the stage has no
    partitioner axes; kept beside them where it has) and of its own copy of the embedding, final norm and head,
    and that copy, gathered over the stage's axes (the blocks' storage is the chunks' order: no copy of them).
    With FSDP inside a stage over its plan's ``gathered`` axes the stage's blocks gathered whole over its FSDP axes
    once a step and their fp32 accumulator, whole too (``pipeline.fsdp=step``); or (``visit``) the accumulator on
    the shards.
    """
    gathered, visit = stage.gathered, bool(stage.gathered) and stage.visit
    held = sum(p.size / layout.ways(p.axes) for p in params)
    blocks = sum(p.size / layout.ways(p.axes) for p in params if p.in_layers)
    # the stage's copy of the embedding, final norm and head: whole over its manual TP axes too
    tensor = stage.tensor
    outer = sum(p.size / layout.size([a for a in layout.mesh_axes(p.axes) if a not in (*layout.token_axes, *tensor)])
                for p in params if not p.in_layers)
    # A stage with no partitioner axes hands its accumulator on as the gradients (one buffer, fp32,
    # the parameters' layout); with FSDP/TP inside a stage XLA keeps both.
    partitioned = stage.free
    # FSDP inside a stage, once a step: the stage's blocks gathered whole over its manual batch axes, their
    # fp32 gradients accumulated whole beside them and reduce-scattered after the loop.
    once = bool(gathered) and not visit
    whole = sum(p.size / layout.size([a for a in layout.mesh_axes(p.axes) if a not in gathered])
                for p in params if p.in_layers) if once else 0.0
    accumulator = 4 * whole + (4 * (held - blocks if once else held) if partitioned else 0.0)
    if tensor:  # its fp32 gradient accumulated whole over them too, beside the sharded gradients
        accumulator += 4 * (outer - (held - blocks))
    return {"pipeline accumulator": accumulator, "pipeline copies": (outer + whole) * pbytes}
