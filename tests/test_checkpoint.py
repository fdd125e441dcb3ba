"""Checkpoints and faults: exact resume, restore onto another layout, SIGKILL mid-save, SIGTERM, non-finite steps."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import TINY, assert_trees_equal, tiny_config

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.read import ConfigError, load_config
from jaxscale.training.loop import NonFiniteError, fit
from jaxscale.training.report import read_records
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
BASE = ["train.steps=10", "train.log_every=1", "checkpoint.every=5"]
LAYOUT = ["rules=zero3", "mesh.data=1", "mesh.fsdp=8"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
RTOL = 1e-5


def train_losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def logged_steps(run_dir: Path) -> list[int]:
    """The training steps in a run's metrics.jsonl as the run stands (after resumes), in file order."""
    return [r["step"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r]


def record_batches(trainer: Trainer) -> dict[int, str]:
    """From now on, a hash of the tokens of every batch the trainer reads, by step."""
    seen: dict[int, str] = {}
    read = trainer.batch

    def batch(step: int) -> dict[str, jax.Array]:
        out = read(step)
        seen[step] = hashlib.sha256(np.asarray(out["inputs"]).tobytes()).hexdigest()
        return out

    trainer.batch = batch
    return seen


def retarget(trainer: Trainer, run_dir: Path, **train: object) -> Trainer:
    """The same compiled trainer, writing to another run directory (and with other loop-only settings)."""
    trainer.config.run_dir = str(run_dir)
    for key, value in train.items():
        setattr(trainer.config.train, key, value)
    return trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Ten steps in one go, checkpoints at 5 and 10."""
    run_dir = tmp_path_factory.mktemp("straight")
    trainer = Trainer.build(tiny_config(*BASE, f"run_dir={run_dir}", *LAYOUT))
    batches = record_batches(trainer)
    state, history = fit(trainer, progress=False)
    return SimpleNamespace(trainer=trainer, dir=run_dir, state=jax.device_get(state), history=history, batches=batches)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Five steps, stop; then a second call resumes from the checkpoint on disk and runs five more."""
    run_dir = tmp_path_factory.mktemp("resumed")
    trainer = Trainer.build(tiny_config(*BASE, f"run_dir={run_dir}", "checkpoint.resume=auto", *LAYOUT))
    batches = record_batches(trainer)
    _, first = fit(trainer, progress=False, stop_at=5)
    state, second = fit(trainer, progress=False)
    return SimpleNamespace(
        trainer=trainer, dir=run_dir, state=jax.device_get(state), first=first, second=second, batches=batches
    )


def test_stop_and_resume_is_bit_exact(straight, resumed):
    assert sorted(train_losses(resumed.first)) == [0, 1, 2, 3, 4]
    assert sorted(train_losses(resumed.second)) == [5, 6, 7, 8, 9]
    assert {**train_losses(resumed.first), **train_losses(resumed.second)} == train_losses(straight.history)
    assert_trees_equal(resumed.state, straight.state)
    assert logged_steps(resumed.dir) == list(range(10))


def test_resume_reads_the_same_batches(straight, resumed):
    assert resumed.batches == straight.batches and sorted(resumed.batches) == list(range(10))
    saved = Checkpointer(resumed.dir / "checkpoints").read_json(5)
    assert saved.data["step"] == 5 and saved.data["sequences_read"] == 5 * 16
    assert saved.loop == {"skipped_updates": 0, "skipped_in_a_row": 0, "layer_storage": {"counts": [2], "stages": 1}}
    assert saved.config["rules"] == "zero3" and saved.config["model"]["embed"] == 64


@pytest.mark.parametrize(("rules", "mesh", "devices"), [("tp", {"tensor": 4}, 4), ("dp", {}, 1)])
def test_restore_onto_another_layout(straight, rules, mesh, devices):
    """Saved under zero3 on 8 devices; restored under tp on 4 and dp on 1: resharded, same next loss."""
    trainer = Trainer.build(tiny_config(*BASE, rules=rules, mesh=mesh), jax.devices()[:devices])
    checkpoints = Checkpointer(straight.dir / "checkpoints")
    restored = checkpoints.restore(trainer.abstract_state(), 5)
    for array, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(trainer.state_shardings), strict=True):
        assert array.sharding == sharding
    as_saved = checkpoints.restore(straight.trainer.abstract_state(), 5)
    assert_trees_equal(restored.state, as_saved.state)
    loss = float(trainer.jit_eval_loss(restored.state.params, trainer.batch(5)))
    expected = train_losses(straight.history)[5]
    assert abs(loss - expected) <= RTOL * abs(expected)
    checkpoints.close()


