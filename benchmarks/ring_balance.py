"""Per-document balancing of the ring: each device's executed score tiles against the mean, before and after
``data.ring_balance`` arranges each packed row's documents, as JSON (no jax: the kernel's schedule counted).

Packed rows of ``--seq-len`` tokens, each begun inside a document (a piece of up to 200 tokens), filled with
documents of two corpora: ``short`` (geometric lengths, mean 300 tokens: chat turns, code files) and ``mixed``
(log-normal lengths, median exp(7.31) = 1500 tokens, sigma 1.2, cut at the row: papers among snippets). For a ring of
``cp`` devices (zig-zag chunks, ``--block``-token tiles) the tiles each device computes are counted in the
kernel's own schedule (:func:`jaxscale.parallel.ring_balance.executed_tiles`: causally masked tiles and those
where no query shares a document with a key, in every row of the batch, skipped), for ``--batches`` batches of
``--rows`` rows (a device's rows of one sequence-parallel step), before and after arranging each row.

    python benchmarks/ring_balance.py [--seq-len 16384] [--block 128] [--rows 1] [--batches 32] [--cp 4 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxscale.parallel.ring_balance import arranged, executed_tiles


def corpus(kind: str, rows: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """Positions [rows, seq_len] of packed rows of the ``kind`` corpus."""
    out = []
    for _ in range(rows):
        lead = int(rng.integers(0, 200))
        lengths, total = [], lead
        while total < seq_len:
            short = kind == "short"
            lengths.append(max(1, int(rng.geometric(1 / 300) if short else min(seq_len, rng.lognormal(7.31, 1.2)))))
            total += lengths[-1]
        out.append(np.concatenate([np.arange(100, 100 + lead), *(np.arange(n) for n in lengths)])[:seq_len])
    return np.stack(out)


def measure(kind: str, cp: int, args: argparse.Namespace) -> dict:
    """Largest device's tiles over the mean, per batch, before and after; and one batch's devices."""
    rng = np.random.default_rng(cp)
    before, after, seconds, example = [], [], 0.0, None
    for _ in range(args.batches):
        positions = corpus(kind, args.rows, args.seq_len, rng)
        work = executed_tiles(positions, cp, args.block)
        start = time.perf_counter()
        perm = arranged(positions, cp, args.block)
        seconds += time.perf_counter() - start
        moved = executed_tiles(np.take_along_axis(positions, perm, 1), cp, args.block)
        before.append(work.max() / work.mean())
        after.append(moved.max() / moved.mean())
        example = example or {"before": (work / work.mean()).round(3).tolist(),
                              "after": (moved / moved.mean()).round(3).tolist()}
    return {
        "corpus": kind, "cp": cp, "rows": args.rows,
        "max_over_mean_before": {"mean": round(float(np.mean(before)), 3), "worst": round(float(max(before)), 3)},
        "max_over_mean_after": {"mean": round(float(np.mean(after)), 3), "worst": round(float(max(after)), 3)},
        "first_batch_devices_over_mean": example,
        "arrange_ms_per_row": round(1000 * seconds / (args.batches * args.rows), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--cp", type=int, nargs="+", default=[4, 8], help="ring sizes")
    args = parser.parse_args()
    results = [measure(kind, cp, args) for kind in ("short", "mixed") for cp in args.cp]
    print(json.dumps({"seq_len": args.seq_len, "block": args.block, "results": results}, indent=1))


if __name__ == "__main__":
    main()
