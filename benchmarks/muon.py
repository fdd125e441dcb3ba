"""Muon against AdamW and optax.contrib.muon on 8 simulated CPU devices under zero3, as JSON lines.

    python benchmarks/muon.py > muon.json

``update`` lines: the optimizer's update alone (the tiny model's parameters, 8 layers, laid out by zero3 over
``fsdp`` = 8, its gradients given), jitted with the state donated: the collectives of the compiled program
(wire bytes per device, by kind), its temporary memory per device, and the median time of ``--runs`` updates.
``optax_muon`` is optax.contrib.muon given the same dimension numbers: its Newton-Schulz runs on whatever shards
the partitioner chooses. ``step`` lines: the whole train step of the same model (``--batch`` x ``--seq`` tokens),
AdamW and Muon, the median time of ``--runs`` steps, and the formula's Newton-Schulz share of the step's FLOPs
(``5 * (4 m^2 n + 2 m^3)`` per ``m x n`` matrix, ``m <= n``, over the step's FLOPs: about ``5 * width / tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.analysis import hlo
from jaxscale.config.read import load_config
from jaxscale.layout.sharding import named_params, use_rules
from jaxscale.training.muon import muon
from jaxscale.training.muon_layout import fans, is_hidden_matrix
from jaxscale.training.optim import make_optimizer
from jaxscale.training.trainer import Trainer

MESH = ["mesh.data=1", "mesh.fsdp=8", "rules=zero3", "model=tiny", "model.layers=8", "data.max_bytes=2000000"]


def timed(fn, runs: int) -> float:
    """The median seconds of ``runs`` calls of ``fn`` (after one warm-up call), each waited for."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def optax_dims(axes):
    """optax.contrib.muon's dimension numbers for the hidden matrices (their fan-in and fan-out dimensions)."""
    def each(a):
        if not is_hidden_matrix(a):
            return None
        first = next(i for i, n in enumerate(a) if n not in ("layers", "expert", None))
        split = len(a) - 1 if a[-1] == "embed" else first + 1
        return optax.contrib.MuonDimensionNumbers(tuple(range(first, split)), tuple(range(split, len(a))))
    return jax.tree.map(each, axes, is_leaf=lambda x: isinstance(x, tuple))


def update_row(name: str, trainer: Trainer, opt: optax.GradientTransformation, runs: int) -> dict:
    """The optimizer's update alone on the trainer's zero3 layout: collectives, temporary memory, time."""
    shardings = trainer.param_shardings("optimizer")
    params = jax.device_put(trainer.init_state().params, shardings)
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    # Each state leaf shaped as a parameter is laid out as it (the trainer's optax.tree_map_params cannot read
    # optax.contrib.muon's tree of dimension numbers); the rest replicated.
    by_shape = {p.shape: s for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)}
    replicated = NamedSharding(trainer.mesh, PartitionSpec())
    state_shardings = jax.tree.map(lambda x: by_shape.get(x.shape, replicated), jax.eval_shape(opt.init, params))
    state = jax.jit(opt.init, out_shardings=state_shardings)(params)

    def update(grads, state, params):
        with use_rules(trainer.mesh, trainer.rules):
            updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(update, out_shardings=(shardings, state_shardings), donate_argnums=(1, 2))
    compiled = jitted.lower(grads, state, params).compile()
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    box = {"state": state, "params": params}

    def once():
        box["params"], box["state"] = compiled(grads, box["state"], box["params"])
        return box["params"]

    return {"what": "update", "optimizer": name,
            "collectives": {k: round(v["wire_bytes"]) for k, v in hlo.summarize(found)["by_kind"].items()},
            "count": len(found), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "seconds": round(timed(once, runs), 5)}


def ns_flops(trainer: Trainer, steps: int = 5) -> float:
    """The Newton-Schulz FLOPs of one step over every hidden matrix (module docstring)."""
    total = 0.0
    for _, leaf, axes in named_params(trainer.abstract_params, trainer.axes):
        if is_hidden_matrix(axes):
            m, n = sorted(fans(leaf.shape, axes))
            stack = leaf.size // (m * n)
            total += stack * steps * (4 * m * m * n + 2 * m**3)
    return total


def compiled_step(optimizer: str, batch: int, seq: int) -> tuple[Trainer, object]:
    """The trainer of the whole train step with ``optimizer``, and its compiled step."""
    config = load_config(None, [*MESH, f"train.optimizer={optimizer}", f"train.global_batch={batch}",
                                f"train.seq_len={seq}"])
    trainer = Trainer.build(config)
    return trainer, trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()


def step_rows(batch: int, seq: int, runs: int) -> list[dict]:
    """AdamW's and Muon's whole train steps, timed in turn (one of each per round, so that the load of a shared
    host weighs on both alike): their median seconds."""
    steps = {o: compiled_step(o, batch, seq) for o in ("adamw", "muon")}
    states = {o: t.init_state() for o, (t, _) in steps.items()}
    data = steps["adamw"][0].batch(0)
    times: dict[str, list[float]] = {o: [] for o in steps}
    for r in range(runs + 1):
        for o, (_, compiled) in steps.items():
            start = time.perf_counter()
            states[o], out = compiled(states[o], data)
            jax.block_until_ready(out)
            if r:  # the first round warms up
                times[o].append(time.perf_counter() - start)
    rows = [{"what": "step", "optimizer": o, "tokens": batch * seq, "seconds": round(statistics.median(t), 5)}
            for o, t in times.items()]
    rows[1]["ns_share_of_flops"] = round(ns_flops(steps["muon"][0]) / steps["muon"][0].flops_per_step, 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    trainer = Trainer.build(load_config(None, MESH))
    dims = optax_dims(trainer.axes)
    names = [name for name, _, axes in named_params(trainer.abstract_params, trainer.axes) if is_hidden_matrix(axes)]
    optimizers = {
        "adamw": make_optimizer(trainer.config.train, trainer.axes),
        "muon": muon(1e-3, trainer.axes),
        "muon_fp32": muon(1e-3, trainer.axes, ns_dtype=jnp.float32),
        "optax_muon": optax.contrib.muon(1e-3, consistent_rms=0.2, muon_weight_dimension_numbers=dims),
    }
    print(json.dumps({"what": "hidden_matrices", "names": names}), flush=True)
    for name, opt in optimizers.items():
        print(json.dumps(update_row(name, trainer, opt, args.runs)), flush=True)
    rows = step_rows(args.batch, args.seq, args.runs)
    for row in rows:
        print(json.dumps(row), flush=True)
    print(json.dumps({"what": "step_overhead", "muon_over_adamw": round(rows[1]["seconds"] / rows[0]["seconds"] - 1, 4),
                      "predicted": rows[1]["ns_share_of_flops"]}), flush=True)


if __name__ == "__main__":
    main()
