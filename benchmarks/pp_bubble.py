"""Pipeline parallelism, compiled (not run) on simulated CPU devices: schedule, bytes and memory per device.

    python benchmarks/pp_bubble.py            # one JSON object per line, then nothing else

For p = 1, 2, 4 stages (mesh ``stage=p`` on p devices, ``rules=pp``), m in {p, 2p, 4p}
microbatches and v in {1, 2} repeats, the train step is compiled and read:

* ``ticks``: trip count of the pipeline loop in the compiled HLO, next to ``v·m + p − 1``;
* ``bubble``: idle (stage, tick) slots of :func:`jaxscale.parallel.pipeline.schedule`, the table
  the loop runs, next to FORMULAS.md's ``(p−1)/(v·m+p−1)``;
* ``permute_bytes``: collective-permute wire bytes per device per step over ``stage``, next to
  FORMULAS.md's ``2·v·m·b·s·h·bytes`` and to the same counted over every tick of the loop;
* ``stage_all_reduce_bytes``: the all-reduces over ``stage`` outside the loop (the input's gradient
  and the outputs' broadcast, 2·(p−1)/p·m·b·s·h·bytes each, and a few scalars);
* ``stage_reshuffle_bytes``: the other collectives over ``stage`` outside the loop: the circular
  schedule's move of the layer-ordered parameters onto their stages and of their gradients back;
* ``memory``: ``compiled.memory_analysis()`` per device, the parameters per device from their
  shardings, and the temporaries of the same step without the stage remat (``pipeline.remat=false``).

p = 1 is the same model on one device without a pipeline (memory only). The model has 8 layers of
h = 256 (fp32), 32 sequences of 128 tokens a step; b = 32 / m rows per microbatch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import numpy as np

from jaxscale.analysis import hlo, xla
from jaxscale.config import load_config
from jaxscale.parallel import pipeline
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


def build(p: int, m: int, v: int, remat: bool = True) -> Trainer:
    mesh = [f"mesh.{a}=1" for a in ("data", "fsdp", "context", "expert", "tensor")]
    schedule = "circular" if v > 1 else "gpipe"
    pipe = [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}"]
    config = load_config(None, [*MODEL, *mesh, f"mesh.stage={p}", "rules=pp", *pipe, f"pipeline.remat={remat}"])
    return Trainer.build(config, jax.devices()[:p])


def measure(p: int, m: int, v: int) -> dict:
    """One JSON record: the compiled step's pipeline loop, collectives over ``stage`` and memory."""
    trainer = build(p, m, v)
    compiled = xla.compile_step(trainer)
    memory = {"params": xla.state_bytes(trainer)["params"], **xla.memory(compiled)}
    if p == 1:
        return {"p": 1, "schedule": "none (one device, no pipeline)", "memory": memory}
    config = trainer.config
    itemsize = np.dtype(config.model.dtype).itemsize
    rows = config.train.global_batch // m  # data = fsdp = 1: every row of a microbatch is on each stage
    act = rows * config.train.seq_len * config.model.embed * itemsize  # b·s·h·bytes of one microbatch
    stage = [c for c in hlo.collectives(compiled.as_text(), trainer.mesh) if c.axes == ("stage",)]
    loop = [c for c in stage if c.kind == "collective-permute" and c.loops]
    outside = [c for c in stage if c not in loop]
    table = pipeline.schedule(p, m, v)
    memory["temp_without_stage_remat"] = xla.memory(xla.compile_step(build(p, m, v, remat=False)))["temp"]
    return {
        "p": p,
        "m": m,
        "v": v,
        "schedule": config.pipeline.schedule,
        "ticks": {"compiled": sorted({c.loops[-1].trips for c in loop}), "formula": v * m + p - 1},
        "bubble": {"schedule": float((table[..., 0] < 0).mean()), "formula": (p - 1) / (v * m + p - 1)},
        "permute_bytes": {
            "compiled": sum(c.wire_bytes for c in loop),
            "formula": 2 * v * m * act,
            "formula_every_tick": 2 * (v * m + p - 1) * act,
        },
        "stage_all_reduce_bytes": {
            "compiled": sum(c.wire_bytes for c in outside if c.kind == "all-reduce"),
            "input_and_output_formula": 2 * 2 * (p - 1) / p * m * act,
        },
        "stage_reshuffle_bytes": sum(c.wire_bytes for c in outside if c.kind != "all-reduce"),
        "memory": memory,
    }


def main() -> None:
    grid = [(1, 1, 1), *((p, k * p, v) for p in (2, 4) for k in (1, 2, 4) for v in (1, 2))]
    for p, m, v in grid:
        print(json.dumps(measure(p, m, v)), flush=True)


if __name__ == "__main__":
    main()
