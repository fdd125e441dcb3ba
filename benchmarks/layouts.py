"""Compiled memory and collective bytes of one train step for every spine preset, as JSON.

    python benchmarks/layouts.py [--set KEY=VALUE ...] > layouts.json

Each line is one layout on 8 simulated CPU devices: the compiled per-device
memory, the state held per device, the wire bytes per device per step by
collective kind (as compiled, and in the reduce-scatter reading of XLA:CPU's
all-reduce + slice), and docs/formulas.md's figures for the same layout. Nothing
is run: the step is only lowered and compiled.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

LAYOUTS = {
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "zero2": {"data": 8},
    "zero3": {"fsdp": 8},
    "tp": {"data": 2, "tensor": 4},
    "tp_sp": {"data": 2, "tensor": 4},
    "fsdp_tp": {"fsdp": 2, "tensor": 4},
    "fsdp_tp_sp": {"fsdp": 2, "tensor": 4},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="experiment file (default: configs/experiments/tiny.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from jaxscale.analysis.inspect import step_report
    from jaxscale.config.read import CONFIG_DIR, MESH_AXES, load_config
    from jaxscale.training.trainer import Trainer

    path = args.config or CONFIG_DIR / "experiments" / "tiny.yaml"
    for rules, sizes in LAYOUTS.items():
        mesh = [f"mesh.{a}={sizes.get(a, 1)}" for a in MESH_AXES]
        config = load_config(path, [f"rules={rules}", *mesh, *args.overrides])
        report = step_report(Trainer.build(config))
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
