"""Goodput: the share of a run's wall time spent on steps that count, and where the rest went, failure by failure.

Each process that trains a run (an *attempt*: the first, and each restart after a failure) writes into the
training records of ``metrics.jsonl``:

- on every record: ``time`` (the wall clock, epoch seconds), ``productive_s`` (the step time this attempt has
  spent so far on its steps, the steps between two records timed together) and ``goodput`` (the run's productive
  step time so far, this attempt's and the kept steps of the attempts before it, over the wall time since the
  first attempt's process started);
- on its first record: ``started_at`` (when its process started; for a second :func:`jaxscale.training.loop.fit` in one
  process, when that call began), ``from_step`` (the step it started from), ``startup_s`` (from then to the
  loop: imports, ``jax.distributed``, building the trainer), ``start_s`` (restoring the checkpoint, or
  initialising a fresh state), ``compile_wait_s`` (waiting for the compiled step: its compile, or its read from
  the cache; none where the trainer held it already) and ``compile_cache`` (``hit``: the step was read from the
  persistent compilation cache, :mod:`jaxscale.runtime.compile_cache`; ``miss``; ``off``: not asked).

:func:`summarize` reads them back (``jaxscale report``): a resumed attempt at step R keeps the steps before R of
the attempt before it; that attempt's logged steps from R on were *recomputed*. Each failure costs

- ``down_s``: from the failed attempt's last record to the next process's start (steps not logged yet, the
  failure's detection, the restart's wait);
- ``startup_s``, ``restore_s`` (the new attempt's ``start_s``) and ``recompile_s`` (its ``compile_wait_s``: small
  when the cache hit);
- ``recomputed_s``: the step time of the steps trained again.

``goodput = productive_s / wall_s``, ``wall_s`` from the first process's start to the last record; what is
neither productive nor a failure's (the first compile, checkpoint copies, evaluation) is ``overhead_s``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from jaxscale.training.report import parse_records, read_metrics

LOST_CAUSES = ("down_s", "startup_s", "restore_s", "recompile_s", "recomputed_s")


def _process_start() -> float:
    """When this process started (epoch seconds), from /proc; where there is none, when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])  # field 22: starttime
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


_PROCESS_START = _process_start()
_USED: list[bool] = []  # whether a Clock already took this process's start


class Clock:
    """One attempt's goodput fields (this module's docstring), given the run's records before it."""

    def __init__(self, entered: float, start_s: float, earlier: list[dict[str, Any]], resume_step: int | None):
        """``entered``: when the loop was entered (epoch); ``start_s``: its restore or init; ``earlier``: the
        run's records so far (all attempts, none superseded; ``[]`` for a fresh run) resumed at ``resume_step``."""
        self.started_at = entered if _USED else min(_PROCESS_START, entered)
        _USED.append(True)
        self.startup_s, self.start_s = entered - self.started_at, start_s
        before = summarize([*earlier, {"from_step": resume_step, "started_at": self.started_at}]) if earlier else None
        self.run_start = before["started_at"] if before else self.started_at
        self.kept_s = before["productive_s"] if before else 0.0
        self.productive_s = 0.0
        self.from_step = resume_step or 0
        self.first = True

    def fields(self, steps: int, step_time: float, compile_wait_s: float, cache: str) -> dict[str, Any]:
        """The goodput fields of a record that timed ``steps`` steps at ``step_time`` seconds each; the attempt's
        wait for its compiled step and whether the persistent compilation cache answered (its first record's)."""
        now = time.time()
        self.productive_s += steps * step_time
        out = {"time": now, "productive_s": self.productive_s,
               "goodput": (self.kept_s + self.productive_s) / max(now - self.run_start, 1e-9)}
        if self.first:
            out.update(started_at=self.started_at, from_step=self.from_step, startup_s=self.startup_s,
                       start_s=self.start_s, compile_wait_s=compile_wait_s, compile_cache=cache)
            self.first = False
        return out


def earlier(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` as written, superseded ones too (none if there is no such file)."""
    return parse_records(path) if path.exists() else []


def of_run(run_dir: str | Path) -> dict[str, Any]:
    """:func:`summarize` of ``<run_dir>/metrics.jsonl`` (one line, a ``ConfigError``, where there is none)."""
    read_metrics(run_dir)
    return summarize(parse_records(Path(run_dir) / "metrics.jsonl"))


def attempts(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The training records (those with ``time``) of each attempt, in order (an attempt begins at ``started_at``)."""
    out: list[list[dict[str, Any]]] = []
    for record in records:
        if "started_at" in record:
            out.append([])
        if out and ("time" in record or "started_at" in record):
            out[-1].append(record)
    return [a for a in out if a]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Goodput and the time lost per failure by cause, from a run's records as written (superseded ones too)."""
    runs = attempts(records)
    if not runs:
        return {}
    failures, productive = [], 0.0
    for run, after in zip(runs, [*runs[1:], None], strict=True):
        timed = [r for r in run if "time" in r]
        resume = after[0]["from_step"] if after is not None else None
        kept = [r for r in timed if resume is None or r["step"] < resume]
        kept_s = kept[-1]["productive_s"] if kept else 0.0
        productive += kept_s
        if after is None:
            break
        last = timed[-1]["time"] if timed else run[0]["started_at"]
        first = after[0]
        failures.append({
            "resumed_at": first["from_step"],
            "down_s": max(first["started_at"] - last, 0.0),
            "startup_s": first.get("startup_s", 0.0),
            "restore_s": first.get("start_s", 0.0),
            "recompile_s": first.get("compile_wait_s", 0.0),
            "compile_cache": first.get("compile_cache"),
            "recomputed_steps": len(timed) - len(kept),
            "recomputed_s": (timed[-1]["productive_s"] - kept_s) if timed else 0.0,
        })
    timed_last = [r for r in runs[-1] if "time" in r]
    start = runs[0][0]["started_at"]
    wall = (timed_last[-1]["time"] if timed_last else runs[-1][0]["started_at"]) - start
    lost = {cause: sum(f[cause] for f in failures) for cause in LOST_CAUSES}
    return {
        "started_at": start, "wall_s": wall, "productive_s": productive,
        "goodput": productive / wall if wall > 0 else 0.0, "failures": len(failures),
        "lost_s": lost, "overhead_s": wall - productive - sum(lost.values()), "per_failure": failures,
    }


def lines(summary: dict[str, Any]) -> list[str]:
    """The summary as ``jaxscale report`` prints it."""
    if not summary:
        return ["goodput: no training records with timing (a run of an older jaxscale?)"]
    n = summary["failures"]
    out = [f"goodput {summary['goodput']:.1%}: {summary['productive_s']:.1f} s of productive steps in "
           f"{summary['wall_s']:.1f} s; {n} failure{'s' if n != 1 else ''}"]
    if n:
        lost = ", ".join(f"{cause[:-2]} {seconds:.1f} s" for cause, seconds in summary["lost_s"].items())
        out.append(f"lost to failures: {lost} ({sum(summary['lost_s'].values()) / n:.1f} s per failure)")
        steps = sum(f["recomputed_steps"] for f in summary["per_failure"])
        hits = sum(f["compile_cache"] == "hit" for f in summary["per_failure"])
        out.append(f"steps recomputed: {steps} ({steps / n:.1f} per failure); restarts whose step came from the "
                   f"compilation cache: {hits} of {n}")
    out.append(f"other overhead (first compile, checkpoints, evaluation): {summary['overhead_s']:.1f} s")
    return out
