"""The playbook's three steps to a layout, on the analytic model (:mod:`jaxscale.analysis`).

1. **Fit in memory.** Enumerate layouts of the cluster's devices over the mesh axes
   (``data``, ZeRO-1/2 on it, ``fsdp`` = ZeRO-3 with ``data`` as replicas (HSDP), ``tensor`` with or without sequence
   parallelism, ``context``, ``stage`` with its microbatches and repeats, ``expert`` for MoE
   models) and remat policies; keep those whose predicted memory per device (parameters,
   gradients and optimizer state per ZeRO stage; activations per layer under TP, SP, CP and
   PP; the transient peak) fits the device's usable memory at some micro-batch.
2. **Reach the target batch.** The global batch (tokens / sequence length) is reached with
   data parallelism and gradient accumulation: accumulation = global batch / (micro-batch x
   pipeline microbatches x data-parallel size), which must divide; the largest micro-batch
   that fits is taken (the playbook's recipe, docs/formulas.md "Batch size").
3. **Maximise throughput.** Rank by predicted step time: compute at the cluster's stated
   efficiency, the pipeline bubble, and the communication that cannot hide
   (:func:`jaxscale.analysis.timing.step_time`); within 0.1% the simpler layout (fewer strategies),
   then the smaller memory, comes first.

Every layout is data (:mod:`jaxscale.analysis.strategy`): its rules table and the experiment file
``jaxscale train`` runs are written from it. :mod:`jaxscale.analysis.verify` compiles
candidates on simulated devices and puts the compiled memory and collective bytes next to
the prediction.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from jaxscale.analysis.blocks import attention
from jaxscale.analysis.cluster import Cluster
from jaxscale.analysis.communication import communication
from jaxscale.analysis.flows import summarize_flows
from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import Param, stacked
from jaxscale.analysis.reasons import (
    BLOCK_AXES,
    Candidate,
    balance_line,
    context_line,
    expert_lines,
    fmt_time,
    kernel_line,
    reasons,
    unit_for,
)
from jaxscale.analysis.strategy import Strategy, base_rules, model_for, placement, step_for
from jaxscale.analysis.timing import step_time
from jaxscale.config.read import DEFAULT_SCHEDULE, ConfigError, ModelConfig
from jaxscale.config.stage_layers import lighter_ends, unit
from jaxscale.layout.rules import Layout
from jaxscale.layout.stage_plan import assumed

REMATS = ("none", "save_dots", "full")


def shape_problem(params: Sequence[Param], place: Layout, m: ModelConfig, seq_len: int) -> str | None:
    """Why the model's shapes cannot take this layout (a dimension not divisible by its mesh axes), or None."""
    for p in params:
        for kind in ("params", "optimizer", "gradients"):
            for size, name in zip(p.shape, p.axes, strict=True):
                ways = place.ways((name,), kind)
                if size % ways:
                    return f"{p.path} {name} ({size}) not divisible by {ways}"
    for name in ("length", "norm_length"):
        if seq_len % place.ways((name,)):
            return f"sequence length {seq_len} not divisible by {place.ways((name,))}"
    return None


@dataclasses.dataclass
class Plan:
    """The ranked layouts, why the first two win, and for each family that never fit, why."""

    candidates: list[Candidate]
    rejected: dict[str, str]
    searched: int
    global_batch: int
    seq_len: int
    cluster: Cluster
    reasons: list[str] = dataclasses.field(default_factory=list)
    dtype: str = "float32"  # the compute dtype of the activations in the table


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


FSDP_GATHERS = ("step", "visit", "tick")  # pipeline.fsdp: FSDP inside a stage gathered once, per visit, per tick
PIPELINE_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))  # (schedule, repeats)
MAX_MICROBATCHES = 32  # per stage: m from p to 32·p


