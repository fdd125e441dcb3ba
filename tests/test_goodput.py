"""Goodput from a run's records: productive step time over wall time, and the time lost per failure by cause."""

from __future__ import annotations

import json

import jax
import pytest
from helpers import tiny_config

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.cli import main
from jaxscale.training import goodput
from jaxscale.training.report import parse_records
from jaxscale.training.trainer import Trainer


def attempt(start: float, first: int, last: int, *, startup: float, restore: float, compile_s: float,
            cache: str) -> list[dict]:
    """An attempt's training records: one step a second from ``start + startup + restore + compile_s``."""
    t0 = start + startup + restore + compile_s
    out = []
    for k, step in enumerate(range(first, last)):
        record = {"step": step, "loss": 1.0, "time": t0 + k + 1, "productive_s": float(k + 1)}
        if k == 0:
            record.update(started_at=start, from_step=first, startup_s=startup, start_s=restore,
                          compile_wait_s=compile_s, compile_cache=cache)
        out.append(record)
    return out


def test_two_failures_by_cause():
    # Attempt 1 trains steps 0-5 (one second each) and dies; attempt 2 resumes at 4 (steps 4, 5 recomputed),
    # trains 4-7 and dies; attempt 3 resumes at 8 (nothing recomputed) and finishes at 10.
    a = attempt(100.0, 0, 6, startup=5, restore=1, compile_s=20, cache="miss")  # last record at t=132
    b = attempt(140.0, 4, 8, startup=5, restore=2, compile_s=1, cache="hit")  # last at 152
    c = attempt(160.0, 8, 10, startup=4, restore=2, compile_s=1, cache="hit")  # last at 169
    records = [*a, {"step": 4, "event": "resumed"}, *b, {"step": 8, "event": "resumed"}, *c]
    got = goodput.summarize(records)
    assert got["wall_s"] == 69.0 and got["failures"] == 2
    assert got["productive_s"] == 4.0 + 4.0 + 2.0  # the kept steps: 0-3, 4-7, 8-9
    assert got["goodput"] == pytest.approx(10 / 69)
    assert got["lost_s"] == {"down_s": (140 - 132) + (160 - 152), "startup_s": 9.0, "restore_s": 4.0,
                             "recompile_s": 2.0, "recomputed_s": 2.0}
    assert got["overhead_s"] == pytest.approx(69 - 10 - 16 - 9 - 4 - 2 - 2)
    assert [f["recomputed_steps"] for f in got["per_failure"]] == [2, 0]
    assert [f["resumed_at"] for f in got["per_failure"]] == [4, 8]


def test_a_resumed_run_logs_its_goodput_and_report_prints_it(tmp_path, capsys):
    config = tiny_config("mesh.data=1", "train.steps=6", "train.log_every=1", "checkpoint.every=2",
                         "checkpoint.resume=auto", f"run_dir={tmp_path}")
    trainer = Trainer.build(config, jax.devices()[:1])
    trainer.fit(progress=False, stop_at=5)
    Checkpointer(tmp_path / "checkpoints").manager.delete(5)  # as if killed while saving step 5: resumes at 4
    trainer.fit(progress=False)
    records = parse_records(tmp_path / "metrics.jsonl")
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == [0, 1, 2, 3, 4, 4, 5]
    assert all(0 < r["goodput"] <= 1 for r in trained)
    assert [r["from_step"] for r in trained if "started_at" in r] == [0, 4]
    assert main(["report", str(tmp_path), "--goodput"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failures"] == 1 and summary["per_failure"][0]["recomputed_steps"] == 1
    kept = [r for r in trained[:5] if r["step"] < 4][-1]["productive_s"] + trained[-1]["productive_s"]
    assert summary["productive_s"] == pytest.approx(kept)
