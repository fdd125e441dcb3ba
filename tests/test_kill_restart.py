"""kill -9 of one of 2 training processes, again and again, each time restarted with both: the interrupted run's
losses are the uninterrupted run's, every step's batch trained once in the run as it stands (counted), and the
restarts read their step from the run's compilation cache. benchmarks/goodput.py runs the same harness longer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, subprocess_env
from test_multihost import RUN, free_port

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.training import goodput
from jaxscale.training.report import parse_records, read_records

CONTINUOUS = ["--set", "checkpoint.every=10", "--set", "checkpoint.continuous=true"]


def start(run_dir: Path, steps: int, *extra: str) -> list[subprocess.Popen]:
    """Two jaxscale processes of 4 CPU devices each (tests/test_multihost.py's run), resuming where they can,
    the compilation cache the run's own (``xla.compile_cache: auto``)."""
    env = subprocess_env("--xla_force_host_platform_device_count=4")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jaxscale", "train", "--no-progress", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(pid), *RUN, "--set", f"train.steps={steps}",
             "--set", f"run_dir={run_dir}", "--set", "checkpoint.resume=auto", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for pid in range(2)
    ]


def commits(run_dir: Path) -> int:
    """How many checkpoint records ``metrics.jsonl`` holds (all attempts')."""
    path = run_dir / "metrics.jsonl"
    return sum(1 for r in parse_records(path) if "checkpoint" in r) if path.exists() else 0


def run_with_failures(run_dir: Path, steps: int, every_s: float, kills: int, *extra: str,
                      timeout_s: float = 900, stop_after_s: float | None = None, restart_crashes: bool = False) -> int:
    """Train to ``steps``, killing process 1 with SIGKILL ``every_s`` seconds after each attempt's first committed
    checkpoint, ``kills`` times (each time both are started again); how many kills there were. With
    ``stop_after_s``, the attempt after the last kill is stopped by SIGTERM (a preemption: saved) that long after
    the first start. ``restart_crashes``: an attempt that ended otherwise (a crash) is restarted too, its errors
    printed (else they fail the call)."""
    deadline, done = time.monotonic() + timeout_s, 0
    stop_at = None if stop_after_s is None else time.monotonic() + stop_after_s
    while True:
        procs, before = start(run_dir, steps, *extra), commits(run_dir)
        while done >= kills and stop_at is not None and procs[0].poll() is None and time.monotonic() < stop_at:
            time.sleep(0.5)
        for p in procs if done >= kills and stop_at is not None else []:
            p.terminate()
        while done < kills and commits(run_dir) <= before and procs[0].poll() is None:
            assert time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.1)
        if done < kills and procs[0].poll() is None:
            time.sleep(every_s)
        if done < kills and procs[0].poll() is None:
            procs[1].kill()
            done += 1
        errors = [p.communicate(timeout=max(deadline - time.monotonic(), 1))[1] for p in procs]
        if procs[0].returncode == 0:
            return done
        crash = "\n".join(f"process {k}: exit {p.returncode}: {e[-1500:]}"
                          for k, (p, e) in enumerate(zip(procs, errors, strict=True)))
        assert procs[1].returncode == -9 or restart_crashes, crash
        if procs[1].returncode != -9:
            print(f"an attempt ended by itself, restarted:\n{crash}", file=sys.stderr, flush=True)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
def test_kill_9_and_restart_equals_the_uninterrupted_run(tmp_path):
    steps, batch = 40, 8  # RUN's train.global_batch
    straight = tmp_path / "straight"
    run_with_failures(straight, steps, 0, 0)
    run = tmp_path / "run"
    fast = ["--set", f"checkpoint.fast_dir={tmp_path / 'fast'}"]
    assert run_with_failures(run, steps, 2.0, 2, *CONTINUOUS, *fast) == 2
    records = parse_records(run / "metrics.jsonl")
    starts = [r for r in records if "started_at" in r]
    assert len(starts) == 3 and all(r["compile_cache"] == "hit" for r in starts[1:])
    # Bit for bit: the same program on the same mesh from the same state and batch.
    assert losses(run) == losses(straight)
    # Every step's batch once in the run as it stands (a batch is a function of its step), none skipped: each
    # attempt resumed at the step after the last one the checkpoint it restored had trained.
    kept = [r["step"] for r in read_records(run / "metrics.jsonl") if "loss" in r]
    assert kept == list(range(steps)) and len(kept) * batch == steps * batch
    final = Checkpointer(run / "checkpoints")
    assert final.read_json(steps).data["sequences_read"] == steps * batch
    final.close()
    summary = goodput.summarize(records)
    assert summary["failures"] == 2 and 0 < summary["goodput"] < 1
    print(json.dumps(summary))


FAILS_ONCE = """#!/usr/bin/env bash
# launch/multiprocess.sh's "python3 -m jaxscale train ...": process 1 is killed in the first attempt; the arguments
# of each start are kept.
echo "$*" >> "$(dirname "$0")/starts"
while [[ $# -gt 0 && $1 != --process-id ]]; do shift; done
if [[ $2 == 1 && ! -e "$(dirname "$0")/failed" ]]; then touch "$(dirname "$0")/failed"; kill -9 $$; fi
sleep 1
"""


def test_multiprocess_sh_restarts_after_a_failure_with_resume(tmp_path):
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(FAILS_ONCE)
    shim.chmod(0o755)
    env = {**subprocess_env(), "PATH": f"{shim.parent}:/usr/bin:/bin"}
    launch = ["bash", str(ROOT / "launch" / "multiprocess.sh"), "--restarts", "2", "--grace", "2", "--set", "a=1"]
    result = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "attempt 1 failed (exit 137): restarting all 2 processes" in result.stderr
    starts = (shim.parent / "starts").read_text().splitlines()
    assert len(starts) == 4
    assert [s.endswith("--set checkpoint.resume=auto --set a=1") for s in starts] == [False, False, True, True]