def stage_split(m: ModelConfig, chunks: int) -> tuple[int, ...] | None:
    """``pipeline.layers_per_stage`` for ``chunks`` virtual stages: None where the layers split evenly, else the
    first and last stages lighter (:func:`jaxscale.config.stage_layers.lighter_ends`, in whole MoE groups)."""
    per_unit = unit(m)
    units = m.layers // per_unit
    if units % chunks == 0:
        return None
    if units < chunks:
        return ()  # fewer layers than virtual stages
    return tuple(n * per_unit for n in lighter_ends(units, chunks))


def _pipelines(
    m: ModelConfig, devices: int, max_stages: int, sequences: int
) -> Iterator[tuple[int, int, int, str, tuple[int, ...] | None]]:
    """(stages, pipeline microbatches, repeats, schedule, layers per virtual stage): GPipe, 1F1B, interleaved
    1F1B (v = 2) and ZB-H1 with m = p, 2p, ... up to 32p and the batch's sequences; where the layers do not divide
    p·v, the first and last virtual stages a layer lighter (:func:`stage_split`)."""
    yield 1, 1, 1, DEFAULT_SCHEDULE, None
    for p in _divisors(devices):
        if p == 1 or p > max_stages:
            continue
        mult = 1
        while mult <= MAX_MICROBATCHES and mult * p <= sequences:
            for schedule, v in PIPELINE_SCHEDULES:
                split = stage_split(m, v * p)
                if split != ():
                    yield p, mult * p, v, schedule, split
            mult *= 2


