"""Muon (jaxscale/training/muon.py): the Newton-Schulz iteration against an SVD reference, one device against a Muon
written
here in numpy, every layout against one device (fp32, 1e-5), and optax.contrib.muon where the definitions meet."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, rel_err, run_steps, tiny_config

from jaxscale.analysis import hlo
from jaxscale.layout.sharding import named_params, param_name
from jaxscale.training.muon import muon, newton_schulz
from jaxscale.training.muon_layout import is_hidden_matrix
from jaxscale.training.optim import schedule
from jaxscale.training.trainer import Trainer

A, B, C = 3.4445, -4.7750, 2.0315  # the quintic's coefficients (Keller Jordan's Muon)
MUON = ("train.optimizer=muon", "train.muon.ns_dtype=float32", "train.steps=3")
STEPS = 3


def ns_reference(g: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    """U p(S / |G|_F) V^T for G = U S V^T: the iteration acts on each singular value alone (float64)."""
    u, s, vt = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)
    x = s / (np.sqrt((s**2).sum(-1, keepdims=True)) + eps)
    for _ in range(steps):
        x = A * x + B * x**3 + C * x**5
    return (u * x[..., None, :]) @ vt


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (3, 16, 24)])
def test_newton_schulz_is_the_polynomial_of_the_singular_values(shape):
    g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref = ns_reference(g)
    assert rel_err(newton_schulz(jnp.asarray(g), 5, jnp.float32), ref) < 2e-6
    # bf16 (unit roundoff 2^-8) through five steps whose slope at zero is 3.4: measured 0.066 on the first shape
    assert rel_err(newton_schulz(jnp.asarray(g), 5, jnp.bfloat16).astype(jnp.float32), ref) < 0.1
    # five steps leave each singular value of a well-conditioned matrix near one
    sv = np.linalg.svd(np.asarray(newton_schulz(jnp.asarray(g), 5, jnp.float32), np.float64), compute_uv=False)
    assert sv.min() > 0.5 and sv.max() < 1.25


HIDDEN = {  # name -> how many leading stack dimensions and where the fan-out starts, written out for the test model
    "blocks.attn.wq": 2, "blocks.attn.wk": 2, "blocks.attn.wv": 2, "blocks.attn.wo": 3,
    "blocks.mlp.w_gate": 2, "blocks.mlp.w_up": 2, "blocks.mlp.w_down": 2,
}


def muon_reference(params: dict, grads_at, lr, config) -> dict:
    """``STEPS`` steps of Muon in numpy (Nesterov, fp32 iteration, Moonlight's 0.2 * sqrt(max fan)), AdamW on
    the rest (decay on matrices), after global-norm clipping: the parameters after them."""
    t, m = config.train, config.train.muon
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    p = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    mom = [np.zeros_like(x) for x in p]
    nu = [np.zeros_like(x) for x in p]
    treedef = jax.tree.structure(params)
    for k in range(STEPS):
        g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads_at(jax.tree.unflatten(treedef, p), k))]
        norm = np.sqrt(sum((x**2).sum() for x in g))
        g = [x * min(1.0, t.clip_norm / norm) for x in g]
        for i, name in enumerate(names):
            if name in HIDDEN:
                mom[i] = m.momentum * mom[i] + (1 - m.momentum) * g[i]
                u = m.momentum * mom[i] + (1 - m.momentum) * g[i]
                split = HIDDEN[name]
                stack, fin = p[i].shape[:1], int(np.prod(p[i].shape[1:split]))
                mat = u.reshape(*stack, fin, -1)
                scale = 0.2 * np.sqrt(max(mat.shape[-2:]))
                update = ns_reference(mat).reshape(u.shape) * scale + t.weight_decay * p[i]
            else:
                mom[i] = t.b1 * mom[i] + (1 - t.b1) * g[i]
                nu[i] = t.b2 * nu[i] + (1 - t.b2) * g[i] ** 2
                mhat, vhat = mom[i] / (1 - t.b1 ** (k + 1)), nu[i] / (1 - t.b2 ** (k + 1))
                update = mhat / (np.sqrt(vhat) + t.eps)
                if p[i].ndim - name.startswith("blocks.") >= 2:
                    update = update + t.weight_decay * p[i]
            p[i] = p[i] - float(lr(k)) * update
    return jax.tree.unflatten(treedef, p)


@pytest.fixture(scope="module")
def one_device(trainers):
    """The test model with Muon on one device, three steps."""
    return run_steps(*trainers.step(*MUON, devices=1), steps=STEPS)


def test_one_device_is_the_numpy_muon(one_device):
    trainer = one_device.trainer
    grads_at = jax.jit(lambda p, batch: trainer.loss_and_grads(p, batch)[1])
    params = trainer.init_state().params
    ref = muon_reference(params, lambda p, k: grads_at(p, trainer.batch(k)), schedule(trainer.config.train),
                         trainer.config)
    assert_trees_close(one_device.params, ref, rtol=1e-5)


LAYOUTS = {
    "dp": ((), "dp", {"data": 8}),
    "zero1": ((), "zero1", {"fsdp": 8}),
    "zero3": ((), "zero3", {"fsdp": 8}),
    "fsdp_tp": ((), "fsdp_tp", {"fsdp": 4, "tensor": 2}),
    "pp_fsdp_tp": (("pipeline.schedule=1f1b",), "pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_is_one_device(name, trainers, one_device):
    extra, rules, mesh = LAYOUTS[name]
    run = run_steps(*trainers.step(*MUON, *extra, rules=rules, mesh=mesh), steps=STEPS)
    assert_trees_close(run.params, one_device.params)
    assert [float(m["loss"]) for m in run.metrics] == pytest.approx([float(m["loss"]) for m in one_device.metrics],
                                                                     rel=1e-5)


@pytest.mark.slow
def test_owner_layout_with_whole_stacks_is_one_device(trainers):
    """zero3 with layers divisible by fsdp: every hidden matrix moves by all-to-all (test_muon_layout counts them)."""
    one = run_steps(*trainers.step(*MUON, "model.layers=8", devices=1), steps=STEPS)
    run = run_steps(*trainers.step(*MUON, "model.layers=8", rules="zero3", mesh={"fsdp": 8}), steps=STEPS)
    assert_trees_close(run.params, one.params)


@pytest.mark.slow
def test_experts_under_ep_fsdp_are_one_device(trainers):
    moe = ("model.moe={experts: 8, top_k: 2, capacity_factor: 8.0}",)
    one = run_steps(*trainers.step(*MUON, *moe, devices=1), steps=STEPS)
    run = run_steps(*trainers.step(*MUON, *moe, rules="ep_fsdp", mesh={"fsdp": 4, "expert": 2}), steps=STEPS)
    assert_trees_close(run.params, one.params)


@pytest.mark.slow
def test_a_user_model_through_trainer_build_is_one_device():
    from test_own_model import factory

    def build(rules: str, mesh: dict, devices: int | None) -> Trainer:
        optimizer = functools.partial(muon, 3e-3, ns_dtype=jnp.float32)
        chosen = None if devices is None else jax.devices()[:devices]
        return Trainer.build(tiny_config(rules=rules, mesh=mesh), chosen, model=factory, optimizer=optimizer)

    one = run_steps(build("dp", {}, 1), steps=STEPS)
    run = run_steps(build("zero3", {"fsdp": 8}, None), steps=STEPS)
    assert_trees_close(run.params, one.params)
    labels = jax.tree.leaves(run.trainer.optimizer.init(run.params).inner_states["muon"].inner_state[0].mu)
    assert len(labels) == 4 * run.trainer.config.model.layers  # per block wqkv (a stack of three), wo, up, down


def test_optax_contrib_muon_where_the_definitions_meet(one_device):
    """Without Nesterov, optax's bias-corrected momentum only rescales ours, which the iteration's normalisation
    removes (both with a negligible eps there); AdamW without decay on the rest: 1e-5. Run on
    the model's gradients outside the trainer (optax's tree of dimension numbers does not take the placeholder
    parameters that lay a state out)."""
    trainer, lr, dims = one_device.trainer, 1e-2, optax.contrib.MuonDimensionNumbers
    spec = {"blocks.attn.wq": dims(1, (2, 3)), "blocks.attn.wk": dims(1, (2, 3)), "blocks.attn.wv": dims(1, (2, 3)),
            "blocks.attn.wo": dims((1, 2), 3), "blocks.mlp.w_gate": dims(1, 2), "blocks.mlp.w_up": dims(1, 2),
            "blocks.mlp.w_down": dims(1, 2)}
    tree = jax.tree_util.tree_map_with_path(lambda p, _: spec.get(param_name(p)), trainer.axes,
                                            is_leaf=lambda x: isinstance(x, tuple))
    theirs = optax.contrib.muon(lr, nesterov=False, consistent_rms=0.2, weight_decay=0.1, adam_b2=0.95, eps=1e-12,
                                muon_weight_dimension_numbers=tree)
    ours = muon(lr, trainer.axes, nesterov=False, ns_dtype=jnp.float32, ns_eps=1e-12, eps=1e-12, weight_decay=0.1,
                adamw_weight_decay=0.0)
    grads_at = jax.jit(lambda p, batch: trainer.loss_and_grads(p, batch)[1])
    found = []
    for opt in (theirs, ours):
        params = trainer.init_state().params
        state = opt.init(params)
        for k in range(STEPS):
            updates, state = jax.jit(opt.update)(grads_at(params, trainer.batch(k)), state, params)
            params = optax.apply_updates(params, updates)
        found.append(params)
    assert_trees_close(found[1], found[0])


def test_a_stack_fsdp_does_not_divide_is_padded_to_owners_and_is_one_device(trainers):
    """zero3, 6 layers over fsdp = 8: each stack is padded with 2 zero matrices so every device owns one; the update
    moves each stack by two all-to-alls of 7/8 of the padded shard (8/6 of the shard) instead of gathering it
    (7 shards), and the parameters after 3 steps are one device's."""
    one = run_steps(*trainers.step(*MUON, "model.layers=6", devices=1), steps=STEPS)
    trainer, compiled = trainers.step(*MUON, "model.layers=6", rules="zero3", mesh={"fsdp": 8})
    assert_trees_close(run_steps(trainer, compiled, steps=STEPS).params, one.params)
    update = [c for c in hlo.collectives(compiled.as_text(), trainer.mesh) if c.phase == "update"]
    stacks = [leaf for _, leaf, axes in named_params(trainer.abstract_params, trainer.axes) if is_hidden_matrix(axes)]
    assert {c.kind for c in update} == {"all-to-all"} and len(update) == 2 * len(stacks)
    shard = sum(math.prod(leaf.shape) * 4 for leaf in stacks) / 8
    assert sum(c.wire_bytes for c in update) == pytest.approx(2 * 7 / 8 * 8 / 6 * shard)
