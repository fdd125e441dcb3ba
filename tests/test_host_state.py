"""The state and the compute copy in host memory in the planner (``jaxscale/analysis/host_state.py``): their
transfers' seconds over the cluster's host link, and ``plan --calibrate``'s measure of that link
(``jaxscale/analysis/host_measure.py``)."""

from __future__ import annotations

import math

import jax
import pytest
from helpers import tiny_config

from jaxscale.analysis import host_measure
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.predict import predict_trainer
from jaxscale.training.trainer import Trainer

SLOW = 1.0e3  # bytes/s: every transfer of the tiny model longer than any of its compute


@pytest.fixture(scope="module")
def both() -> Trainer:
    """zero3 on 8 devices, bf16 compute copy, fp32 master, the state and the copy in host memory."""
    config = tiny_config("model.dtype=bfloat16", "precision.master=float32", "precision.offload_state=true",
                         "precision.offload_params=true", rules="zero3", mesh={"fsdp": 8})
    return Trainer.build(config)


def test_host_transfers_cost_what_the_update_and_the_layers_do_not_hide(both):
    """Ψ parameters over 8 devices: the state is 3 · 4 Ψ / 8 bytes (master, two moments), the copy 2 Ψ / 8. Over
    a link too slow to hide anything, the step grows by the state one way less the update, the copy's shard in
    during the forward and the backward less their compute, and the larger of gradients and copy around the
    update less the update."""
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(both.abstract_state().params))
    state, params = 3 * 4 * psi / 8, 2 * psi / 8
    slow = predict_trainer(both, load_cluster("h100", [f"host_bandwidth={SLOW}"])).time
    none = predict_trainer(both, load_cluster("h100")).time  # no link named: not costed
    update, layers = none["optimizer"], none["compute"] - none["optimizer"]
    expected = (state / SLOW - update) + (params / SLOW - layers / 3) + (params / SLOW - 2 * layers / 3) + (
        params / SLOW - update)
    assert "host_transfers" in slow and none["host_transfers"] == 0.0
    assert slow["host_transfers"] == pytest.approx(expected, rel=1e-9)
    assert slow["total"] == pytest.approx(none["total"] + expected, rel=1e-9)
    assert slow["mfu"] == pytest.approx(none["mfu"] * none["total"] / slow["total"], rel=1e-9)


def test_a_fast_link_hides_the_transfers(both):
    assert predict_trainer(both, load_cluster("h100", ["host_bandwidth=1.0e15"])).time["host_transfers"] == 0.0


def test_the_host_link_is_measured_both_ways_on_every_device_at_once():
    rates = host_measure.host_bandwidth(jax.local_devices(), nbytes=2**20, rounds=1)
    assert rates["to_host"] > 0 and rates["from_host"] > 0
    assert rates["host_bandwidth"] == min(rates["to_host"], rates["from_host"])