def layouts(m: ModelConfig, cluster: Cluster, seq_len: int, max_stages: int = 16,
            sequences: int = 2**30) -> Iterator[Strategy]:
    """Every combination of mesh sizes, ZeRO stage and remat policy for the cluster (micro-batch 1)."""
    devices = cluster.devices
    moe = m.moe
    partitioner = moe is not None and moe.impl == "partitioner"  # a stage leaves FSDP to the partitioner
    heads = attention(m).k // attention(m).qk_dim  # the heads that split keys: kv_heads, or MLA's every head
    tensors = [t for t in _divisors(min(devices, cluster.devices_per_node)) if heads % t == 0]
    # Not modelled: a pipeline's first stage running DeepSeek's dense blocks, its last the prediction depths
    max_stages = 1 if m.deepseek and (m.deepseek.dense_layers or m.deepseek.mtp_depth) else max_stages
    contexts = [c for c in _divisors(devices) if seq_len % c == 0 and (c == 1 or seq_len // c >= 512)]
    experts = [e for e in _divisors(devices) if moe is not None and moe.experts % e == 0] or [1]
    sp_options = ((False, False), (True, False), (True, True))  # (sequence parallelism, collective matmuls)
    for t, (sp, ov), c, e, (p, mb, v, schedule, split) in itertools.product(
        tensors, sp_options, contexts, experts, _pipelines(m, devices, max_stages, sequences)
    ):
        # The pipeline runs no SP in a stage, and CP (ring attention) in a stage for a dense model only.
        if (sp and t == 1) or (p > 1 and (sp or (c > 1 and moe is not None))):
            continue
        if ov and (m.moe is not None or c > 1):  # collective matmuls: dense layers, no ring attention
            continue
        rest, left = divmod(devices, t * c * e * p)
        if left:
            continue
        for f in _divisors(rest):
            d = rest // f
            # A stage applies no layer remat (its backward recomputes each chunk once): one policy there.
            remats = ("none",) if p > 1 else REMATS + ("offload_dots",) * (cluster.host_bandwidth > 0)
            for zero, remat in itertools.product((0, 1, 2) if d > 1 and f == 1 else (0,), remats):
                one = Strategy(d, f, t, sp, ov, c, p, e, zero, remat, 1, 1, mb, v, schedule, 0, split)
                yield one
                if c > 1 and p == 1:  # all-to-alls in place of all or part of the ring
                    yield from _all_to_alls(m, one, cluster.devices_per_node)
                if p > 1 and f > 1 and not partitioner:  # FSDP in a stage per visit or every tick
                    # (less memory; a stage of partitioner experts leaves FSDP to the partitioner whatever
                    # pipeline.fsdp says)
                    yield from (dataclasses.replace(one, fsdp_gather=g) for g in FSDP_GATHERS[1:])


def _all_to_alls(m: ModelConfig, ring: Strategy, per_node: int) -> Iterator[Strategy]:
    """Beside ``ring`` (context parallelism by a ring alone): Ulysses over its whole context degree, and USP with
    the all-to-all's ``u`` devices inside a node (with TP's and EP's, inner to it in the mesh) and the ring of
    the rest across, wherever ``u`` splits each device's heads."""
    c, inner = ring.context, ring.tensor * ring.expert
    for u in _divisors(c):
        if u > 1 and _ulysses_splits(m, ring.tensor, u) and (u == c or inner * u <= per_node):
            yield dataclasses.replace(ring, context=c // u, ulysses=u)


def _ulysses_splits(m: ModelConfig, tensor: int, context: int) -> bool:
    """Whether Ulysses over ``context`` splits each device's heads (``tensor`` split them first): the query heads
    divide by it, the kv heads divide by it or into it (replicated; :mod:`jaxscale.parallel.ulysses`)."""
    att = attention(m)
    heads, kv = m.heads // tensor, att.k // att.qk_dim // tensor
    return heads % context == 0 and (kv % context == 0 or context % kv == 0)


def loss_chunk_for(seq_len: int) -> int:
    """The chunk the planner tries for the cross-entropy: the largest divisor of the sequence up to 1/8 of it."""
    return max(d for d in _divisors(seq_len) if d <= max(1, seq_len // 8))


STATE_PARTS = ("params", "master", "optimizer", "gradients", "accumulator", "pipeline accumulator", "pipeline copies")


def state_bytes(mem: dict[str, float]) -> float:
    """The compute copy, the master, optimizer state, gradients and accumulators."""
    return sum(mem.get(k, 0.0) for k in STATE_PARTS)


def does_not_fit(layout: Strategy, mem: dict[str, float], budget: float, loss_peak: bool) -> str:
    """Why a layout does not fit at micro-batch 1: its largest term and the setting that would shrink it."""
    peak = "the loss" if loss_peak else "one layer's backward"
    if layout.stage > 1:  # the backward slot: a layer recomputed from its kept input, the head's loss
        peak = "a layer's backward in a stage"
    terms = {"model state": state_bytes(mem), "activations": mem["activations"], peak: mem["transient"],
             "the scores mask": mem.get("mask", 0.0)}
    largest = max(terms, key=lambda k: terms[k])
    alone = layout.devices == 1  # no layout shards anything: the fix is more devices, or less work
    if largest == "model state":
        fix = ("more devices to shard it over (ZeRO-3), or a smaller model" if alone
               else "shard it: ZeRO-3 (fsdp)" if layout.zero_stage < 3 else "more tensor or pipeline ways")
    elif largest == "activations":
        fix = ("more recompute (remat full)" if layout.remat != "full"
               else "a shorter sequence, or more devices" if alone else "more stages or context parallelism")
    elif largest == "the loss":
        fix = (f"a smaller loss chunk than {layout.loss_chunk}" if layout.loss_chunk
               else "chunked loss (model.loss_chunk)")
        fix += "" if alone else ", or more tensor ways (the vocabulary splits)"
    elif layout.stage > 1 and largest == peak:
        fix = "flash attention, a loss chunk, or more tensor ways"
    elif largest == "the scores mask":
        fix = "flash attention (--attention cudnn or blockwise)"
    else:
        fix = "more recompute, or more devices" if alone else "more tensor ways or recompute"
    return (f"needs {mem['total'] / 1e9:.1f} GB > {budget / 1e9:.1f} GB at micro-batch 1 ({layout.describe()}, "
            f"remat {layout.remat}); largest: {largest} {terms[largest] / 1e9:.1f} GB; would fit with: {fix}")


def rank_key(c: Candidate) -> tuple:
    """Fastest first; within 0.1% the smaller memory, then the simpler layout, then by name (deterministic)."""
    return (round(math.log(c.time["total"]) / math.log(1.001)), round(c.memory["total"] / 1e6), c.layout.strategies,
            c.layout.describe(), c.layout.remat)


def merge_identical(found: list[Candidate]) -> list[Candidate]:
    """One row for layouts whose figures agree (ZeRO-1 and ZeRO-2 without accumulation hold the same bytes)."""
    out: list[Candidate] = []
    seen: dict[tuple, Candidate] = {}
    for c in found:
        lay = dataclasses.replace(c.layout, zero=0)
        key = (lay, round(c.time["total"], 12), round(c.memory["total"]))
        if key in seen:
            seen[key].same.append(c.layout.describe())
            continue
        seen[key] = c
        out.append(c)
    return out


def evaluate(m: ModelConfig, params: Sequence[Param], layout: Strategy, seq_len: int, cluster: Cluster,
             place: Layout | None = None, mem: dict[str, float] | None = None) -> Candidate:
    """The prediction for one sized layout: its memory, collectives and step time on ``cluster``."""
    place = place or placement(layout)
    model, step = model_for(m, layout), step_for(layout, seq_len)
    params = stacked(params, model, step)
    mem = mem or memory(model, params, place, step)
    flows = communication(model, params, place, step, cluster.ep_imbalance)
    return Candidate(layout, mem, summarize_flows(flows), step_time(model, flows, place, step, cluster, params))


def _sized(m: ModelConfig, params: Sequence[Param], padded: Sequence[Param], layout: Strategy, place: Layout,
           per_rank: int, seq_len: int, cluster: Cluster, chunks: tuple[int, ...]) -> Candidate | tuple[float, str]:
    """``layout`` at the largest micro batch (a divisor of a rank's ``per_rank`` sequences) that fits, with the
    plain loss or else a chunked one (``chunks``), evaluated; or, where none fits, the bytes the micro batch of
    one needs at the least and why it does not fit. ``padded``: the parameters with the layer stack of uneven
    stages."""
    tried: list[tuple[Strategy, dict[str, float]]] = []
    for b in sorted(_divisors(per_rank), reverse=True):
        tried = []
        for chunk in chunks:
            sized = dataclasses.replace(layout, micro_batch=b, accumulation=per_rank // b, loss_chunk=chunk)
            model, step = model_for(m, sized), step_for(sized, seq_len)
            mem = memory(model, padded, place, step)
            if mem["total"] <= cluster.budget:
                return evaluate(m, params, sized, seq_len, cluster, place, mem)
            tried.append((sized, mem))
            if chunk == 0 and not mem["transient"] > max(mem["activations"], state_bytes(mem)) / 4:
                break  # the loss is too small a part for a chunk to make it fit
    sized, mem = min(tried, key=lambda t: t[1]["total"])  # the micro batch of one: the last tried
    loss_peak = len(tried) > 1 and tried[-1][1]["transient"] < tried[0][1]["transient"]
    return mem["total"], does_not_fit(sized, mem, cluster.budget, loss_peak)


def search(
    m: ModelConfig,
    params: Sequence[Param],
    cluster: Cluster,
    global_batch_tokens: int,
    seq_len: int,
    top: int = 10,
    documents: str = "",
) -> Plan:
    """Steps 1-3: the layouts that fit and reach the batch, fastest first; why the other families fail.

    A layout that does not fit with the plain loss is tried with a chunked one (:func:`loss_chunk_for`).
    ``documents``: rows packed with that corpus's documents (:mod:`jaxscale.analysis.ring_imbalance`).
    """
    if global_batch_tokens % seq_len:
        raise ConfigError(f"--global-batch-tokens ({global_batch_tokens}) is not a multiple of --seq-len ({seq_len})")
    sequences = global_batch_tokens // seq_len
    base = base_rules()
    found: list[Candidate] = []
    closest: dict[str, tuple[float, str]] = {}
    searched = 0
    chunks = (0,) if m.loss_chunk else (0, loss_chunk_for(seq_len))

    def reject(layout: Strategy, need: float, why: str) -> None:
        if layout.family not in closest or need < closest[layout.family][0]:
            closest[layout.family] = (need, why)

    for layout in layouts(m, cluster, seq_len, sequences=sequences):
        searched += 1
        layout = dataclasses.replace(layout, documents=documents)
        place = placement(layout, base)
        padded = stacked(params, m, step_for(layout, seq_len))  # the layer stack of uneven stages
        problem = shape_problem(padded, place, model_for(m, layout), seq_len)
        if problem:
            reject(layout, math.inf, problem)
            continue
        ranks = layout.data * layout.fsdp * layout.expert
        per_rank, left = divmod(sequences, ranks * layout.pipeline_microbatches)
        if left or per_rank == 0:
            reject(layout, math.inf, f"{sequences} sequences do not split over {ranks} data-parallel ranks"
                   + (f" x {layout.pipeline_microbatches} pipeline microbatches" if layout.stage > 1 else ""))
            continue
        sized = _sized(m, params, padded, layout, place, per_rank, seq_len, cluster, chunks)
        if isinstance(sized, Candidate):
            found.append(sized)
        else:
            reject(layout, *sized)
    found = merge_identical(sorted(found, key=rank_key))
    families = {c.layout.family for c in found}
    rejected = {fam: why for fam, (_, why) in sorted(closest.items()) if fam not in families}
    ranked = found[:top] if top else found
    piped = next((c for c in found if c.layout.stage > 1), None)
    why = reasons(found, gather_note(m, params, piped, seq_len, cluster) if piped else "", m)
    why += context_line(found) + balance_line(found) + kernel_line(found, m)
    why += expert_lines(found, m, cluster.ep_imbalance, cluster.devices_per_node)
    return Plan(ranked, rejected, searched, sequences, seq_len, cluster, why, m.dtype)


def gather_note(m: ModelConfig, params: Sequence[Param], c: Candidate, seq_len: int, cluster: Cluster) -> str:
    """For a pipeline with FSDP inside its stages: each ``pipeline.fsdp`` mode at the same sizes (memory, wire
    bytes over ``fsdp`` a step, whether idle slots are skipped, step time), the one it runs marked; empty
    without FSDP."""
    if c.layout.fsdp == 1:
        return ""
    parts = []
    for mode in FSDP_GATHERS:
        lay = dataclasses.replace(c.layout, fsdp_gather=mode)
        alt = c if mode == c.layout.fsdp_gather else evaluate(m, params, lay, seq_len, cluster)
        slots = "skipped" if assumed(placement(lay), m, BLOCK_AXES).skip else "masked"
        fits = "" if alt.memory["total"] <= cluster.budget else ", does not fit"
        parts.append(f"{mode}{' (runs)' if alt is c else ''} {_gb(alt.memory['total'])} GB{fits}, "
                     f"{alt.comm['by_axes'].get('fsdp', 0.0) / 1e12:.2f} TB over fsdp, idle slots {slots}, "
                     f"{fmt_time(alt.time['total'])}")
    return "FSDP in a stage (pipeline.fsdp): " + "; ".join(parts)


# -- output --------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x >= 1e8 else f"{x / 1e9:.3f}"


def table(plan: Plan) -> str:
    """The ranked layouts with their memory and time breakdowns, why the first two win, what does not fit."""
    c = plan.cluster
    unit, scale = unit_for(max((x.time["total"] for x in plan.candidates), default=1.0))
    lines = [
        f"{c.nodes} x {c.devices_per_node} {c.device} ({c.devices} device{'s' * (c.devices != 1)}, "
        f"{_gb(c.budget)} GB usable each); "
        f"global batch {plan.global_batch} x {plan.seq_len} tokens; {plan.searched} layouts searched",
        "",
        f"{'#':>2}  {'layout':<52} {'zero':>4} {'remat':<9} {'b':>3} {'acc':>4}  "
        f"{'copy':>6} {'master':>6} {'adam':>6} {'grads':>6} {'act':>6} {'peak':>6} {'total':>6} GB  "
        f"{'comp':>7} {'comm':>7} {'expo':>7} {'bubl':>7} "
        f"{'step':>7} {unit:<2}  {'MFU':>5}",
    ]

    def num(x: float) -> str:
        return f"{x * scale:>7.{3 if x * scale < 10 else 2}f}"

    for i, cand in enumerate(plan.candidates, 1):
        lay, mem, t = cand.layout, cand.memory, cand.time
        peak = mem["transient"] + mem.get("mask", 0.0) + mem.get("embedding", 0.0) + mem.get("head", 0.0)
        grads = mem["gradients"] + mem["accumulator"] + mem.get("pipeline accumulator", 0.0)
        zero = "/".join([str(lay.zero_stage)] + [s.rsplit("zero", 1)[1] for s in cand.same if "zero" in s])
        lines.append(
            f"{i:>2}  {lay.describe():<52} {zero:>4} {lay.remat:<9} {lay.micro_batch:>3} "
            f"{lay.accumulation:>4}  {_gb(mem['params']):>6} {_gb(mem.get('master', 0.0)):>6} "
            f"{_gb(mem['optimizer']):>6} {_gb(grads):>6} {_gb(mem['activations']):>6} {_gb(peak):>6} "
            f"{_gb(mem['total']):>6}     {num(t['compute'])} {num(t['communication'])} {num(t['exposed'])} "
            f"{num(t['bubble'])} {num(t['total'])}     {100 * t['mfu']:>4.1f}%"
        )
    if not plan.candidates:
        lines.append("   (no layout fits)")
    if plan.reasons:
        lines += ["", "why:"] + [f"  {r}" for r in plan.reasons]
    if plan.rejected:
        lines += ["", "families that never fit (the closest attempt):"]
        merged: dict[str, list[str]] = {}
        for fam, why in plan.rejected.items():
            merged.setdefault(why, []).append(fam)
        lines += [f"  {' = '.join(fams):<22} {why}" for why, fams in merged.items()]
    lines += [
        "",
        "copy = the compute copy, master = the fp32 master apart from it (jaxscale/precision/policy.py), adam = the "
        "moments, grads = gradients (+ fp32 accumulator); playbook: ZeRO-1 2Ψ + 2Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, "
        "ZeRO-3 16Ψ/N; act = the layers' saved activations and "
        "peak = one layer's backward or the loss, whichever is larger, + the gathered head and its gradient "
        f"(ZeRO-3) and the whole embedding table and its gradient (SP), in {plan.dtype} "
        "(--verify compiles in float32 and says so); zero 1/2: identical rows merged.",
        f"time ({unit}): comp = matmuls and attention at the efficiency their shapes reach on "
        f"{c.peak_flops / 1e12:.0f} TFLOP/s, memory-bound ops at {c.memory_bandwidth / 1e9:.0f} GB/s, recompute; "
        f"comm = all collectives ({c.intra_bandwidth / 1e9:.0f} GB/s within a node, {c.inter_bandwidth / 1e9:.1f} "
        "GB/s across, plus latency); expo = the part not hidden behind compute; bubl = pipeline bubble. "
        f"Cluster figures: {c.source or 'as given'}.",
    ]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "cluster": dataclasses.asdict(plan.cluster),
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "searched": plan.searched,
        "candidates": [
            {"layout": dataclasses.asdict(c.layout), "family": c.layout.family, "memory": c.memory, "time": c.time,
             "comm": c.comm, "same": c.same}
            for c in plan.candidates
        ],
        "rejected": plan.rejected,
        "reasons": plan.reasons,
    }
