"""The analytic model of a train step: memory, communication and time per device, without compiling.

FORMULAS.md's figures, counted for what jaxscale's step holds and moves. Everything is
derived from three things: the model's parameters with their logical axes (the same
annotations the model carries, read abstractly by :func:`param_table`), a rules table and
the mesh sizes (:class:`Placement`). So one code path predicts any layout the rules can
express (DP, ZeRO-1/2/3, TP, SP, CP, PP, EP and their products), and ``jaxscale inspect``
prints it next to what XLA compiled while ``jaxscale plan`` searches over it.

Memory (bytes per device, :func:`memory`), jaxscale's convention (fp32 master weights
are *the* parameters; FORMULAS.md "Model state"):

* parameters 4Ψ/ways, Adam moments 8Ψ/ways, gradients 4Ψ/ways (each divided by the mesh
  axes its layout shards it over: TP, PP and EP split; ZeRO-1/2/3 add the data-parallel
  axes to the optimizer state, gradients and parameters in turn); one more gradient-sized
  accumulator with gradient accumulation;
* activations: the residuals every layer keeps for its backward (:func:`layer_residuals`,
  per token, by remat policy, in the dtypes and logical axes the model gives them: so TP,
  SP and CP divide exactly what they shard) times the layers this device holds; the
  scores mask of dot-product attention once; the batch;
* under PP (:mod:`jaxscale.parallel.pipeline`) a layer runs one pipeline microbatch at a time; the
  loop keeps the microbatches' inputs and outputs, one stage input per tick (or, without
  ``pipeline.remat``, the stage's residuals per tick) and the stage weights' gradient as its carry,
  and the backward recomputes one tick's stage forward;
* the transient peak: the larger of one layer's backward (its residuals' cotangents and
  its unreduced weight gradient) and the loss (logits in the compute dtype and fp32, their
  exponentials and gradient; of ``model.loss_chunk`` tokens per sequence when chunked).

Korthikanti et al.'s 34·s·b·h + 5·a·s²·b bytes per layer (:func:`korthikanti`) count what
jaxscale keeps around norms and the MLP (:mod:`jaxscale.models.lean`: a norm's input and
statistics, SwiGLU's gate and up); jaxscale keeps in addition both the scores and the
probabilities of ``dot`` attention, or the kernel's output next to the output projection's
input under flash-style attention; without remat the weights cast to the compute dtype too. Under
SP the all-gathered norm output is saved whole (Megatron re-gathers it in the backward),
save_dots keeps the attention projection's partial sums whole (before the reduce-scatter),
and without remat the shard_map keeps its weight operands (gathered, under FSDP).

Communication (wire bytes per device per step, :func:`communication`), counted as
:mod:`jaxscale.inspect` counts the compiled step (all-reduce 2·(n−1)/n·size, all-gather
and reduce-scatter (n−1)/n of the whole, all-to-all (n−1)/n, permute its size), one
:class:`Flow` per collective the step runs:

* gradients: summed over the mesh axes that split the tokens but not the parameter: an
  all-reduce (DP), or a reduce-scatter onto the optimizer layout and an all-gather of the
  updated parameters (ZeRO-1/2): 2·(N−1)/N·Ψ·4; ZeRO-3 gathers every layer's parameters
  forward and again backward and reduce-scatters the gradients: 3·(N−1)/N·Ψ·4. jaxscale
  reduces the gradients of every microbatch (the accumulator lives in the gradient layout),
  so these run ``train.microbatches`` times a step, and ZeRO-1 re-gathers each microbatch's
  reduced gradient to accumulate it. Inside SP's shard_map a weight's gradient is summed over
  the replicas at its gathered size before it is scattered over ``fsdp``, and the gathered
  weight is kept for the backward (gathered again only under remat);
* the embedding table is not gathered: the partitioner looks rows up on the shards and
  moves the looked-up activations (all-to-all, b·s·h, forward and backward) and the token
  ids; under TP a vocabulary-parallel lookup all-reduces b·s·h, under SP the table itself
  is gathered over ``tensor`` and its gradient all-reduced; the output head is gathered
  once forward under ZeRO-3 (and reused backward);
* TP (Megatron): per layer 2 all-reduces of b·s·h forward; backward XLA reduces the input
  gradient of each column-parallel projection separately (q, k, v, gate, up: 5 b·s·h where
  Megatron sums first: 2); SP: 2 all-gathers + 2 reduce-scatters of b·s·h each way; under
  remat the backward redoes the layer's collectives up to the attention output (TP: 1
  all-reduce; SP: 2 all-gathers, 1 reduce-scatter); with ``model.tp_overlap`` each SP
  collective is t−1 collective-permutes of b·s·h/t, counted as hidden by its matmuls;
* CP ring: 2·(c−1)·b·(s/c)·g·d_h per layer forward, as much backward plus the fp32 key and value
  gradients, which travel c hops (the last brings them home); with CP a gradient is all-reduced over
  the context axes and then over the data axes (two all-reduces, as compiled); PP: a
  microbatch's b·s·h per loop tick (v·m + p − 1 of them, the bubble's included) each way, and the
  last stage's outputs all-reduced over the stages forward and their gradient backward (b·s·h
  each); EP: dispatch + combine all-to-all of
  k·b·s·h per MoE layer each way (FORMULAS.md).

Time (:func:`step_time`): model FLOPs (6Ψ + causal attention, :mod:`jaxscale.metrics`),
plus recomputation, at the cluster's stated efficiency, stretched by the pipeline bubble
(p−1)/(v·m+p−1); plus the communication that cannot hide: TP/SP, EP and ZeRO-1/2's
parameter gather are exposed, gradient reduction, ZeRO-3 gathers and the CP ring overlap
with compute up to the compute time. Each collective runs at the bandwidth of the slowest
link its group crosses (within a node or across nodes: the mesh puts ``tensor``
innermost).

Checked on XLA:CPU in fp32 (tests/test_analytic.py): CPU runs bf16 matmuls in f32, so its
bf16 buffers and activation collectives are f32 and do not compare. The embedding lookup's
traffic is what the partitioner chose in the tested layouts; it varies with the layout
(with accumulation under HSDP x SP it gathers and permutes instead), a few % of a large
model's traffic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jaxscale.config import MESH_AXES, Config, ConfigError, ModelConfig, parse_override, resolve_named

TOKEN_NAMES = ("batch", "length")
RESIDUAL = ("batch", "norm_length", "act_embed")
MATMUL_IN = ("batch", "length", "act_embed")
Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
SCORES = ("batch", "length", "heads")
MLP_AXES = ("batch", "length", "mlp")
LOGITS = ("batch", "length", "vocab")
REMAT_NAMES = {  # checkpoint_name in models/llama.py -> (elements per token, logical axes)
    "query": ("ad", Q_AXES),
    "key": ("gd", KV_AXES),
    "value": ("gd", KV_AXES),
    "attention": ("ad", Q_AXES),
    "attention_out": ("h", RESIDUAL),
    "mlp_hidden": ("f", MLP_AXES),
    "mlp_out": ("h", RESIDUAL),
}
FLASH_ATTENTION = ("blockwise", "ring", "cudnn")  # no s x s scores kept
# A layer's backward under full recomputation holds its recomputed residuals and their cotangents:
# 1.15x the residuals of a layer without remat, measured on XLA:CPU (1.0 without recomputation).
RECOMPUTE = {"full": 1.15}


def dtype_bytes(name: str) -> int:
    return np.dtype(name).itemsize


# -- parameters and placement ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter array: its path, global shape and logical axes."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_layers(self) -> bool:
        return "layers" in self.axes


def param_table(config: Config) -> list[Param]:
    """The model's parameters, abstractly (``nnx.eval_shape``: nothing is allocated, any size)."""
    import jax

    from jaxscale.sharding import is_axes
    from jaxscale.train import abstract_model

    _, shapes, axes = abstract_model(config)
    paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
    return [
        Param(jax.tree_util.keystr(path, simple=True, separator="."), tuple(leaf.shape), tuple(a))
        for (path, leaf), a in zip(paths, flat_axes, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A rules table (logical name -> mesh axes, per kind) on mesh sizes; names it lacks are replicated."""

    tables: Mapping[str, Mapping[str, tuple[str, ...]]]  # kind ("params", "optimizer", "gradients") -> table
    mesh: Mapping[str, int]

    @classmethod
    def from_rules(cls, rules: Any, mesh: Mapping[str, int]) -> Placement:
        """From a :class:`jaxscale.sharding.Rules` and mesh sizes."""
        kinds = ("params", "optimizer", "gradients")
        return cls({k: dict(rules.table(k)) for k in kinds}, dict(mesh))

    def mesh_axes(self, names: Iterable[str | None], kind: str = "params") -> tuple[str, ...]:
        """The mesh axes (of size > 1) that split an array with these logical names."""
        table = self.tables[kind]
        out: list[str] = []
        for name in names:
            for axis in table.get(name, ()) if name else ():
                if self.mesh[axis] > 1 and axis not in out:
                    out.append(axis)
        return tuple(out)

    def ways(self, names: Iterable[str | None], kind: str = "params") -> int:
        return math.prod(self.mesh[a] for a in self.mesh_axes(names, kind))

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.mesh[a] for a in axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the tokens (batch and sequence): each holds different data."""
        return self.mesh_axes(TOKEN_NAMES)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the sequence but not the batch: context parallelism."""
        batch = self.mesh_axes(("batch",))
        return tuple(a for a in self.mesh_axes(("length",)) if a not in batch)

    @property
    def pipelined(self) -> bool:
        """Whether the rules put ``layers`` on the ``stage`` axis (size > 1): the pipeline loop runs."""
        return "stage" in self.mesh_axes(("layers",))


# -- activations ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation kept for the backward: elements per token, logical axes, dtype ("fp32" or "compute")."""

    name: str
    per_token: int
    axes: tuple[str, ...]
    dtype: str = "compute"


def _moe(m: ModelConfig) -> Any:
    return getattr(m, "moe", None)


def _mlp_per_token(m: ModelConfig) -> int:
    """SwiGLU hidden elements per token a layer computes (MoE: top-k experts at the capacity factor)."""
    moe = _moe(m)
    if moe is None:
        return m.mlp
    f = moe.mlp or m.mlp
    routed = moe.top_k * f * (moe.capacity_factor if moe.dispatch == "capacity" else 1.0)
    return round(routed + moe.shared_experts * f)


def layer_residuals(m: ModelConfig, policy: str, seq_len: int) -> list[Activation]:
    """What one decoder layer keeps for its backward under a remat policy (what jax's autodiff saves).

    ``none``: everything below (norms and SwiGLU as :mod:`jaxscale.models.lean` keeps them);
    ``selective``: ``none`` less the attention core's own residuals; ``full``: the layer input;
    ``save_dots``: the input and the outputs of the weight matmuls that the recomputation needs
    (q, k, v, attention out, gate, up); ``save_named``: the input and ``model.remat_names``.
    """
    h, a, g, d = m.embed, m.heads, m.kv_heads, m.head_dim
    fe = _mlp_per_token(m)
    sizes = {"h": h, "ad": a * d, "gd": g * d, "f": fe}
    x = Activation("layer input", h, RESIDUAL)
    if policy == "full":
        return [x]
    if policy == "save_dots":
        return [
            x,
            Activation("query, key, value", a * d + 2 * g * d, Q_AXES),
            Activation("attention projection", h, MATMUL_IN),  # under SP: the partial sums, before the scatter
            Activation("gate, up", 2 * fe, MLP_AXES),
        ]
    if policy == "save_named":
        names = getattr(m, "remat_names", [])
        return [x] + [Activation(n, sizes[REMAT_NAMES[n][0]], REMAT_NAMES[n][1]) for n in names if n in REMAT_NAMES]
    attention = getattr(m, "attention", "dot")
    kept = [
        Activation("norm inputs", 2 * h, RESIDUAL),
        Activation("norm statistics", 2, RESIDUAL[:2], "fp32"),
        Activation("normed inputs", 2 * h, MATMUL_IN),
        Activation("query, attention out", 2 * a * d, Q_AXES),
        Activation("key, value", 2 * g * d, KV_AXES),
        Activation("gate, up, hidden", 3 * fe, MLP_AXES),
    ]
    if policy == "selective":
        pass
    elif attention in FLASH_ATTENTION:
        kept += [Activation("kernel output", a * d, Q_AXES), Activation("softmax statistics", a, SCORES, "fp32")]
    else:
        kept += [
            Activation("scores", a * seq_len, SCORES, "fp32"),
            Activation("probabilities", a * seq_len, SCORES),
            Activation("softmax statistics", 2 * a, SCORES, "fp32"),
        ]
    moe = _moe(m)
    if moe is not None:
        kept.append(Activation("router", 2 * moe.experts, RESIDUAL[:2], "fp32"))
    return kept


def korthikanti(m: ModelConfig, tokens: float, seq_len: int, t: int = 1, sp: bool = False) -> float:
    """FORMULAS.md's activations per layer (bf16, Korthikanti et al.), for comparison."""
    sbh = tokens * m.embed
    attn = 5 * m.heads * seq_len / m.embed
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


# -- memory ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """The batch side of a step: global batch in sequences, sequence length, accumulation, pipeline."""

    global_batch: int
    seq_len: int
    microbatches: int = 1  # gradient accumulation steps
    pipeline_microbatches: int = 1
    repeats: int = 1
    pipeline_remat: bool = True

    @classmethod
    def from_config(cls, config: Config, stages: int = 1) -> Step:
        """The step of an experiment; ``stages`` is the resolved size of the ``stage`` mesh axis."""
        pipeline = getattr(config, "pipeline", None)
        m = (pipeline.microbatches or stages) if pipeline is not None else 1
        v = pipeline.repeats if pipeline is not None else 1
        t = config.train
        return cls(t.global_batch, t.seq_len, t.microbatches, m, v, pipeline.remat if pipeline is not None else True)


def _bytes_of(act: Activation, m: ModelConfig) -> int:
    return 4 if act.dtype == "fp32" else dtype_bytes(m.dtype)


def _per_device(act: Activation, rows: float, step: Step, m: ModelConfig, place: Placement) -> float:
    """Bytes on one device of an activation of ``rows`` sequences (of the whole mesh) kept once."""
    return rows * step.seq_len * act.per_token * _bytes_of(act, m) / place.ways(act.axes)


def _layers_here(m: ModelConfig, place: Placement) -> float:
    return m.layers / place.ways(("layers",))


def _layer_param_elems(params: Sequence[Param], place: Placement, reduced: bool) -> float:
    """Elements of one layer's parameters on this device; ``reduced`` False: before any data-parallel split."""
    total = 0.0
    for p in params:
        if not p.in_layers:
            continue
        axes = [a for a in place.mesh_axes(p.axes) if reduced or a not in place.token_axes]
        total += p.size / p.shape[p.axes.index("layers")] / place.size(axes)
    return total


def memory(m: ModelConfig, params: Sequence[Param], place: Placement, step: Step) -> dict[str, float]:
    """Predicted bytes per device of the compiled step, by part; ``total`` is their sum."""
    pbytes = dtype_bytes(m.param_dtype)
    cbytes = dtype_bytes(m.dtype)
    grad_kind = "optimizer" if step.microbatches == 1 else "gradients"

    def state(kind: str) -> float:
        return sum(p.size / place.ways(p.axes, kind) for p in params) * pbytes

    micro_rows = step.global_batch / step.microbatches  # sequences in one forward/backward, all devices
    pipelined = place.pipelined
    rows = micro_rows / step.pipeline_microbatches if pipelined else micro_rows  # through a layer at once
    layers = _layers_here(m, place)
    residuals = layer_residuals(m, m.remat, step.seq_len)
    per_layer = sum(_per_device(r, rows, step, m, place) for r in residuals)
    kept_weights = 0.0  # weights a layer keeps for its backward (copies, not the parameters themselves)
    if m.remat == "none" and sequence_axes(place):  # SP's shard_map keeps its (gathered) weight operands
        kept_weights = sum(_split(p, place, step, m.layers).unit for p in params if p.in_layers and _in_sp_region(p))
    elif m.remat == "none" and m.dtype != m.param_dtype:  # the weights cast to the compute dtype
        kept_weights = _layer_param_elems(params, place, reduced=True)
    per_layer += kept_weights * cbytes
    everything = sum(_per_device(r, rows, step, m, place) for r in layer_residuals(m, "none", step.seq_len))
    layer_backward = everything * RECOMPUTE.get(m.remat, 1.0) + kept_weights * cbytes
    layer_backward += _layer_param_elems(params, place, reduced=False) * pbytes
    vocab = Activation("logits", m.vocab_size, LOGITS)
    loss = _per_device(vocab, micro_rows, step, m, place) * (cbytes + 12) / cbytes
    if getattr(m, "loss_chunk", 0):  # chunked cross-entropy (jaxscale/loss.py): one chunk of logits at a time
        loss *= m.loss_chunk / step.seq_len
    activations = layers * per_layer
    if pipelined:
        activations, layer_backward = _pipeline_activations(m, place, step, rows, layers * per_layer, layer_backward)
    out = {
        "params": state("params"),
        "optimizer": 2 * state("optimizer"),
        "gradients": state(grad_kind),
        "accumulator": state("gradients") if step.microbatches > 1 else 0.0,
        # The pipeline loop reuses the stage's weights every tick: their gradient is its carry.
        "pipeline accumulator": sum(p.size / place.ways(p.axes) for p in params if p.in_layers) * pbytes
        if pipelined else 0.0,
        "activations": activations,
        "transient": max(layer_backward, loss),
        "batch": 3 * 4 * step.global_batch * step.seq_len / place.ways(TOKEN_NAMES),
    }
    if getattr(m, "attention", "dot") not in FLASH_ATTENTION:
        mask = Activation("mask", m.heads * step.seq_len, SCORES, "fp32")
        out["mask"] = _per_device(mask, rows, step, m, place) * 5 / 4  # fp32 where + bool
    out["total"] = sum(out.values())
    return out


def _pipeline_ticks(place: Placement, step: Step) -> int:
    """Iterations of the pipeline loop, v·m + p − 1: every stage runs them all, the bubble's too."""
    return step.repeats * step.pipeline_microbatches + place.ways(("layers",)) - 1


def _pipeline_activations(m: ModelConfig, place: Placement, step: Step, rows: float, stage_residuals: float,
                          layer_backward: float) -> tuple[float, float]:
    """Kept activations and the backward's transient of a pipelined stage (:mod:`jaxscale.parallel.pipeline`).

    The loop holds the microbatches' inputs and outputs and, per tick, either the stage's input
    (``pipeline.remat``: the stage forward is recomputed in the backward, whose transient then holds
    one tick's stage residuals) or all of the stage's residuals. ``stage_residuals`` is one
    microbatch through all the layers this device holds; a tick runs 1/v of them.
    """
    pm, v = step.pipeline_microbatches, step.repeats
    ticks = _pipeline_ticks(place, step)
    x = _per_device(Activation("stage input", m.embed, RESIDUAL), rows, step, m, place)
    buffers = 2 * pm * x
    if step.pipeline_remat:
        return buffers + ticks * x, layer_backward + stage_residuals / v
    return buffers + ticks * stage_residuals / v, layer_backward


def state_formula(psi: float, n_d: int, stage: int, param_bytes: int = 4) -> dict[str, float]:
    """FORMULAS.md "Model state per device" in jaxscale's fp32 convention: 4Ψ params, 8Ψ Adam, 4Ψ gradients."""
    p, g, o = param_bytes * psi, param_bytes * psi, 2 * param_bytes * psi
    return {
        "params": p / n_d if stage >= 3 else p,
        "gradients": g / n_d if stage >= 2 else g,
        "optimizer": o / n_d if stage >= 1 else o,
    }


# -- communication --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Flow:
    """One collective of the step: what it moves, over which mesh axes, how often, bytes per device per run."""

    what: str
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axes: tuple[str, ...]
    size: float  # the bytes the wire rule applies to (all-gather: result; others: operand)
    runs: float
    n: int
    phase: str  # forward, backward, update
    overlap: bool  # may hide behind compute

    @property
    def wire_bytes(self) -> float:
        if self.kind == "collective-permute":
            return self.size * self.runs
        factor = 2 if self.kind == "all-reduce" else 1
        return factor * (self.n - 1) / self.n * self.size * self.runs


def _flow(what: str, kind: str, axes: Sequence[str], size: float, runs: float, place: Placement, phase: str,
          overlap: bool) -> list[Flow]:
    axes = tuple(axes)
    n = place.size(axes)
    if n <= 1 or size <= 0 or runs <= 0:
        return []
    return [Flow(what, kind, axes, size, runs, n, phase, overlap)]


def _gradient_all_reduce(what: str, axes: Sequence[str], size: float, runs: float, place: Placement) -> list[Flow]:
    """A gradient summed over ``axes``: XLA reduces over the context axes first, then over the rest.

    The partial sums over the sequence (context parallelism) and over the batch are two
    all-reduces of the whole gradient, not one over their product (seen in the compiled step).
    """
    context = [a for a in axes if a in place.context_axes]
    rest = [a for a in axes if a not in context]
    flows = _flow(what, "all-reduce", context, size, runs, place, "backward", True)
    return flows + _flow(what, "all-reduce", rest, size, runs, place, "backward", True)


def _is_embedding(p: Param) -> bool:
    return p.axes == ("vocab", "embed") and p.path.split(".")[-1] == "embedding"


def _in_sp_region(p: Param) -> bool:
    """A weight that sequence parallelism's shard_maps consume: the projections and the output head."""
    return bool({"heads", "kv_heads", "mlp"} & set(p.axes)) or p.axes == ("embed", "vocab")


def sequence_axes(place: Placement) -> tuple[str, ...]:
    """Mesh axes of SP: they split ``norm_length`` but not ``length``."""
    inner = place.mesh_axes(("length",))
    return tuple(a for a in place.mesh_axes(("norm_length",)) if a not in inner)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How one parameter is laid out against the axes that split the tokens."""

    held: tuple[str, ...]  # mesh axes its parameters' layout splits it over
    gathered: tuple[str, ...]  # ... of them, token axes: ZeRO-3, gathered to compute
    scattered: tuple[str, ...]  # token axes only its optimizer (gradient) layout splits: ZeRO-1/2
    reduced: tuple[str, ...]  # token axes that split neither: its gradient is all-reduced over them
    count: float  # layers of it on this device (1 outside the layer stack)
    whole: float  # elements on a device once gathered (all its layers)

    @property
    def unit(self) -> float:
        """Elements of one layer, gathered."""
        return self.whole / self.count


def _split(p: Param, place: Placement, step: Step, layers: int) -> _Split:
    tokens = place.token_axes
    held = place.mesh_axes(p.axes)
    experts = place.mesh_axes(("expert",)) if "expert" in p.axes else ()
    gathered = tuple(a for a in held if a in tokens and a not in experts)
    kind = "optimizer" if step.microbatches == 1 else "gradients"
    scattered = tuple(a for a in place.mesh_axes(p.axes, kind) if a in tokens and a not in held)
    reduced = tuple(a for a in tokens if a not in held and a not in scattered)
    count = layers / place.ways(("layers",)) if p.in_layers else 1
    whole = p.size / place.size([a for a in held if a not in gathered])
    return _Split(held, gathered, scattered, reduced, count, whole)


def _embedding_flows(sp: _Split, place: Placement, step: Step, bsh: float, pbytes: int,
                     sp_axes: Sequence[str], vocab_axes: Sequence[str]) -> list[Flow]:
    """The lookup table: rows are looked up where they live, the activations move (see the module docstring)."""
    micro = step.microbatches
    table = sp.whole * pbytes
    lookup = "embedding lookup: activations"
    out: list[Flow] = []
    if sp_axes:  # the table is gathered whole, its gradient reduced whole
        full = table * place.size(vocab_axes)
        out += _flow("embedding table", "all-gather", sp.gathered, table, 1, place, "forward", False)
        out += _flow("embedding table", "all-gather", vocab_axes, full, 1, place, "forward", False)
        out += _flow("embedding gradient", "all-reduce", vocab_axes, full / place.size(sp.scattered), 1, place,
                     "backward", True)
        if sp.scattered:
            out += _flow(lookup + " (for the gradient)", "all-to-all", sp.scattered, bsh, micro, place, "backward",
                         True)
        kind = "reduce-scatter" if sp.gathered else "all-reduce"
        return out + _flow("embedding gradient", kind, sp.gathered + sp.reduced, full, 1, place, "backward", True)
    if sp.gathered:
        out += _flow(lookup, "all-to-all", sp.gathered, bsh, micro, place, "forward", False)
        out += _flow(lookup, "all-to-all", sp.gathered, bsh, micro, place, "backward", False)
        if sp.reduced:  # with replicas too (HSDP) the whole table's gradient is all-reduced
            out += _flow("embedding gradient", "all-reduce", sp.gathered + sp.reduced, table, 1, place, "backward",
                         True)
        return out
    if sp.scattered:
        out += _flow(lookup + " (for the gradient)", "all-to-all", sp.scattered, bsh, micro, place, "backward", True)
    return out + _gradient_all_reduce("embedding gradient", sp.reduced, table / place.size(sp.scattered), micro, place)


def _param_flows(p: Param, m: ModelConfig, place: Placement, step: Step, bsh: float) -> list[Flow]:
    """Gradient reduction, ZeRO gathers and the embedding's lookup traffic of one parameter."""
    pbytes = dtype_bytes(m.param_dtype)
    sp = _split(p, place, step, m.layers)
    sp_axes = sequence_axes(place)
    out: list[Flow] = []
    if _is_embedding(p):
        out += _embedding_flows(sp, place, step, bsh, pbytes, sp_axes, place.mesh_axes(("vocab",)))
    else:
        unit = sp.unit * pbytes
        runs = step.microbatches * sp.count
        in_sp = bool(sp_axes) and _in_sp_region(p)
        fsdp_runs, regather = runs, 1  # gathers and scatters over the parameter's token axes; backward gathers
        if p.in_layers and place.pipelined:
            # In the pipeline loop every tick runs 1/v of the stage's layers, gathering and scattering as
            # it goes, and its backward gathers again for the recomputed stage forward (pipeline.remat).
            # Over the other data axes the loop sums the gradient and reduces it once, after the loop.
            fsdp_runs = runs * _pipeline_ticks(place, step) / step.repeats
            regather += step.pipeline_remat
        if sp.gathered:
            out += _flow(p.path, "all-gather", sp.gathered, unit, fsdp_runs if p.in_layers else 1, place, "forward",
                         True)
            if p.in_layers and (not in_sp or m.remat != "none"):  # SP's shard_map keeps it, unless recomputed
                out += _flow(p.path, "all-gather", sp.gathered, unit, regather * fsdp_runs, place, "backward", True)
        if in_sp:  # inside the shard_map: summed over the replicas whole, then scattered
            out += _flow(p.path + " gradient", "all-reduce", sp.reduced, unit, runs, place, "backward", True)
            out += _flow(p.path + " gradient", "reduce-scatter", sp.scattered + sp.gathered, unit, runs, place,
                         "backward", True)
        else:
            shard = unit / place.size(sp.gathered)
            out += _flow(p.path + " gradient", "reduce-scatter", sp.gathered, unit, fsdp_runs, place, "backward", True)
            out += _flow(p.path + " gradient", "reduce-scatter", sp.scattered, shard, runs, place, "backward", True)
            out += _gradient_all_reduce(p.path + " gradient", sp.reduced, shard / place.size(sp.scattered), runs, place)
    updated = [a for a in place.mesh_axes(p.axes, "optimizer") if a in place.token_axes and a not in sp.held]
    shard_all = sp.whole / place.size(sp.gathered) * pbytes
    if step.microbatches > 1 and not sp.scattered:  # ZeRO-1: each microbatch's sum is re-gathered to accumulate
        out += _flow(p.path + " gradient", "all-gather", updated, shard_all, step.microbatches, place, "update", False)
    return out + _flow(p.path + " (updated)", "all-gather", updated, shard_all, 1, place, "update", False)


def communication(m: ModelConfig, params: Sequence[Param], place: Placement, step: Step) -> list[Flow]:
    """Every collective of the step, as :class:`Flow`s (see the module docstring for what is counted)."""
    cbytes = dtype_bytes(m.dtype)
    rows = step.global_batch / place.ways(("batch",)) / step.microbatches
    s_local = step.seq_len / place.ways(("length",))
    bsh = rows * s_local * m.embed * cbytes  # one microbatch's hidden states on a device
    micro = step.microbatches
    layers = m.layers / place.ways(("layers",))
    flows: list[Flow] = []
    for p in params:
        flows += _param_flows(p, m, place, step, bsh)

    tensor = [a for a in place.mesh_axes(("heads",)) if a not in place.token_axes]
    sp = sequence_axes(place)
    runs = micro * layers  # a layer's activation collectives, in units of bsh
    recompute = m.remat != "none"  # the backward recomputes the layer up to its last collective
    stage_remat = False  # the backward recomputes the whole stage forward (pipeline.remat)
    if place.pipelined:
        # Each tick runs a microbatch (bsh / m) through 1/v of the stage's layers, bubble ticks included.
        runs *= _pipeline_ticks(place, step) / (step.pipeline_microbatches * step.repeats)
        stage_remat = step.pipeline_remat
    if sp:
        def sp_flow(what: str, kind: str, count: float, phase: str) -> list[Flow]:
            if not m.tp_overlap:
                return _flow(what, kind, sp, bsh, count, place, phase, False)
            # Collective matmul: t − 1 permutes of one chunk per all-gather / reduce-scatter, hidden by its matmuls.
            t = place.size(tuple(sp))
            return _flow(what, "collective-permute", sp, bsh / t, (t - 1) * count, place, phase, True)

        for phase in ("forward", "backward"):
            flows += sp_flow("SP: norm output", "all-gather", 2 * runs, phase)
            flows += sp_flow("SP: block output", "reduce-scatter", 2 * runs, phase)
        if recompute:
            flows += sp_flow("SP: recomputed norm outputs", "all-gather", 2 * runs, "backward")
            flows += sp_flow("SP: recomputed attention output", "reduce-scatter", runs, "backward")
        flows += sp_flow("SP: final norm output", "all-gather", micro, "forward")
        flows += sp_flow("SP: final norm output", "reduce-scatter", micro, "backward")
    elif tensor:
        flows += _flow("TP: attention and MLP out", "all-reduce", tensor, bsh, 2 * runs, place, "forward", False)
        flows += _flow("TP: q, k, v, gate, up input gradients", "all-reduce", tensor, bsh, 5 * runs, place,
                       "backward", False)
        # The recomputed stage forward all-reduces twice a layer; a recomputed layer, up to its attention output.
        flows += _flow("TP: recomputed forward", "all-reduce", tensor, bsh, (2 * stage_remat + recompute) * runs,
                       place, "backward", False)
        flows += _flow("TP: vocabulary-parallel lookup", "all-reduce", tensor, bsh, micro, place, "forward", False)
        flows += _flow("TP: head input gradient", "all-reduce", tensor, bsh, micro, place, "backward", False)

    context = place.context_axes
    if context:
        c = place.size(context)
        kv = rows * s_local * m.kv_heads * m.head_dim
        for phase in ("forward", "backward"):
            flows += _flow("CP ring: keys, values", "collective-permute", context, 2 * kv * cbytes, (c - 1) * runs,
                           place, phase, True)
        flows += _flow("CP ring: key, value gradients (fp32, home in c hops)", "collective-permute", context,
                       2 * kv * 4, c * runs, place, "backward", True)

    stages = place.mesh_axes(("layers",))
    if stages:
        ticks = _pipeline_ticks(place, step)
        size = bsh / step.pipeline_microbatches
        for phase in ("forward", "backward"):
            flows += _flow("PP: stage boundary", "collective-permute", stages, size, ticks * micro, place, phase,
                           False)
        flows += _flow("PP: last stage's outputs to every stage", "all-reduce", stages, bsh, micro, place, "forward",
                       False)
        flows += _flow("PP: their gradient, summed over stages", "all-reduce", stages, bsh, micro, place, "backward",
                       False)

    moe = _moe(m)
    experts = place.mesh_axes(("expert",)) if moe is not None else ()
    if experts:
        moe_layers = layers / moe.every_n_layers
        cf = moe.capacity_factor if moe.dispatch == "capacity" else 1.0
        routed = moe.top_k * bsh * cf
        for phase in ("forward", "backward"):
            flows += _flow("EP: dispatch and combine", "all-to-all", experts, routed, 2 * micro * moe_layers, place,
                           phase, False)
    return flows


def summarize_flows(flows: Sequence[Flow]) -> dict[str, Any]:
    """Wire bytes per device per step: total, by kind and by mesh axes (as :func:`jaxscale.inspect.summarize`)."""
    by_kind: dict[str, float] = {}
    by_axes: dict[str, float] = {}
    for f in flows:
        by_kind[f.kind] = by_kind.get(f.kind, 0.0) + f.wire_bytes
        key = ",".join(f.axes)
        by_axes[key] = by_axes.get(key, 0.0) + f.wire_bytes
    return {"total": sum(f.wire_bytes for f in flows), "by_kind": by_kind, "by_axes": by_axes}


# -- clusters and time -----------------------------------------------------------------


@dataclasses.dataclass
class Cluster:
    """Devices, their memory and speed, and the two networks (within a node, across nodes); per device."""

    device: str
    memory_bytes: float
    peak_flops: float
    intra_bandwidth: float
    inter_bandwidth: float
    devices_per_node: int = 8
    nodes: int = 1
    usable_memory: float = 0.9
    compute_efficiency: float = 0.5

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def budget(self) -> float:
        """Bytes per device a layout may use."""
        return self.memory_bytes * self.usable_memory


def load_cluster(name_or_path: str, overrides: Sequence[str] = ()) -> Cluster:
    """A preset from ``configs/clusters/`` (or a YAML path), with ``KEY=VALUE`` overrides; checked."""
    path = resolve_named(name_or_path, "clusters")
    data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        keys, value = parse_override(item)
        data[".".join(keys)] = value
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"cluster {Path(path).stem}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
        if key == "device":
            continue
        try:
            number = float(value)  # YAML 1.1 reads 80.0e9 as a string
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or not number > 0:
            raise ConfigError(f"cluster {Path(path).stem}: '{key}' must be a positive number, got {value!r}")
        data[key] = number
    missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in data]
    if missing:
        raise ConfigError(f"cluster {Path(path).stem}: missing '{missing[0]}'")
    cluster = Cluster(**data)
    for key in ("devices_per_node", "nodes"):
        if getattr(cluster, key) != int(getattr(cluster, key)):
            raise ConfigError(f"cluster {Path(path).stem}: '{key}' must be an integer")
        setattr(cluster, key, int(getattr(cluster, key)))
    if cluster.usable_memory > 1 or cluster.compute_efficiency > 1:
        raise ConfigError(f"cluster {Path(path).stem}: usable_memory and compute_efficiency are fractions (<= 1)")
    return cluster


def crosses_nodes(axes: Sequence[str], mesh: Mapping[str, int], devices_per_node: int) -> bool:
    """Whether a group over ``axes`` spans nodes: devices are numbered along the mesh, ``tensor`` fastest."""
    stride_of = {}
    stride = 1
    for axis in reversed(MESH_AXES):
        stride_of[axis] = stride
        stride *= mesh[axis]
    return any(stride_of[a] * mesh[a] > devices_per_node for a in axes if mesh[a] > 1)


def step_time(
    m: ModelConfig, flows: Sequence[Flow], place: Placement, step: Step, cluster: Cluster
) -> dict[str, float]:
    """Predicted seconds per step: compute, pipeline bubble, exposed communication; and the MFU."""
    from jaxscale.metrics import flops_per_token
    devices = math.prod(place.mesh.values())
    tokens = step.global_batch * step.seq_len
    model_flops = flops_per_token(m, step.seq_len) * tokens
    extra = {"none": 0.0, "save_dots": 0.05, "save_named": 0.15, "full": 1 / 3}[m.remat]
    p = place.ways(("layers",))
    if p > 1 and step.pipeline_remat:  # the backward recomputes each stage's forward
        extra += 1 / 3
    compute = model_flops * (1 + extra) / devices / (cluster.peak_flops * cluster.compute_efficiency)
    bubble = 0.0
    if p > 1:
        bubble = compute * (p - 1) / (step.repeats * step.pipeline_microbatches)
    hidden = exposed = 0.0
    for f in flows:
        inter = crosses_nodes(f.axes, place.mesh, cluster.devices_per_node)
        seconds = f.wire_bytes / (cluster.inter_bandwidth if inter else cluster.intra_bandwidth)
        if f.overlap:
            hidden += seconds
        else:
            exposed += seconds
    exposed += max(0.0, hidden - compute)
    total = compute + bubble + exposed
    return {
        "compute": compute,
        "bubble": bubble,
        "communication": hidden + exposed - max(0.0, hidden - compute),
        "exposed": exposed,
        "total": total,
        "mfu": model_flops / devices / cluster.peak_flops / total,
        "tokens_per_sec": tokens / total,
    }


# -- one entry point ----------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    """Memory (bytes per device), collectives and, given a cluster, time of one layout."""

    memory: dict[str, float]
    flows: list[Flow]
    time: dict[str, float] | None = None

    @property
    def comm(self) -> dict[str, Any]:
        return summarize_flows(self.flows)


def predict(
    m: ModelConfig, params: Sequence[Param], place: Placement, step: Step, cluster: Cluster | None = None
) -> Prediction:
    flows = communication(m, params, place, step)
    time = step_time(m, flows, place, step, cluster) if cluster is not None else None
    return Prediction(memory(m, params, place, step), flows, time)


def predict_trainer(trainer: Any, cluster: Cluster | None = None) -> Prediction:
    """The prediction for a built :class:`jaxscale.train.Trainer` (its model, rules and mesh)."""
    params = [Param(path, shape, axes) for path, shape, axes in _trainer_params(trainer)]
    place = Placement.from_rules(trainer.rules, dict(trainer.mesh.shape))
    step = Step.from_config(trainer.config, trainer.mesh.shape["stage"])
    return predict(trainer.config.model, params, place, step, cluster)


def _trainer_params(trainer: Any) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    import jax

    from jaxscale.sharding import is_axes

    paths = jax.tree_util.tree_flatten_with_path(trainer.abstract_params)[0]
    flat_axes = jax.tree.leaves(trainer.axes, is_leaf=is_axes)
    return [
        (jax.tree_util.keystr(path, simple=True, separator="."), tuple(leaf.shape), tuple(a))
        for (path, leaf), a in zip(paths, flat_axes, strict=True)
    ]
