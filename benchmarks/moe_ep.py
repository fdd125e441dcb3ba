"""Expert parallelism on moe-tiny, measured from compiled steps: prints one JSON object.

* ``all_to_all``: for each expert-parallel size and both dispatch implementations
  (``shard_map``: jaxscale/parallel/expert.py; ``partitioner``: GShard einsum
  dispatch with the rules table alone), the wire bytes per device of the
  collectives over the ``expert`` axis per MoE layer per step, forward and
  backward, parsed from the compiled HLO (:mod:`jaxscale.analysis.hlo`), next to
  FORMULAS.md's ``2·k·b·s·h·bytes·(ep−1)/ep`` each way and to that formula
  times ``E·C / (k·s)``, the padding of fixed-size capacity buffers. Dropless
  dispatch (all-gather + reduce-scatter on XLA:CPU) is listed too, next to
  its own figure ``2·(ep−1)·b·s·h·bytes`` each way.
* ``memory``: compiled per-device memory (``memory_analysis``) and the train
  state's bytes per device versus ep, with the rest of the 8 devices as data.
* ``dropped``: the fraction of top-k choices dropped at capacity factors 1.0,
  1.25 and 2.0 at the start and after 50 steps of moe-tiny (its experiment:
  ep_fsdp, expert=4 x fsdp=2).

Usage: ``python benchmarks/moe_ep.py [--steps 50] > moe_ep.json`` (8 simulated CPU devices).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from jaxscale.analysis import hlo, xla
from jaxscale.config import CONFIG_DIR, load_config
from jaxscale.models import routing as kernels
from jaxscale.train import Trainer

EXPERIMENT = CONFIG_DIR / "experiments" / "moe-tiny.yaml"


def config(*overrides: str):
    return load_config(EXPERIMENT, list(overrides))


def ep_mesh(ep: int) -> list[str]:
    """Rules ``ep``: ``ep`` devices of experts, the rest of the 8 data parallel."""
    return ["rules=ep", "mesh.fsdp=1", f"mesh.expert={ep}", f"mesh.data={8 // ep}"]


def expert_collectives(trainer: Trainer) -> dict[str, dict[str, float]]:
    """Wire bytes per device per MoE layer per step of the collectives over ``expert``, by kind and phase."""
    compiled = xla.compile_step(trainer)
    c = trainer.config.model
    moe_layers = c.layers // c.moe.every_n_layers * trainer.config.train.microbatches
    out: dict[str, dict[str, float]] = {}
    for x in hlo.collectives(compiled.as_text(), trainer.mesh):
        if x.axes is None or "expert" not in x.axes:
            continue
        row = out.setdefault(x.kind, {"forward": 0.0, "backward": 0.0, "other": 0.0})
        phase = x.phase if x.phase in ("forward", "backward") else "other"
        row[phase] += x.wire_bytes / moe_layers
    return out


def all_to_all_table() -> list[dict]:
    rows = []
    for ep in (2, 4, 8):
        for impl, dispatch in (("shard_map", "capacity"), ("partitioner", "capacity"), ("shard_map", "dropless")):
            cfg = config(*ep_mesh(ep), f"model.moe.impl={impl}", f"model.moe.dispatch={dispatch}")
            trainer = Trainer.build(cfg)
            m, t, mesh = cfg.model, cfg.train, trainer.mesh
            b = t.global_batch // (t.microbatches * mesh.shape["data"] * mesh.shape["fsdp"] * ep)
            nbytes = np.dtype(m.dtype).itemsize
            formula = 2 * m.moe.top_k * b * t.seq_len * m.embed * nbytes * (ep - 1) / ep
            padding = m.moe.experts * kernels.capacity(m.moe, t.seq_len) / (m.moe.top_k * t.seq_len)
            measured = expert_collectives(trainer)
            row = {
                "ep": ep,
                "impl": impl,
                "dispatch": dispatch,
                "sequences_per_device": b,
                "formula_each_way": formula,
                "measured": measured,
            }
            if dispatch == "capacity":
                row["formula_x_capacity_padding_each_way"] = formula * padding
                row["all_to_all_each_way"] = {p: measured.get("all-to-all", {}).get(p, 0.0)
                                              for p in ("forward", "backward")}
            else:
                row["allgather_reducescatter_formula_each_way"] = 2 * (ep - 1) * b * t.seq_len * m.embed * nbytes
            rows.append(row)
            print(f"all_to_all: ep={ep} {impl} {dispatch} done", file=sys.stderr)
    return rows


def memory_table() -> list[dict]:
    rows = []
    for ep in (1, 2, 4, 8):
        trainer = Trainer.build(config(*ep_mesh(ep)))
        compiled = xla.compile_step(trainer)
        rows.append({"ep": ep, "compiled": xla.memory(compiled), "state": xla.state_bytes(trainer)})
        print(f"memory: ep={ep} done", file=sys.stderr)
    return rows


def dropped_table(steps: int) -> list[dict]:
    rows = []
    for factor in (1.0, 1.25, 2.0):
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = config(f"model.moe.capacity_factor={factor}", f"train.steps={steps}", "train.log_every=10",
                         f"run_dir={run_dir}")
            _, history = Trainer.build(cfg).fit(progress=False)
        first, last = history[0], history[-1]
        rows.append({
            "capacity_factor": factor,
            "capacity_per_sequence": kernels.capacity(cfg.model.moe, cfg.train.seq_len),
            "dropped_step_0": first["moe_dropped"],
            f"dropped_step_{last['step']}": last["moe_dropped"],
            "loss_step_0": first["loss"],
            f"loss_step_{last['step']}": last["loss"],
            "aux_loss_last": last["moe_aux_loss"],
        })
        print(f"dropped: capacity_factor={factor} done", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    c = config().model
    report = {
        "model": "moe-tiny",
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "moe": {k: getattr(c.moe, k) for k in ("experts", "top_k", "mlp", "capacity_factor")},
        "all_to_all": all_to_all_table(),
        "memory": memory_table(),
        "dropped": dropped_table(args.steps),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
