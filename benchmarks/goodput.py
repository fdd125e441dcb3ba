"""Goodput under injected failures, before and after continuous checkpoints and the compilation cache, as JSON.

    python benchmarks/goodput.py [STEPS] [KILL_EVERY_S] [KILLS] [EVERY] [KEEP_DIR] [DURATION_S] [MODES] > goodput.json

tests/test_kill_restart.py's harness: 2 processes x 4 CPU devices (fsdp_tp, the tiny model), process 1 killed
with SIGKILL KILL_EVERY_S seconds after each attempt's first committed checkpoint, KILLS times, both restarted
with resume. ``before``: a checkpoint every EVERY steps (default 10), no compilation cache; ``after``: the same plus
``checkpoint.continuous`` into a fast tier and the run's compilation cache. One line per mode: the goodput
summary of ``jaxscale report --goodput``, the steps lost per failure, the median step time (the checkpoints'
cost per step), and the time to the first step of a cold start and of the restarts. With KEEP_DIR the runs stay in
KEEP_DIR/before and KEEP_DIR/after (``jaxscale report --goodput KEEP_DIR/after``), else in a temporary directory.
With DURATION_S each mode's run is stopped by SIGTERM (saved) that long after its first start, once the kills are
done (a run of a given length, STEPS then only its bound). MODES: the modes to run (default ``before,after``). An
attempt that crashed by itself is restarted too (its errors on stderr): a failure the run recovers from.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: F401  the tests' environment: CPU devices, fast compiles
    from test_kill_restart import run_with_failures

    from jaxscale.training import goodput
    from jaxscale.training.report import parse_records, read_records

    steps, every_s, kills = (int(sys.argv[1]) if len(sys.argv) > 1 else 60,
                             float(sys.argv[2]) if len(sys.argv) > 2 else 8.0,
                             int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    every = ["--set", f"checkpoint.every={int(sys.argv[4]) if len(sys.argv) > 4 else 10}"]
    modes = {
        "before": [*every, "--set", "xla.compile_cache=off"],
        "after": [*every, "--set", "checkpoint.continuous=true"],
    }
    keep = sys.argv[5] if len(sys.argv) > 5 else None
    duration_s = float(sys.argv[6]) if len(sys.argv) > 6 else None
    modes = {m: modes[m] for m in (sys.argv[7].split(",") if len(sys.argv) > 7 else modes)}
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory()) as tmp:
        for mode, extra in modes.items():
            run = Path(tmp) / mode
            if mode == "after":
                extra = [*extra, "--set", f"checkpoint.fast_dir={Path(tmp) / 'fast'}"]
            run_with_failures(run, steps, every_s, kills, *extra, timeout_s=1800, stop_after_s=duration_s,
                              restart_crashes=True)
            records = parse_records(run / "metrics.jsonl")
            summary = goodput.summarize(records)
            starts = [r for r in records if "started_at" in r]
            first_step = [r["startup_s"] + r["start_s"] + r["compile_wait_s"] + r["step_time_s"] for r in starts]
            kept = [r["step_time_s"] for r in read_records(run / "metrics.jsonl") if "loss" in r and r["step"] > 0]
            failures = summary["per_failure"]
            print(json.dumps({
                "mode": mode, "steps": steps, "kill_every_s": every_s,
                "steps_lost_per_failure": statistics.mean(f["recomputed_steps"] for f in failures) if failures else 0,
                "median_step_s": statistics.median(kept),
                "first_step_cold_s": first_step[0], "first_step_restart_s": first_step[1:],
                "compile_wait_cold_s": starts[0]["compile_wait_s"],
                "compile_wait_restart_s": [r["compile_wait_s"] for r in starts[1:]],
                **{k: v for k, v in summary.items() if k != "per_failure"},
            }), flush=True)


if __name__ == "__main__":
    main()
