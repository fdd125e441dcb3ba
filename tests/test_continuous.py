"""Continuous checkpoints: a save starts as soon as the last one committed, into a fast tier beside the persistent
one; resume takes the newest complete step of either, and the resumed run's losses are the uninterrupted run's."""

from __future__ import annotations

import shutil

import jax
import pytest
from helpers import tiny_config

from jaxscale.checkpoint.continuous import FAST_KEEP, Tiers
from jaxscale.config.read import ConfigError
from jaxscale.training.report import parse_records, read_records
from jaxscale.training.trainer import Trainer

STEPS = 16


def build(run_dir, *overrides: str) -> Trainer:
    config = tiny_config("mesh.data=1", f"train.steps={STEPS}", "train.log_every=1", f"run_dir={run_dir}", *overrides)
    return Trainer.build(config, jax.devices()[:1])


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["checkpoint.continuous=true", "checkpoint.async_save=false"], "checkpoint.continuous needs checkpoint.async"),
        (["checkpoint.fast_dir=/tmp/x"], r"checkpoint.fast_dir holds the continuous saves: set checkpoint.continuous"),
        (["checkpoint.continuous=true", "checkpoint.fast_dir=RUN/checkpoints"], "fast_dir is checkpoint.dir"),
        (["checkpoint.continuous_interval_s=5"], r"continuous_interval_s spaces the continuous saves: set"),
    ],
)
def test_refused_settings(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(f"run_dir={tmp_path}", *[o.replace("RUN", str(tmp_path)) for o in overrides])


def test_resume_from_the_newest_tier_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    build(straight).fit(progress=False)
    run = tmp_path / "run"
    tiers = ["checkpoint.every=10", "checkpoint.continuous=true", f"checkpoint.fast_dir={tmp_path / 'fast'}",
             "checkpoint.resume=auto"]
    due = Tiers.due

    def due_once_committed(self: Tiers, step: int) -> bool:
        for tier in self.all:  # steps slower than a save's write: one each step
            tier.manager.wait_until_finished()
        return due(self, step)

    monkeypatch.setattr(Tiers, "due", due_once_committed)
    build(run, *tiers).fit(progress=False, stop_at=13)
    saved = [r["checkpoint"] for r in parse_records(run / "metrics.jsonl") if "checkpoint" in r]
    assert sorted(saved) == list(range(1, 14))  # 10 and 13 (the stop) persistent, the others fast
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "13"]
    assert sorted(p.name for p in (tmp_path / "fast").iterdir() if p.name.isdigit()) == ["11", "12"]
    assert FAST_KEEP == 2
    # The persistent tier's steps lost (as if its disk went), the fast tier's newest damaged: resumed from step 11.
    for step in (10, 13):
        shutil.rmtree(run / "checkpoints" / str(step))
    (tmp_path / "fast" / "12" / "state").rename(tmp_path / "fast" / "12" / "gone")
    _, history = build(run, *tiers).fit(progress=False)
    assert history[0]["event"] == "damaged_checkpoint" and "resuming from step 11" in history[0]["message"]
    assert [r["from_step"] for r in history if "from_step" in r] == [11]
    assert losses(run) == pytest.approx(losses(straight), rel=1e-6, abs=0)
    assert sorted(losses(run)) == list(range(STEPS))


def test_continuous_saves_keep_their_interval(tmp_path):
    # An interval longer than the run: the first continuous save (after step 1) and the persistent ones only.
    spaced = ["checkpoint.every=8", "checkpoint.continuous=true", "checkpoint.continuous_interval_s=3600"]
    build(tmp_path, *spaced).fit(progress=False)
    saved = [r["checkpoint"] for r in parse_records(tmp_path / "metrics.jsonl") if "checkpoint" in r]
    assert sorted(saved) == [1, 8, 16]
