"""Muon's state in checkpoints: a stop and resume under zero3 is bit for bit the straight run, and a zero3
checkpoint restores onto fsdp_tp (resharded, the same state, the same next loss)."""

from __future__ import annotations

import jax
import pytest
from helpers import assert_trees_equal, tiny_config

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.read import ConfigError
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

BASE = ["train.optimizer=muon", "train.steps=6", "train.log_every=1", "checkpoint.every=3"]
ZERO3 = {"rules": "zero3", "mesh": {"fsdp": 8}}


def losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    trainer = Trainer.build(tiny_config(*BASE, f"run_dir={run_dir}", **ZERO3))
    state, history = fit(trainer, progress=False)
    return trainer, run_dir, jax.device_get(state), history


@pytest.mark.slow
def test_muon_stop_and_resume_is_bit_exact(straight, tmp_path):
    _, _, state, history = straight
    trainer = Trainer.build(tiny_config(*BASE, f"run_dir={tmp_path}", "checkpoint.resume=auto", **ZERO3))
    _, first = fit(trainer, progress=False, stop_at=3)
    resumed, second = fit(trainer, progress=False)
    assert sorted(losses(second)) == [3, 4, 5]
    assert {**losses(first), **losses(second)} == losses(history)
    assert_trees_equal(resumed, state)


@pytest.mark.slow
def test_a_zero3_muon_checkpoint_restores_onto_fsdp_tp(straight):
    saved_by, run_dir, _, history = straight
    trainer = Trainer.build(tiny_config(*BASE, rules="fsdp_tp", mesh={"fsdp": 4, "tensor": 2}))
    checkpoints = Checkpointer(run_dir / "checkpoints")
    restored = checkpoints.restore(trainer.abstract_state(), 3)
    for array, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(trainer.state_shardings), strict=True):
        assert array.sharding == sharding
    assert_trees_equal(restored.state, checkpoints.restore(saved_by.abstract_state(), 3).state)
    loss = float(trainer.jit_eval_loss(restored.state.params, trainer.batch(3)))
    assert loss == pytest.approx(losses(history)[3], rel=1e-5)
    checkpoints.close()


@pytest.mark.slow
def test_a_muon_checkpoint_does_not_resume_as_adamw(straight):
    _, run_dir, _, _ = straight
    config = tiny_config(*BASE, f"run_dir={run_dir}", "checkpoint.resume=auto", "train.optimizer=adamw", **ZERO3)
    with pytest.raises(ConfigError, match=r"^resume: checkpoint step 6 holds the state of train\.optimizer=muon, "
                                          r"the config asks for adamw \(checkpoint\.init_from starts"):
        fit(Trainer.build(config), progress=False)
