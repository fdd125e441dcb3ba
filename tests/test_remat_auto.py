"""``model.remat: auto``: the least recomputation whose predicted peak fits the device (jaxscale/analysis/remat.py)."""

import dataclasses

import jax
import pytest
from helpers import tiny_config

from jaxscale.analysis import remat
from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import trainer_inputs
from jaxscale.config.read import ConfigError
from jaxscale.training.trainer import Trainer

AUTO = "model.remat=auto"


@pytest.fixture(scope="module")
def peaks():
    """The tiny model on one device: its inputs and the planner's predicted peak under each policy."""
    trainer = Trainer.build(tiny_config("model.remat=full"), jax.devices()[:1])
    m, inputs = trainer.config.model, trainer_inputs(trainer)
    return m, inputs, {p: memory(dataclasses.replace(m, remat=p), *inputs)["total"] for p in remat.ORDER}


def test_the_least_recomputation_that_fits_is_chosen(peaks):
    m, inputs, peak = peaks
    assert peak["none"] > peak["save_dots"] > peak["full"]  # each policy keeps less
    between = {  # budget -> the expected policy
        peak["none"]: "none",
        (peak["none"] + peak["save_dots"]) / 2: "save_dots",  # none does not fit, save_dots does
        peak["save_dots"]: "save_dots",
        (peak["save_dots"] + peak["full"]) / 2: "full",
        peak["full"] / 2: "full",  # nothing fits: full, the least memory
        None: "none",  # no memory limit known (XLA:CPU)
    }
    assert {b: remat.choose(m, *inputs, b) for b in between} == between


def test_resolved_sets_the_policy_and_the_trainer_refuses_auto(peaks):
    _, _, peak = peaks
    config = tiny_config(AUTO)
    with pytest.raises(ConfigError, match=r"^model\.remat: auto is chosen before the trainer is built"):
        Trainer.build(config, jax.devices()[:1])
    budget = (peak["none"] + peak["save_dots"]) / 2
    assert remat.resolved(config, jax.devices()[:1], budget).model.remat == "save_dots"
    assert remat.resolved(config, jax.devices()[:1]).model.remat == "none"  # CPU: no bytes_limit
    assert remat.device_budget(jax.devices()[0]) is None
    assert remat.resolved(tiny_config("model.remat=full"), budget=1.0).model.remat == "full"  # not auto: kept


def test_a_pipeline_stage_takes_none():
    """A stage's backward recomputes each chunk once (the planner's rule): no layer remat, whatever the budget."""
    config = tiny_config(AUTO, "train.global_batch=32", "model.layers=8", "pipeline.microbatches=4",
                         "pipeline.schedule=1f1b", rules="pp", mesh={"stage": 2, "data": 4})
    assert remat.resolved(config, budget=1.0).model.remat == "none"
