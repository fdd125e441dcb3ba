"""Block-scaled fp8 loss curves against bf16: 200 steps of the tiny model from 4 seeds, as JSON lines.

    python benchmarks/blockscaled_curves.py > blockscaled_curves.json

The runs are tests/test_fp8.py's curve test's (tests/helpers.py's ``loss_curves``: bf16 compute, the same initial
weights and batches per seed, one device). One line per ``precision.fp8`` mode (``mxfp8``, ``nvfp4``, and any
given with ``--modes``): over the seeds, the mean of each step's loss difference to bf16, and of the 20-step
means' difference (the curve test's measure, held within 0.05 nats at every step): ``mean_gap`` (the mean over
the steps, NVIDIA's reported measure: +0.026 nats for NVFP4 on Llama 3 8B under MaxText), ``last50_gap`` (the
last 50 steps' mean), ``max_smoothed_gap`` (the largest absolute 20-step-mean difference) and its step.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from helpers import CURVE_SEEDS, loss_curves

WINDOW = 20


def smooth(losses: np.ndarray) -> np.ndarray:
    return np.convolve(losses, np.ones(WINDOW) / WINDOW, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["mxfp8", "nvfp4"])
    parser.add_argument("--seeds", type=int, default=CURVE_SEEDS)
    args = parser.parse_args()
    start = time.perf_counter()
    bf16 = [c.losses for c in loss_curves(seeds=args.seeds)]
    print(json.dumps({"mode": "bf16", "seeds": args.seeds, "final_loss": float(np.mean([c[-1] for c in bf16])),
                      "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    for mode in args.modes:
        start = time.perf_counter()
        low = [c.losses for c in loss_curves(f"precision.fp8={mode}", seeds=args.seeds)]
        raw = np.mean([a - b for a, b in zip(low, bf16, strict=True)], axis=0)
        smoothed = np.mean([smooth(a) - smooth(b) for a, b in zip(low, bf16, strict=True)], axis=0)
        print(json.dumps({
            "mode": mode, "seeds": args.seeds, "steps": len(raw), "mean_gap": round(float(raw.mean()), 4),
            "last50_gap": round(float(raw[-50:].mean()), 4),
            "max_smoothed_gap": round(float(np.abs(smoothed).max()), 4),
            "at_step": int(np.abs(smoothed).argmax()) + WINDOW - 1,
            "final_loss": float(np.mean([c[-1] for c in low])), "seconds": round(time.perf_counter() - start, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
