"""FP8 in the routed experts: the grouped matmul against a NumPy reference of the recipe (per-expert weight
scales), and the lowered MoE step's expert matmuls in f8 (capacity einsums and dropless grouped matmuls)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import tiny_config
from test_fp8 import E4M3_MAX, E5M2_MAX, reference
from test_fp8_step import E4M3, E5M2, conditionals, dot_types, e4m3_conversions

from jaxscale.precision import fp8
from jaxscale.precision.fp8 import grouped as fp8_grouped
from jaxscale.training.trainer import Trainer

CURRENT = fp8.Recipe("current", margin=0)


def test_grouped_matmul_runs_in_fp8_with_a_scale_per_expert():
    """Rows 0-3 to expert 0, none to expert 1, rows 4-8 to expert 2, row 9 to no local expert; the experts'
    weights 1000x apart, each quantized with its own scale. Forward, dx and dw against the recipe in NumPy."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (10, 16), jnp.float32)
    w = jax.random.normal(kw, (3, 16, 8), jnp.float32) * jnp.array([1.0, 10.0, 0.01])[:, None, None]
    g = jax.random.normal(kg, (10, 8), jnp.float32).at[9].set(0.0) * 1e-3
    sizes = jnp.array([4, 0, 5], jnp.int32)
    hx, hw, hg = jnp.zeros(2), jnp.zeros((3, 2)), jnp.zeros(2)

    def project(x, w, hx, hw, hg):
        x_op = fp8.Operand(x, fp8.quantize(x, hx, fp8.E4M3, CURRENT), hx, None, CURRENT)
        w_op = fp8.Operand(w, fp8.stacked(w, hw, CURRENT), hw, hg, CURRENT)
        return fp8_grouped.ragged(x_op, w_op, sizes)

    @jax.jit
    def forward_backward(*args):
        y, vjp = jax.vjp(project, *args)
        return y, vjp(g)

    y, (dx, dw, new_hx, new_hw, new_hg) = forward_backward(x, w, hx, hw, hg)
    qx, sx = reference(np.asarray(x), ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qg, sg = reference(np.asarray(g), ml_dtypes.float8_e5m2, E5M2_MAX)
    per_expert = [reference(np.asarray(w[e]), ml_dtypes.float8_e4m3fn, E4M3_MAX) for e in range(3)]
    want_y, want_dx, want_dw = np.zeros((10, 8)), np.zeros((10, 16)), np.zeros((3, 16, 8))
    for e, rows in ((0, slice(0, 4)), (2, slice(4, 9))):
        qw, sw = per_expert[e]
        want_y[rows] = qx[rows] @ qw * (sx * sw)
        want_dx[rows] = qg[rows] @ qw.T * (sg * sw)
        want_dw[e] = qx[rows].T @ qg[rows] * (sx * sg)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(new_hx[0], float(jnp.max(jnp.abs(x))))
    np.testing.assert_array_equal(new_hw[:, 0], np.max(np.abs(np.asarray(w)), axis=(1, 2)))
    np.testing.assert_array_equal(new_hg[0], float(jnp.max(jnp.abs(g))))


MOE = ["model.moe={}", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp=32", "model.moe.shared_experts=1"]
# Per layer (every layer is an MoE one): attention's 4 projections, the shared expert's 3, the routed experts' 3.
PROJECTIONS = 10
# The routed experts' stacked weights [layers, experts, ...], converted to e4m3 once per step.
EXPERT_WEIGHTS = {(2, 8, 64, 32): 2, (2, 8, 32, 64): 1}


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_routed_experts_run_in_fp8(dispatch):
    """The lowered step (one device, ``precision.fp8=delayed``): every projection, the routed experts' too,
    has f8 operands forward, for dx and for dw; the experts' weights quantized once per step with a scale per
    expert; no conditional."""
    config = tiny_config("precision.fp8=delayed", *MOE, f"model.moe.dispatch={dispatch}")
    trainer = Trainer.build(config, jax.devices()[:1])
    text = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    dots = dot_types(text)
    assert dots[E4M3, E4M3] == dots[E5M2, E4M3] == dots[E4M3, E5M2] == PROJECTIONS
    assert dots[E5M2, E5M2] == 0
    converted = e4m3_conversions(text)
    assert {shape: converted[shape] for shape in EXPERT_WEIGHTS} == EXPERT_WEIGHTS
    assert conditionals(text) == 0
    histories = jax.tree.leaves(trainer.abstract_state().fp8)
    assert sum(h.shape == (2, 8, 16) for h in histories) == 3  # w_gate, w_up, w_down: [layers, experts, history]


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_routed_experts_run_in_blockwise_fp8(dispatch):
    """``precision.fp8=blockwise`` (16-element tiles and blocks): the routed experts' matmuls have f8 operands too,
    forward, dx and dw (before: bf16, 7 of each kind per layer), with a weight history per expert; no
    conditional. The dropless grouped matmuls' slices and row tiles are batch and groups of one ragged dot each."""
    config = tiny_config("precision.fp8=blockwise", "precision.fp8_block=16", *MOE, f"model.moe.dispatch={dispatch}")
    trainer = Trainer.build(config, jax.devices()[:1])
    text = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    dots = dot_types(text)
    assert dots[E4M3, E4M3] == dots[E5M2, E4M3] == dots[E4M3, E5M2] == PROJECTIONS
    assert dots[E5M2, E5M2] == 0
    assert conditionals(text) == 0
    histories = jax.tree.leaves(trainer.abstract_state().fp8)
    assert sum(h.shape == (2, 8, 16) for h in histories) == 3
