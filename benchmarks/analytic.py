"""The analytic model against the compiled step, for the layouts tests/test_analytic.py holds, as JSON.

    python benchmarks/analytic.py > analytic.json

One line per layout on 8 simulated CPU devices (the tests' tiny model, fp32): predicted and
compiled memory per device (``memory_analysis()``) and wire bytes per device per step (the
collectives of the compiled HLO, reduce-scatter reading), and their relative differences.
The tests hold them to 10% and 5%; this prints the figures.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from helpers import tiny_config
    from test_analytic import LAYOUTS, layout_id

    from jaxscale.analysis import hlo, xla
    from jaxscale.analysis.inspect import step_collectives
    from jaxscale.analysis.predict import predict_trainer
    from jaxscale.training.trainer import Trainer

    for rules, mesh, *overrides in LAYOUTS:
        trainer = Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh))
        step = xla.compile_step(trainer)
        prediction = predict_trainer(trainer)
        memory = xla.memory(step)["total"]
        wire = hlo.summarize(step_collectives(trainer, step)[0])["total"]["rs_wire_bytes"]
        row = {
            "layout": layout_id((rules, mesh, *overrides)),
            "memory_predicted": round(prediction.memory["total"]),
            "memory_compiled": memory,
            "memory_error": round(prediction.memory["total"] / memory - 1, 4),
            "wire_predicted": round(prediction.comm["total"]),
            "wire_compiled": round(wire),
            "wire_error": round(prediction.comm["total"] / wire - 1, 4),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
