"""Ring, Ulysses and USP side by side: one train step's context collectives (compiled, and the analytic model's)
and its step time on 8 simulated devices, as JSON.

The tiny experiment (configs/experiments/tiny.yaml: 4 layers, 8 heads of 16, 4 kv heads, fp32) at ``--seq-len``
tokens, ``fsdp`` 2 x context 4 (batch 2 rows per fsdp shard): ``ring`` (rules ``cp``, ring attention over
context), ``ulysses`` (rules ``ulysses``: all-to-alls over context, blockwise attention on whole sequences)
and ``usp`` (rules ``usp``: all-to-alls over ulysses 2, the ring over context 2). Each step is compiled once,
then ``--steps`` steps are timed after one warm-up (least and median); the wire bytes per device of the
compiled step's all-to-alls and collective-permutes are read from its HLO
(:func:`jaxscale.analysis.inspect.step_collectives`) next to the analytic model's
(:mod:`jaxscale.analysis.context_flows`). CPU step times are a shape of the work, not a GPU's.

    python benchmarks/context_strategies.py [--seq-len 2048] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from jaxscale.analysis.communication import communication
from jaxscale.analysis.inspect import step_collectives
from jaxscale.analysis.params import Step, param_table
from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.layout.sharding import layout_of
from jaxscale.training.trainer import Trainer

STRATEGIES = {
    "ring": ("cp", {"fsdp": 2, "context": 4}, "ring"),
    "ulysses": ("ulysses", {"fsdp": 2, "context": 4}, "blockwise"),
    "usp": ("usp", {"fsdp": 2, "context": 2, "ulysses": 2}, "ring"),
}
KINDS = ("all-to-all", "collective-permute")


def run(name: str, args: argparse.Namespace) -> dict:
    rules, mesh, attention = STRATEGIES[name]
    sizes = {"data": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 1, **mesh}
    config = load_config(CONFIG_DIR / "experiments" / "tiny.yaml", [
        f"rules={rules}", *(f"mesh.{a}={n}" for a, n in sizes.items()), f"model.attention={attention}",
        f"model.attention_block={args.block}", f"train.seq_len={args.seq_len}", "train.global_batch=4",
        "data.max_bytes=4000000"])
    trainer = Trainer.build(config)
    compiled = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    wire = dict.fromkeys(KINDS, 0.0)
    for c in step_collectives(trainer, compiled)[0]:
        if c.kind in wire:
            wire[c.kind] += c.wire_bytes
    flows = communication(config.model, param_table(config), layout_of(trainer.mesh, trainer.rules),
                          Step.from_config(config))
    analytic = {k: sum(f.wire_bytes for f in flows if f.kind == k) for k in KINDS}
    state, batch, times = trainer.init_state(), trainer.batch(0), []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(out)
        if step:
            times.append(time.perf_counter() - start)
    return {"strategy": name, "rules": rules, "mesh": mesh, "attention": attention,
            "context_wire_bytes_compiled": {k: int(v) for k, v in wire.items()},
            "context_wire_bytes_analytic": {k: int(v) for k, v in analytic.items()},
            "step_seconds": {"least": round(min(times), 3), "median": round(float(np.median(times)), 3)},
            "loss": float(out["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"seq_len": args.seq_len, "results": [run(n, args) for n in STRATEGIES]}, indent=1))


if __name__ == "__main__":
    main()
