"""What continuous checkpoints cost per step, and how far apart they come, as JSON.

    python benchmarks/continuous_cost.py [STEPS] [EMBED] > continuous_cost.json

One process, the tests' tiny model widened to EMBED (default 256) on 8 simulated CPU devices under zero3; STEPS
(default 200) steps each: without checkpoints, with ``checkpoint.every=50``, and with ``checkpoint.continuous``
into a fast tier beside it, back to back or at least 2 s apart (``checkpoint.continuous_interval_s``). One line
per mode: the wall time of the loop, its cost per step over the run without checkpoints, the saves, the median
interval between continuous saves in steps (about the most steps a failure loses) and the mean blocking time of a
save (the copy off the devices).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: F401  the tests' environment: CPU devices, fast compiles
    from helpers import tiny_config

    from jaxscale.training.report import parse_records
    from jaxscale.training.trainer import Trainer

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    embed = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    base_s = None
    with tempfile.TemporaryDirectory() as tmp:
        modes = {
            "none": [],
            "every_50": ["checkpoint.every=50"],
            "continuous": ["checkpoint.every=50", "checkpoint.continuous=true", f"checkpoint.fast_dir={tmp}/fast"],
            "continuous_2s": ["checkpoint.every=50", "checkpoint.continuous=true", f"checkpoint.fast_dir={tmp}/fast2",
                              "checkpoint.continuous_interval_s=2"],
        }
        for mode, extra in modes.items():
            run = Path(tmp) / mode
            config = tiny_config(f"train.steps={steps}", "train.log_every=50", f"model.embed={embed}",
                                 f"model.mlp={4 * embed}", f"run_dir={run}", *extra, rules="zero3", mesh={"fsdp": 8})
            trainer = Trainer.build(config)
            _ = trainer.compiled_guarded_step  # compiled before the clock starts
            start = time.perf_counter()
            trainer.fit(progress=False)
            wall = time.perf_counter() - start
            base_s = wall if base_s is None else base_s
            saves = [r for r in parse_records(run / "metrics.jsonl") if "checkpoint" in r]
            quick = sorted(r["checkpoint"] for r in saves if r["checkpoint"] % 50 and r["checkpoint"] != steps)
            gaps = [b - a for a, b in itertools.pairwise(quick)]
            print(json.dumps({
                "mode": mode, "steps": steps, "embed": embed, "wall_s": wall,
                "cost_per_step_s": (wall - base_s) / steps, "saves": len(saves),
                "median_interval_steps": statistics.median(gaps) if gaps else None,
                "save_blocking_s": statistics.mean(r["save_blocking_s"] for r in saves) if saves else None,
            }), flush=True)


if __name__ == "__main__":
    main()
