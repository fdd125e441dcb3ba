"""Pipeline schedules on 8 simulated CPU devices: ticks, bubble, bytes, memory and step time, as JSON.

    python benchmarks/pp_bubble.py                     # every schedule, p in {2, 4}, m in {p, 2p, 4p}
    python benchmarks/pp_bubble.py --schedules 1f1b --stages 4 --steps 5
    python benchmarks/pp_bubble.py --inside --stages 2 4   # FSDP and TP inside a stage, 1F1B at m = 4p
    python benchmarks/pp_bubble.py --zero-bubble --stages 2 4   # ZB-H1 against 1F1B: memory, bubble, time
    python benchmarks/pp_bubble.py --moe --stages 2 4   # experts inside a stage (pp_ep), 1F1B at m = 4p

One JSON object per line: first the same model without a pipeline (``rules=dp``, data = 8), then for
each schedule and (p, m, v) the step on mesh ``stage=p`` x ``data=8/p`` (``rules=pp``):

* ``ticks``: the pipeline loop's trip count in the compiled HLO, next to the table's;
* ``bubble``: the step time lost to the schedule, counted from the table the loop runs (a backward
  = 3 forwards: the stage recomputed, then its backward), next to (p − 1)/(v·m + p − 1);
* ``permute_bytes``: collective-permute wire bytes per device per step over ``stage``, next to the
  playbook's 2·v·m·b·s·h·bytes and to 2·ticks·b·s·h·bytes (the bubble's ticks send too);
* ``stash``: microbatches a device keeps (the table's activation slots) and the bytes of their
  layers' inputs;
* ``memory``: ``compiled.memory_analysis()`` per device;
* ``step_time``: median seconds of ``--steps`` steps, and its ratio to the step without a pipeline,
  next to (v·m + p − 1)/(v·m) and the issue's goal for 1F1B, (m + p − 1)/m + 0.1.

On simulated devices the 8 "devices" share this machine's cores: an idle slot skipped by the loop's
conditional frees a core for another stage, so the ratio measures the work a schedule adds (the
stage recompute, the messages) more than its bubble, which the table's count gives instead. The
model has 8 layers of h = 256 (fp32), 32 sequences of 128 tokens a step; b = 32 / m / (8 / p) rows
of a microbatch on a device.

``--inside`` measures the pipeline with FSDP and TP inside each stage against the same axes without
one, 1F1B at m = 4p: ``pp_fsdp_tp`` on ``stage=p`` x ``fsdp=4/p`` x ``tensor=2`` against ``fsdp_tp`` on
``fsdp=4`` x ``tensor=2`` (step time ratio next to (m + p − 1)/m), and ``pp_fsdp`` on ``stage=2`` x
``fsdp=4`` against ``fsdp`` 8 (``zero3``): collective wire bytes per device per step from the compiled
step, the pipeline's next to the reference's plus its permutes.

``--moe`` measures the model with MoE blocks (8 experts, top 2, capacity dispatch) on ``pp_ep``, ``stage=p`` x
``expert=2`` x ``data=4/p``, 1F1B at m = 4p, against ``ep`` on ``data=4`` x ``expert=2`` without a pipeline
(explicit experts), each ``model.moe.impl``: ``partitioner`` (the stage's loop manual over ``stage`` alone,
idle slots computed and masked) and ``shard_map`` (manual over every axis, idle slots skipped): the step
time ratio next to (m + p − 1)/m.

``--zero-bubble`` compares ZB-H1 with 1F1B on ``pp`` (``stage=p`` x ``data=8/p``) for m in {p, 2p, 4p}: the
compiled step's temporaries per device and ZB-H1's extra over 1F1B, next to the table's figure for the
buffers a stage keeps (stage inputs ``act_slots``, each a chunk's L/p layers of b·s·h; what B keeps for W
``cot_slots``, each layer's weight matmul inputs and output gradients, ``activations.split_kept``; the received
gradients ``grad_slots`` of b·s·h); the ticks; the bubble in the paper's units (F = B = W = 1) and in ours
(F 1, B 2: it recomputes the chunk; W 1: the weight matmuls' gradients alone; 1F1B's backward 3), with the
step cost in ours, and the schedules' formulas (:func:`schedules.formula_bubble`); and the step time ratio
ZB-H1 / 1F1B. Its first line: the FLOPs of one layer's B (recomputing it: its input gradient and every
gradient but its weight matmuls'), W (the weight matmuls' gradients from the inputs and output gradients B
kept) and of the unsplit backward, per forward, from XLA's cost analysis.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.analysis import hlo, xla
from jaxscale.analysis.activations import split_kept
from jaxscale.config.read import INTERLEAVED, MESH_AXES, load_config
from jaxscale.layout.rules import Rules, Stage
from jaxscale.layout.sharding import layout_of, use_layout
from jaxscale.parallel import schedules, weight_split
from jaxscale.training.trainer import Trainer, make_model

MODEL = [
    "model.vocab_size=256",
    "model.embed=256",
    "model.layers=8",
    "model.heads=8",
    "model.kv_heads=4",
    "model.head_dim=32",
    "model.mlp=1024",
    "train.global_batch=32",
    "train.seq_len=128",
    "data.max_bytes=100000",
]
REPEATS = {s: 2 if s in INTERLEAVED else 1 for s in schedules.SCHEDULES}  # chunks per stage of each schedule


def build(rules: str, mesh: dict[str, int], pipe: list[str]) -> Trainer:
    sizes = [f"mesh.{a}={mesh.get(a, 1)}" for a in ("stage", "data", "fsdp", "context", "expert", "tensor")]
    return Trainer.build(load_config(None, [*MODEL, *sizes, f"rules={rules}", *pipe]))


def step_time(trainer: Trainer, compiled, steps: int) -> float:
    """Median seconds of ``steps`` compiled steps (after one warm-up step)."""
    state, batch = trainer.init_state(), trainer.batch(0)
    state, out = compiled(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(schedule: str, p: int, m: int, steps: int, baseline: float) -> dict:
    """One JSON record: the compiled pipelined step's loop, collectives over ``stage``, memory and time."""
    v = REPEATS[schedule]
    trainer = build("pp", {"stage": p, "data": 8 // p}, pipe(schedule, m, v))
    compiled = xla.compile_step(trainer)
    config = trainer.config
    table = schedules.build(schedule, p, m, v)
    itemsize = np.dtype(config.model.dtype).itemsize
    rows = config.train.global_batch // m // (8 // p)  # a microbatch's rows on one device
    act = rows * config.train.seq_len * config.model.embed * itemsize  # b·s·h·bytes
    loop = [c for c in hlo.collectives(compiled.as_text(), trainer.mesh)
            if c.axes == ("stage",) and c.kind == "collective-permute" and c.loops]
    seconds = step_time(trainer, compiled, steps)
    return {
        "schedule": schedule, "p": p, "m": m, "v": v,
        "ticks": {"compiled": sorted({c.loops[-1].trips for c in loop}), "table": table.ticks},
        "bubble": {"table": round(table.bubble(), 4), "formula": round(schedules.formula_bubble(p, m, v), 4)},
        "permute_bytes": {
            "compiled": sum(c.wire_bytes for c in loop),
            "formula": 2 * v * m * act,
            "formula_every_tick": 2 * table.ticks * act,
        },
        "stash": {"microbatches": table.act_slots, "bytes": table.act_slots * config.model.layers // (p * v) * act},
        "memory": xla.memory(compiled),
        "step_time": {
            "seconds": round(seconds, 4),
            "ratio_to_no_pipeline": round(seconds / baseline, 3),
            "bubble_ratio": round((v * m + p - 1) / (v * m), 3),
            "goal_1f1b": round((m + p - 1) / m + 0.1, 3),
        },
    }


def wire(compiled, trainer: Trainer) -> dict[str, float]:
    """Collective wire bytes per device per step of a compiled step (an all-reduce only sliced read as the
    reduce-scatter GPU and TPU run): all, and the permutes over ``stage``."""
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    permutes = sum(c.wire_bytes for c in found if c.kind == "collective-permute" and c.axes == ("stage",))
    return {"all": sum(c.rs_wire_bytes for c in found), "permutes": permutes}


def inside(stages: list[int], steps: int) -> None:
    """One JSON line per comparison: FSDP and TP inside a stage against the same axes unpipelined."""
    for p in stages:
        m = 4 * p
        ref = build("fsdp_tp", {"fsdp": 4, "tensor": 2}, [])
        base = step_time(ref, xla.compile_step(ref), steps)
        trainer = build("pp_fsdp_tp", {"stage": p, "fsdp": 4 // p, "tensor": 2}, pipe("1f1b", m))
        seconds = step_time(trainer, xla.compile_step(trainer), steps)
        print(json.dumps({"layout": "pp_fsdp_tp vs fsdp_tp", "schedule": "1f1b", "p": p, "m": m,
                          "seconds": round(seconds, 4), "reference_seconds": round(base, 4),
                          "ratio": round(seconds / base, 3), "formula": round((m + p - 1) / m, 3)}), flush=True)
    ref = build("zero3", {"fsdp": 8}, [])
    trainer = build("pp_fsdp", {"stage": 2, "fsdp": 4}, pipe("1f1b", 8))
    mine, theirs = wire(xla.compile_step(trainer), trainer), wire(xla.compile_step(ref), ref)
    print(json.dumps({"layout": "pp_fsdp (stage 2 x fsdp 4) vs zero3 (fsdp 8)", "schedule": "1f1b", "m": 8,
                      "wire_bytes": mine["all"], "reference_wire_bytes": theirs["all"], "permutes": mine["permutes"],
                      "ratio": round(mine["all"] / (theirs["all"] + mine["permutes"]), 3)}), flush=True)


def moe(stages: list[int], steps: int) -> None:
    """One JSON line per p and ``model.moe.impl``: experts inside a stage against the same axes unpipelined."""
    experts = ["model.moe={experts: 8, top_k: 2}"]
    ref = build("ep", {"data": 4, "expert": 2}, experts)
    base = step_time(ref, xla.compile_step(ref), steps)
    for p in stages:
        m = 4 * p
        for impl in ("partitioner", "shard_map"):
            trainer = build("pp_ep", {"stage": p, "expert": 2, "data": 4 // p},
                            [*experts, f"model.moe.impl={impl}", *pipe("1f1b", m)])
            seconds = step_time(trainer, xla.compile_step(trainer), steps)
            print(json.dumps({"layout": "pp_ep vs ep", "impl": impl, "schedule": "1f1b", "p": p, "m": m,
                              "seconds": round(seconds, 4), "reference_seconds": round(base, 4),
                              "ratio": round(seconds / base, 3), "formula": round((m + p - 1) / m, 3)}), flush=True)


def kept_bytes(table: schedules.Table, layers: int, act: int, kept: float) -> int:
    """The bytes of the buffers a stage keeps through the loop, by the table: inputs, what each layer's B keeps for
    its W (``kept`` times a layer input: :func:`jaxscale.analysis.activations.split_kept`), messages."""
    return round((table.act_slots + table.cot_slots * kept) * layers * act + table.grad_slots * act)


def slot_flops(rows: int = 4) -> dict[str, float]:
    """One layer's forward FLOPs on ``rows`` sequences, and per forward its B (recomputing it: its input gradient
    and every gradient but its weight matmuls', :mod:`jaxscale.parallel.weight_split`), its W (the weight matmuls'
    gradients from the inputs and output gradients B kept) and the unsplit backward (recomputing it), from XLA's
    cost analysis."""
    config = load_config(None, [*MODEL, "model.layers=1"])
    with nnx.use_eager_sharding(False):
        blocks = make_model(config).blocks
    graph, stacked, rest = nnx.split(blocks, nnx.Param, ...)
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(stacked))
    x = jnp.ones((rows, config.train.seq_len, config.model.embed))
    pos = jnp.broadcast_to(jnp.arange(config.train.seq_len), x.shape[:2])

    def layer(p: dict, x: jax.Array) -> jax.Array:
        state = jax.tree.map(lambda a: a[0], stacked)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graph, state, jax.tree.map(lambda a: a, rest))(x, pos)[0]

    def flops(f, *args) -> float:
        return jax.jit(f).lower(*args).compile().cost_analysis()["flops"]

    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=jax.devices()[:1])
    with use_layout(mesh, dataclasses.replace(layout_of(mesh, Rules.load("dp")), stage=Stage((), ()))):
        outs, ins = weight_split.types(lambda: layer(params, x))

        def input_grad(p: dict, x: jax.Array) -> tuple:
            _, pull, kept = jax.vjp(lambda p, x, taps: weight_split.input_grad(lambda: layer(p, x), taps), p, x,
                                      weight_split.zeros(outs), has_aux=True)
            return pull(x), kept  # as below: the cotangent is not the layer's output, which is dead

        def weight_grad(p: dict, kept: list, dys: list) -> dict:
            return jax.vjp(lambda p: weight_split.weight_outputs(lambda: layer(p, x), kept), p)[1](dys)

        forward = flops(layer, params, x)
        slots = {
            "B": flops(input_grad, params, x),
            "W": flops(weight_grad, params, weight_split.zeros(ins), weight_split.zeros(outs)),
            "backward": flops(lambda p, x: jax.vjp(layer, p, x)[1](x), params, x),
        }
    return {"layer_forward_flops": forward, **{k: round(f / forward, 3) for k, f in slots.items()}}


def zero_bubble(stages: list[int], steps: int) -> None:
    """One JSON line per (p, m): ZB-H1 against 1F1B on ``pp``, memory from the compiled step next to the table's."""
    print(json.dumps({"slot_flops_per_forward": slot_flops()}), flush=True)
    for p in stages:
        for m in (p, 2 * p, 4 * p):
            record: dict = {"layout": "pp", "p": p, "m": m}
            for schedule in ("1f1b", "zb_h1"):
                trainer = build("pp", {"stage": p, "data": 8 // p}, pipe(schedule, m))
                compiled, config, table = xla.compile_step(trainer), trainer.config, schedules.build(schedule, p, m, 1)
                rows = config.train.global_batch // m // (8 // p)
                act = rows * config.train.seq_len * config.model.embed * np.dtype(config.model.dtype).itemsize
                record[schedule] = {
                    "ticks": table.ticks, "act_slots": table.act_slots, "cot_slots": table.cot_slots,
                    "kept_bytes": kept_bytes(table, config.model.layers // p, act,
                                             sum(a.per_token for a in split_kept(config.model)) / config.model.embed),
                    "temp_bytes": xla.memory(compiled)["temp"],
                    "bubble_unit": round(table.bubble(1, 2, 1, 1), 4), "bubble": round(table.bubble(), 4),
                    "cost": table.cost(), "seconds": round(step_time(trainer, compiled, steps), 4),
                }
            zb, f1b = record["zb_h1"], record["1f1b"]
            record["extra_temp_bytes"] = {"compiled": zb["temp_bytes"] - f1b["temp_bytes"],
                                          "table": zb["kept_bytes"] - f1b["kept_bytes"]}
            record["formula_bubble"] = {"zb_h1": round(schedules.formula_bubble(p, m, 1, "zb_h1"), 4),
                                             "1f1b": round(schedules.formula_bubble(p, m, 1), 4)}
            record["time_ratio"] = {"measured": round(zb["seconds"] / f1b["seconds"], 3),
                                    "table": round(zb["cost"] / f1b["cost"], 3)}
            print(json.dumps(record), flush=True)


def pipe(schedule: str, m: int, v: int = 1) -> list[str]:
    return [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(REPEATS), choices=list(REPEATS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help="FSDP and TP inside a stage against no pipeline")
    parser.add_argument("--zero-bubble", action="store_true", help="ZB-H1 against 1F1B: memory, bubble, time")
    parser.add_argument("--moe", action="store_true", help="experts inside a stage (pp_ep) against no pipeline")
    args = parser.parse_args()
    if args.inside:
        inside(args.stages, args.steps)
        return
    if args.moe:
        moe(args.stages, args.steps)
        return
    if args.zero_bubble:
        zero_bubble(args.stages, args.steps)
        return
    trainer = build("dp", {"data": 8}, [])
    baseline = step_time(trainer, xla.compile_step(trainer), args.steps)
    print(json.dumps({"schedule": "none (rules=dp, data=8)", "step_time": {"seconds": round(baseline, 4)}}),
          flush=True)
    for schedule in args.schedules:
        for p in args.stages:
            for m in (p, 2 * p, 4 * p):
                print(json.dumps(measure(schedule, p, m, args.steps, baseline)), flush=True)


if __name__ == "__main__":
    main()
