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
   that fits is taken (the playbook's recipe, FORMULAS.md "Batch size").
3. **Maximise throughput.** Rank by predicted step time: compute at the cluster's stated
   efficiency, the pipeline bubble, and the communication that cannot hide
   (:func:`jaxscale.analysis.timing.step_time`); within 0.1% the simpler layout (fewer strategies),
   then the smaller memory, comes first.

Every layout is data: :func:`rules_for` writes its rules table (starting from
``configs/rules/dp.yaml``, so every logical name the model uses is present) and
:func:`experiment` the experiment file ``jaxscale train`` runs. :mod:`jaxscale.analysis.verify` compiles
candidates on simulated devices and puts the compiled memory and collective bytes next to
the prediction.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxscale.analysis.communication import communication, summarize_flows
from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import Param, Step
from jaxscale.analysis.timing import Cluster, step_time
from jaxscale.config import CONFIG_DIR, MESH_AXES, Config, ConfigError, ModelConfig, _read_yaml
from jaxscale.layout import Layout, Rules

REMATS = ("none", "save_dots", "full")
TP_NAMES = ("heads", "kv_heads", "mlp", "vocab", "expert_mlp")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run the step: mesh sizes, ZeRO stage on ``data``, remat and the batch split."""

    data: int = 1
    fsdp: int = 1  # ZeRO-3 when > 1
    tensor: int = 1
    sequence: bool = False  # Megatron SP on the tensor axis
    context: int = 1
    stage: int = 1
    expert: int = 1
    zero: int = 0  # over data: 1 shards the optimizer state, 2 the gradients too
    remat: str = "none"
    micro_batch: int = 1  # sequences per data-parallel rank in one forward/backward
    accumulation: int = 1
    pipeline_microbatches: int = 1
    repeats: int = 1

    def mesh(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.mesh().values())

    @property
    def zero_stage(self) -> int:
        return 3 if self.fsdp > 1 else self.zero

    @property
    def family(self) -> str:
        """The combination of strategies, e.g. ``ZeRO-3 + TP + SP``."""
        parts = [["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"][self.zero_stage]]
        parts += ["TP + SP" if self.sequence else "TP"] if self.tensor > 1 else []
        parts += ["CP"] if self.context > 1 else []
        parts += ["PP"] if self.stage > 1 else []
        parts += ["EP"] if self.expert > 1 else []
        return " + ".join(parts)

    @property
    def mesh_text(self) -> str:
        return " ".join(f"{a}={s}" for a, s in self.mesh().items() if s > 1) or "one device"

    def describe(self) -> str:
        text = self.mesh_text + ("" if not self.sequence else " +sp")
        if self.zero and self.data > 1:
            text += f" zero{self.zero}"
        if self.stage > 1:
            text += f" m={self.pipeline_microbatches}" + (f" v={self.repeats}" if self.repeats > 1 else "")
        return text


def base_rules() -> dict[str, Any]:
    """The data-parallel preset: every logical name the model uses, replicated but for the batch."""
    return _read_yaml(CONFIG_DIR / "rules" / "dp.yaml")["rules"]


def rules_for(layout: Strategy, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rules file (``rules``, ``optimizer``, ``gradients`` sections) that runs ``layout``."""
    rules = dict(base_rules() if base is None else base)
    batch = ["data", "fsdp"] + (["expert"] if layout.expert > 1 else [])
    rules["batch"] = batch
    if layout.fsdp > 1:
        rules["embed"] = "fsdp"
    if layout.tensor > 1:
        for name in TP_NAMES:
            if name in rules:
                rules[name] = "tensor"
    norm = (["context"] if layout.context > 1 else []) + (["tensor"] if layout.sequence else [])
    rules["norm_length"] = norm[0] if len(norm) == 1 else norm or None
    if layout.context > 1:
        rules["length"] = "context"
    if layout.stage > 1:
        rules["layers"] = "stage"
    if layout.expert > 1 and "expert" in rules:
        rules["expert"] = "expert"
    out: dict[str, Any] = {"rules": rules}
    if layout.zero >= 1 and layout.data > 1:
        out["optimizer"] = {"embed": ["data", "fsdp"]}
    if layout.zero >= 2 and layout.data > 1:
        out["gradients"] = {"embed": ["data", "fsdp"]}
    return out


def placement(layout: Strategy, base: dict[str, Any] | None = None) -> Layout:
    """The rules table of ``layout`` on its mesh sizes: what the analytic model and the runtime both ask."""
    return Layout(Rules.from_dict(layout.family, rules_for(layout, base)), layout.mesh())


def model_for(m: ModelConfig, layout: Strategy) -> ModelConfig:
    """The model config the layout runs: its remat policy; ring attention under context parallelism."""
    out = copy.copy(m)
    out.remat = layout.remat
    if layout.context > 1:
        out.attention = "ring"
    return out


def step_for(layout: Strategy, seq_len: int) -> Step:
    rows = layout.micro_batch * layout.pipeline_microbatches * layout.accumulation
    return Step(rows * layout.data * layout.fsdp * layout.expert, seq_len, layout.accumulation,
                layout.pipeline_microbatches, layout.repeats)


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
    layers = place.ways(("layers",))
    if m.layers % layers:
        return f"{m.layers} layers not divisible by {layers} stages"
    return None


@dataclasses.dataclass
class Candidate:
    """A layout that fits, with its prediction."""

    layout: Strategy
    memory: dict[str, float]
    comm: dict[str, Any]
    time: dict[str, float]


@dataclasses.dataclass
class Plan:
    """The ranked layouts, and for each family that never fit, why."""

    candidates: list[Candidate]
    rejected: dict[str, str]
    searched: int
    global_batch: int
    seq_len: int
    cluster: Cluster


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipelines(m: ModelConfig, devices: int, max_stages: int) -> Iterator[tuple[int, int, int]]:
    """(stages, pipeline microbatches, repeats): GPipe with m = p, 2p, 4p, 8p; circular with v = 2."""
    yield 1, 1, 1
    for p in _divisors(devices):
        if p == 1 or p > max_stages or m.layers % p:
            continue
        for mult in (1, 2, 4, 8):
            yield p, mult * p, 1
            if m.layers % (2 * p) == 0:
                yield p, mult * p, 2


def layouts(m: ModelConfig, cluster: Cluster, seq_len: int, max_stages: int = 16) -> Iterator[Strategy]:
    """Every combination of mesh sizes, ZeRO stage and remat policy for the cluster (micro-batch 1)."""
    devices = cluster.devices
    moe = m.moe
    tensors = [t for t in _divisors(min(devices, cluster.devices_per_node)) if m.kv_heads % t == 0]
    contexts = [c for c in _divisors(devices) if seq_len % c == 0 and (c == 1 or seq_len // c >= 512)]
    experts = [e for e in _divisors(devices) if moe is not None and moe.experts % e == 0] or [1]
    for t, sp, c, e, (p, mb, v) in itertools.product(
        tensors, (False, True), contexts, experts, _pipelines(m, devices, max_stages)
    ):
        if (sp and t == 1) or (p > 1 and (sp or c > 1)):  # the pipeline runs neither SP nor CP in a stage
            continue
        rest, left = divmod(devices, t * c * e * p)
        if left:
            continue
        for f in _divisors(rest):
            d = rest // f
            for zero, remat in itertools.product((0, 1, 2) if d > 1 and f == 1 else (0,), REMATS):
                yield Strategy(d, f, t, sp, c, p, e, zero, remat, 1, 1, mb, v)


def search(
    m: ModelConfig,
    params: Sequence[Param],
    cluster: Cluster,
    global_batch_tokens: int,
    seq_len: int,
    top: int = 10,
) -> Plan:
    """Steps 1-3: the layouts that fit and reach the batch, fastest first; why the other families fail."""
    if global_batch_tokens % seq_len:
        raise ConfigError(f"--global-batch-tokens ({global_batch_tokens}) is not a multiple of --seq-len ({seq_len})")
    sequences = global_batch_tokens // seq_len
    base = base_rules()
    found: list[Candidate] = []
    closest: dict[str, tuple[float, str]] = {}
    searched = 0

    def reject(layout: Strategy, need: float, why: str) -> None:
        if layout.family not in closest or need < closest[layout.family][0]:
            closest[layout.family] = (need, why)

    for layout in layouts(m, cluster, seq_len):
        searched += 1
        place = placement(layout, base)
        model = model_for(m, layout)
        problem = shape_problem(params, place, model, seq_len)
        if problem:
            reject(layout, math.inf, problem)
            continue
        ranks = layout.data * layout.fsdp * layout.expert
        per_rank, left = divmod(sequences, ranks * layout.pipeline_microbatches)
        if left or per_rank == 0:
            reject(layout, math.inf, f"{sequences} sequences do not split over {ranks} data-parallel ranks"
                   + (f" x {layout.pipeline_microbatches} pipeline microbatches" if layout.stage > 1 else ""))
            continue
        for b in sorted(_divisors(per_rank), reverse=True):
            sized = dataclasses.replace(layout, micro_batch=b, accumulation=per_rank // b)
            step = step_for(sized, seq_len)
            mem = memory(model, params, place, step)
            if mem["total"] <= cluster.budget:
                flows = communication(model, params, place, step)
                time = step_time(model, flows, place, step, cluster)
                found.append(Candidate(sized, mem, summarize_flows(flows), time))
                break
            if b == 1:
                reject(layout, mem["total"], f"needs {mem['total'] / 1e9:.1f} GB per device at micro-batch 1 "
                       f"({layout.describe()}, remat {layout.remat}) > {cluster.budget / 1e9:.1f} GB")
    # Fastest first; within 0.1% the layout with fewer strategies, then the smaller memory.
    found.sort(key=lambda c: (round(math.log(c.time["total"]) / math.log(1.001)), c.layout.family.count("+"),
                              c.memory["total"]))
    families = {c.layout.family for c in found}
    rejected = {fam: why for fam, (_, why) in sorted(closest.items()) if fam not in families}
    return Plan(found[:top] if top else found, rejected, searched, sequences, seq_len, cluster)


# -- output --------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def table(plan: Plan) -> str:
    """The ranked layouts with their memory and time breakdowns, and the families that do not fit."""
    c = plan.cluster
    lines = [
        f"{c.nodes} x {c.devices_per_node} {c.device} ({c.devices} devices, {_gb(c.budget)} GB usable each); "
        f"global batch {plan.global_batch} x {plan.seq_len} tokens; {plan.searched} layouts searched",
        "",
        f"{'#':>2}  {'layout':<40} {'zero':>4} {'remat':<9} {'b':>3} {'acc':>4}  "
        f"{'state':>6} {'act':>6} {'peak':>6} {'total':>6} GB  {'comp':>6} {'comm':>6} {'expo':>6} {'bubl':>6} "
        f"{'step':>7} s  {'MFU':>5}",
    ]
    for i, cand in enumerate(plan.candidates, 1):
        lay, mem, t = cand.layout, cand.memory, cand.time
        state = mem["params"] + mem["optimizer"] + mem["gradients"] + mem["accumulator"]
        peak = mem["transient"] + mem.get("mask", 0.0)
        lines.append(
            f"{i:>2}  {lay.describe():<40} {lay.zero_stage:>4} {lay.remat:<9} {lay.micro_batch:>3} "
            f"{lay.accumulation:>4}  {_gb(state):>6} {_gb(mem['activations']):>6} {_gb(peak):>6} "
            f"{_gb(mem['total']):>6}     {t['compute']:>6.2f} {t['communication']:>6.2f} {t['exposed']:>6.2f} "
            f"{t['bubble']:>6.2f} {t['total']:>7.2f}    {100 * t['mfu']:>4.1f}%"
        )
    if not plan.candidates:
        lines.append("   (no layout fits)")
    if plan.rejected:
        lines += ["", "families that never fit (the closest attempt):"]
        lines += [f"  {fam:<22} {why}" for fam, why in plan.rejected.items()]
    lines += [
        "",
        "state = parameters + Adam + gradients (+ accumulator), fp32; act = the layers' saved activations; "
        "peak = one layer's backward or the loss, whichever is larger.",
        f"time: compute at {100 * c.compute_efficiency:.0f}% of {c.peak_flops / 1e12:.0f} TFLOP/s; comm = all "
        f"collectives at {c.intra_bandwidth / 1e9:.0f} GB/s within a node, {c.inter_bandwidth / 1e9:.1f} GB/s "
        "across; expo = the part not hidden behind compute; bubl = pipeline bubble.",
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
             "comm": c.comm}
            for c in plan.candidates
        ],
        "rejected": plan.rejected,
    }


def experiment(layout: Strategy, model: dict[str, Any], seq_len: int, rules_path: str) -> dict[str, Any]:
    """The experiment ``jaxscale train`` runs for ``layout``: the model inline, the rules file by path."""
    overrides: dict[str, Any] = {"remat": layout.remat}
    if layout.context > 1:
        overrides["attention"] = "ring"
    out: dict[str, Any] = {
        "run_dir": "runs/plan",
        "rules": rules_path,
        "model": {**model, **overrides},
        "mesh": layout.mesh(),
        "train": {
            "global_batch": layout.micro_batch * layout.pipeline_microbatches * layout.accumulation
            * layout.data * layout.fsdp * layout.expert,
            "seq_len": seq_len,
            "microbatches": layout.accumulation,
        },
    }
    if layout.stage > 1:
        out["pipeline"] = {
            "microbatches": layout.pipeline_microbatches,
            "repeats": layout.repeats,
            "schedule": "circular" if layout.repeats > 1 else "gpipe",
        }
    return out


def write_experiment(layout: Strategy, model: dict[str, Any], seq_len: int, path: str | Path) -> tuple[Path, Path]:
    """Write ``path`` (the experiment) and ``<stem>.rules.yaml`` next to it; returns both paths."""
    path = Path(path)
    rules_path = path.with_name(path.stem + ".rules.yaml")
    header = f"# {layout.family}: {layout.describe()}, remat {layout.remat}; written by jaxscale plan\n"
    rules_path.write_text(header + yaml.safe_dump(rules_for(layout), sort_keys=False))
    exp = experiment(layout, model, seq_len, str(rules_path.resolve()))
    path.write_text(header + yaml.safe_dump(exp, sort_keys=False))
    return path, rules_path


def config_for(layout: Strategy, model: dict[str, Any], seq_len: int, overrides: Sequence[str] = ()) -> Config:
    """The experiment of ``layout`` as a :class:`Config` (its rules written to a temporary file)."""
    import tempfile

    from jaxscale.config import load_config

    directory = Path(tempfile.mkdtemp(prefix="jaxscale-plan-"))
    path, _ = write_experiment(layout, model, seq_len, directory / "experiment.yaml")
    return load_config(path, [f"run_dir={directory / 'run'}", *overrides])