KILL_DURING_SAVE = """
import asyncio, json, pathlib, sys
from orbax.checkpoint._src.serialization import serialization
from jaxscale.config.read import load_config
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

overrides, hang_step, marker = json.loads(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
write = serialization.async_serialize_from_host

async def write_then_hang(rslices, tensorstore_spec, **kwargs):
    await write(rslices, tensorstore_spec, **kwargs)
    if f"/{hang_step}.orbax-checkpoint-tmp/" in json.dumps(tensorstore_spec, default=str):
        marker.touch()  # an array of this step is on disk, the step is not committed
        await asyncio.sleep(3600)

serialization.async_serialize_from_host = write_then_hang
fit(Trainer.build(load_config(None, overrides)), progress=False)
"""


@pytest.mark.slow  # jaxscale's own logic, the same on every JAX: the whole suite (Python 3.11) runs it
def test_sigkill_during_async_save_loses_nothing_else(straight, resumed, tmp_path):
    """Killed while step 10 is being written: resume starts from step 5, and the run ends as if never killed."""
    run_dir = tmp_path / "killed"
    overrides = [*TINY, *BASE, *LAYOUT, f"run_dir={run_dir}"]
    marker = tmp_path / "hanging"
    script = tmp_path / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(overrides), "10", str(marker)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the save of step 10 never started: {proc.poll()} {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    directory = run_dir / "checkpoints"
    assert [p.name for p in directory.glob("10.orbax-checkpoint-tmp*")], "killed after the save was committed"
    checkpoints = Checkpointer(directory)
    assert checkpoints.all_steps() == [5]
    checkpoints.close()
    trainer = retarget(resumed.trainer, run_dir)
    state, history = fit(trainer, progress=False)
    expected = train_losses(straight.history)
    assert train_losses(history) == {s: expected[s] for s in range(5, 10)}
    assert history[0]["event"] == "removed_uncommitted" and history[0]["paths"][0].startswith("10.orbax-checkpoint-tmp")
    assert_trees_equal(jax.device_get(state), straight.state)
    assert logged_steps(run_dir) == list(range(10))
    assert not list(directory.glob("*.orbax-checkpoint-tmp*"))


@pytest.mark.slow  # jaxscale's own logic, the same on every JAX: the whole suite (Python 3.11) runs it
def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path):
    sets = [*TINY, *LAYOUT, "mesh.tensor=1", "train.steps=400", "train.log_every=1", "checkpoint.every=1000",
            f"run_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "jaxscale", "train", "--no-progress", *(a for s in sets for a in ("--set", s))]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"exited before the signal: {proc.communicate()[1][-2000:]}"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["event"] == "preempted" and last["saved"], last
    step = last["step"]
    assert 3 <= step < 400 and logged_steps(tmp_path) == list(range(step))
    assert f"preempted (SIGTERM) after {step} updates; checkpoint saved" in out
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    assert checkpoints.all_steps() == [step]
    assert checkpoints.read_json(step).data["step"] == step
    checkpoints.close()


def poison(trainer: Trainer, bad_step: int) -> None:
    """Step ``bad_step`` reads a batch with a token outside the vocabulary: its loss and gradients are NaN."""
    read = trainer.batch

    def batch(step: int) -> dict[str, jax.Array]:
        out = read(step)
        if step != bad_step:
            return out
        inputs = np.array(out["inputs"])
        inputs[0, 0] = 10**6
        return {**out, "inputs": jax.device_put(inputs, out["inputs"].sharding)}

    trainer.batch = batch


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A trainer that saves every step, keeps the last 3 and every 2nd, and skips non-finite updates."""
    run_dir = tmp_path_factory.mktemp("guarded")
    overrides = ["train.steps=6", "train.log_every=1", "checkpoint.every=1", "checkpoint.keep=3",
                 "checkpoint.keep_every=2", "train.nonfinite=skip", f"run_dir={run_dir}"]
    trainer = Trainer.build(tiny_config(*overrides, rules="dp", mesh={"data": 8}))
    poison(trainer, 4)
    return trainer


def test_nonfinite_update_is_skipped_and_counted(guarded, tmp_path):
    trainer = retarget(guarded, tmp_path, nonfinite="skip")
    _, history = fit(trainer, progress=False)
    records = {r["step"]: r for r in history if "loss" in r}
    assert np.isnan(records[4]["loss"]) and records[4]["skipped_updates"] == 1
    assert all(np.isfinite(records[s]["loss"]) for s in (0, 1, 2, 3, 5)) and records[5]["skipped_updates"] == 1
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    assert checkpoints.all_steps() == [2, 4, 5, 6]  # the last 3, and every 2nd
    before, after = (checkpoints.restore(trainer.abstract_state(), s) for s in (4, 5))
    assert_trees_equal((after.state.params, after.state.opt_state), (before.state.params, before.state.opt_state))
    assert int(after.state.step) == 5 and after.loop["skipped_updates"] == after.loop["skipped_in_a_row"] == 1
    assert before.loop["skipped_updates"] == 0
    checkpoints.close()


def test_nonfinite_update_stops_the_run(guarded, tmp_path):
    trainer = retarget(guarded, tmp_path, nonfinite="stop")
    with pytest.raises(NonFiniteError, match=r"^step 4: loss nan"):
        fit(trainer, progress=False)
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    assert checkpoints.all_steps() == [2, 3, 4]
    checkpoints.close()


def test_nonfinite_state_is_never_saved(guarded, tmp_path):
    trainer = retarget(guarded, tmp_path, nonfinite="skip")
    state = trainer.init_state()
    params = {**state.params, "final_norm": {"scale": state.params["final_norm"]["scale"] * np.nan}}
    with pytest.raises(NonFiniteError, match="state after 1 updates is not finite: not saved"):
        fit(trainer, state._replace(params=params), progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == []


def test_fresh_run_never_overwrites_checkpoints(straight):
    trainer = Trainer.build(tiny_config(*BASE, f"run_dir={straight.dir}", *LAYOUT))
    with pytest.raises(ConfigError, match=r"holds checkpoints \(latest step 10\): continue with --resume"):
        fit(trainer, progress=False)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("model.embed=32", r"checkpoint step 10 has model\.embed=64, the config has 32"),
        ("train.seq_len=16", r"the checkpoint was trained with train\.seq_len=32, this config has 16"),
        ("data.max_bytes=100000", r"trained with data\.max_bytes=200000, this config has 100000"),
    ],
)
def test_resume_refuses_another_model_or_data(straight, override, match):
    config = tiny_config(*BASE, f"run_dir={straight.dir}", "checkpoint.resume=auto", override, *LAYOUT)
    with pytest.raises(ConfigError, match=match):
        fit(Trainer.build(config), progress=False)


def test_resume_flag_and_checkpoint_keys_are_validated():
    assert load_config(None, ["checkpoint.resume=auto"]).checkpoint.resume == "auto"
    with pytest.raises(ConfigError, match=r"checkpoint\.resume: 'always' is not one of off, auto, required"):
        load_config(None, ["checkpoint.resume=always"])
    with pytest.raises(ConfigError, match=r"train\.nonfinite: 'ignore' is not one of stop, skip"):
        load_config(None, ["train.nonfinite=ignore"])
    with pytest.raises(ConfigError, match=r"checkpoint\.keep must be at least 1, got 0"):
        load_config(None, ["checkpoint.keep=0"])
