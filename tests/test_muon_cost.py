"""Muon in the analytic model (jaxscale/analysis/muon_cost.py): its one-moment state to the byte, its moves to the
owners and the step's memory against the compiled zero3 step, and the Newton-Schulz FLOPs formula against XLA's
count of the iteration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxscale.analysis import hlo, xla
from jaxscale.analysis.inspect import step_collectives
from jaxscale.analysis.muon_cost import ns_flops
from jaxscale.analysis.predict import predict_trainer
from jaxscale.training.muon import newton_schulz

MUON = ("train.optimizer=muon", "train.muon.ns_dtype=float32", "train.steps=3")  # test_muon_layout's step
ZERO3 = (*MUON, "model.layers=8")  # each device owns one layer of every stack: two all-to-alls per stack


def test_state_is_one_moment_per_hidden_matrix_to_the_byte(trainers):
    trainer = trainers.get(*ZERO3, rules="zero3", mesh={"fsdp": 8})
    counters = 4 * sum(1 for x in jax.tree.leaves(trainer.abstract_state().opt_state) if x.ndim == 0)  # int32 steps
    predicted = predict_trainer(trainer).memory["optimizer"]
    assert predicted == xla.state_bytes(trainer)["opt_state"] - counters
    adamw = predict_trainer(trainers.get("model.layers=8", rules="zero3", mesh={"fsdp": 8})).memory["optimizer"]
    assert predicted < adamw  # Adam's two moments of every parameter, Muon's one of the hidden matrices


@pytest.mark.parametrize("layers", [8, 6])  # 6: each stack padded to 8 on the owners (muon_layout.owner_layout)
def test_zero3_memory_and_moves_match_the_compiled_step(trainers, layers):
    trainer, step = trainers.step(*MUON, f"model.layers={layers}", rules="zero3", mesh={"fsdp": 8})
    prediction = predict_trainer(trainer)
    moves = [f for f in prediction.flows if f.what.startswith("Muon:")]
    found = [c for c in hlo.collectives(step.as_text(), trainer.mesh) if c.phase == "update"]
    assert {f.kind for f in moves} == {c.kind for c in found} == {"all-to-all"}
    assert sum(f.wire_bytes for f in moves) == pytest.approx(sum(c.wire_bytes for c in found), rel=1e-9)
    assert prediction.memory["total"] == pytest.approx(xla.memory(step)["total"], rel=0.10)
    wire = hlo.summarize(step_collectives(trainer, step)[0])["total"]["rs_wire_bytes"]
    assert prediction.comm["total"] == pytest.approx(wire, rel=0.05)


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (4, 64, 256)])
def test_newton_schulz_flops_are_the_three_matmuls_per_step(shape):
    compiled = jax.jit(lambda x: newton_schulz(x, 5, jnp.float32)).lower(jnp.zeros(shape)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    stack = shape[0] if len(shape) == 3 else 1
    # XLA counts the normalisation and the polynomial's adds too: about 1.4% more on these shapes
    assert cost["flops"] == pytest.approx(stack * ns_flops(shape[-2], shape[-1], 5), rel=0.02)
