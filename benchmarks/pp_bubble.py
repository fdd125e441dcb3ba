"""Pipeline schedules on 8 simulated CPU devices: ticks, bubble, bytes, memory and step time, as JSON.

    python benchmarks/pp_bubble.py                     # every schedule, p in {2, 4}, m in {p, 2p, 4p}
    python benchmarks/pp_bubble.py --schedules 1f1b --stages 4 --steps 5

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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import numpy as np

from jaxscale.analysis import hlo, xla
from jaxscale.config import INTERLEAVED, load_config
from jaxscale.parallel import schedules
from jaxscale.train import Trainer

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
    pipe = [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}"]
    trainer = build("pp", {"stage": p, "data": 8 // p}, pipe)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(REPEATS), choices=list(REPEATS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
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
