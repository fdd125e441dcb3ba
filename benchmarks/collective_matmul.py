"""Collective matmul (``model.tp_overlap``), compiled (not run) on 8 simulated CPU devices: the layer's collectives.

    python benchmarks/collective_matmul.py    # one JSON object per line

For t = 2, 4, 8 (``rules=tp_sp``, mesh ``data=8/t, tensor=t``) and tp_overlap false / true, the
train step is compiled and read:

* ``layer``: the collectives over ``tensor`` in the layer scan, per layer, by pass and kind: how many,
  the size each (all-gather: result, others: operand) and their wire bytes per device;
* ``formula``: docs/formulas.md's TP + SP figure per layer and pass, 4·(t−1)/t·b·s·h·bytes (2 all-gathers
  and 2 reduce-scatters), and the collective matmul's 4·(t−1) permutes of b·s·h/t;
* ``wire_bytes_by_axes``: the whole step's wire bytes per device per mesh axis;
* ``memory``: ``compiled.memory_analysis()`` per device.

CPU shows the program, not the overlap: XLA:CPU runs collective-permutes synchronously. The model
has 4 layers of h = 256 (fp32), 16 sequences of 256 tokens a step.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxscale.analysis import hlo, xla
from jaxscale.config.read import load_config
from jaxscale.training.trainer import Trainer

MODEL = [
    "model.vocab_size=256",
    "model.embed=256",
    "model.layers=4",
    "model.heads=8",
    "model.kv_heads=8",
    "model.head_dim=32",
    "model.mlp=1024",
    "train.global_batch=16",
    "train.seq_len=256",
    "data.max_bytes=100000",
]


def measure(t: int, overlap: bool) -> dict:
    mesh = [f"mesh.{a}=1" for a in ("stage", "fsdp", "context", "expert")]
    config = load_config(
        None, [*MODEL, *mesh, f"mesh.data={8 // t}", f"mesh.tensor={t}", "rules=tp_sp", f"model.tp_overlap={overlap}"]
    )
    trainer = Trainer.build(config)
    compiled = xla.compile_step(trainer)
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    layers = config.model.layers
    layer: dict[str, dict] = defaultdict(lambda: {"count": 0, "size": 0, "wire_bytes": 0.0})
    for c in hlo.in_loop(found, trips=layers):
        if c.axes == ("tensor",):
            row = layer[f"{c.phase} {c.kind}"]
            row["count"] += 1
            row["size"] = max(row["size"], c.size)
            row["wire_bytes"] += c.wire_bytes / layers
    bsh = config.train.global_batch // (8 // t) * config.train.seq_len * config.model.embed * 4
    return {
        "t": t,
        "tp_overlap": overlap,
        "layer": dict(sorted(layer.items())),
        "formula": {"sp_wire_bytes_per_pass": 4 * (t - 1) / t * bsh, "cm_permutes_per_pass": 4 * (t - 1),
                    "cm_permute_bytes": bsh // t},
        "wire_bytes_by_axes": {k: v["wire_bytes"] for k, v in hlo.summarize(found)["by_axes"].items()},
        "memory": xla.memory(compiled),
    }


if __name__ == "__main__":
    for t in (2, 4, 8):
        for overlap in (False, True):
            print(json.dumps(measure(t, overlap)), flush=True)
