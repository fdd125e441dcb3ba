"""Expert balance on moe-tiny trained on real text (Python's standard library): prints one JSON object.

Four runs of the moe-tiny experiment from the same start, ``--steps`` updates each
(the experiment's mesh: ep_fsdp, expert=4 x fsdp=2): no balancing at all
(``aux_loss_weight=0``), the auxiliary loss (its default weight), and the routing
bias without an auxiliary loss, ``balance: sign`` (at ``bias_rate`` 0.01: DeepSeek-V3's 0.001 moves
a softmax router's bias too little in a few hundred steps) and ``balance: quantile``. Per run:
the mean loss of the first and last 20 steps, and the max/mean expert load at the
end (each MoE layer's, and their mean over the last 20 steps' records), so that
``|max/mean − 1|`` compares how close each comes to equal load.

Usage: ``python benchmarks/moe_balance.py [--steps 300] > moe_balance.json`` (8 simulated CPU devices).
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

from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

EXPERIMENT = CONFIG_DIR / "experiments" / "moe-tiny.yaml"
RUNS = {
    "none": ["model.moe.aux_loss_weight=0"],
    "aux_loss": [],
    "sign": ["model.moe.aux_loss_weight=0", "model.moe.balance=sign", "model.moe.bias_rate=0.01"],
    "quantile": ["model.moe.aux_loss_weight=0", "model.moe.balance=quantile"],
}
WINDOW = 20


def run(name: str, overrides: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(EXPERIMENT, [*overrides, f"train.steps={steps}", "train.log_every=1", f"run_dir={run_dir}",
                                       "train.eval_every=0", "checkpoint.every=0"])
        _, history = fit(Trainer.build(cfg), progress=False)
    records = [r for r in history if "loss" in r]
    last = records[-WINDOW:]
    load = np.mean([r["moe_load_max"] for r in last], axis=0)
    print(f"{name}: done", file=sys.stderr)
    return {
        "overrides": overrides,
        "loss_first_20": float(np.mean([r["loss"] for r in records[:WINDOW]])),
        "loss_last_20": float(np.mean([r["loss"] for r in last])),
        "load_max_over_mean_last_20_per_layer": [float(v) for v in load],
        "load_max_over_mean_last_20": float(np.mean(load)),
        "load_max_over_mean_final_per_layer": records[-1]["moe_load_max"],
        "aux_loss_last_20": float(np.mean([r["moe_aux_loss"] for r in last])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    runs = {name: run(name, overrides, args.steps) for name, overrides in RUNS.items()}
    excess = {name: r["load_max_over_mean_last_20"] - 1 for name, r in runs.items()}
    report = {
        "model": "moe-tiny",
        "steps": args.steps,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "runs": runs,
        "imbalance_vs_none": {name: excess[name] / excess["none"] for name in runs},
        "loss_vs_aux_loss": {name: runs[name]["loss_last_20"] - runs["aux_loss"]["loss_last_20"] for name in runs},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
