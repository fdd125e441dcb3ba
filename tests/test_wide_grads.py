"""The weight gradients of a bf16 step with an fp32 master reach the optimizer unrounded where no cross-device
sum touches them (``Trainer.wide_grads``): no fp32 -> bf16 -> fp32 round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err, tiny_config

from jaxscale.precision import policy as precision
from jaxscale.training.trainer import Trainer

BF16 = "model.dtype=bfloat16"
PROJECTIONS = ("wq", "wk", "wv", "wo")


@pytest.mark.parametrize(
    ("overrides", "rules", "mesh", "wide"),
    [
        ((BF16,), "dp", {}, True),  # one device
        ((BF16,), "tp", {"tensor": 2}, True),  # tensor parallelism only: the master is laid out as the weights
        ((BF16,), "dp", {"data": 2}, False),  # data parallelism: gradients summed across devices
        ((BF16,), "fsdp_tp", {"fsdp": 2, "tensor": 2}, False),
        ((BF16,), "tp_sp", {"tensor": 2}, False),  # sequence parallelism splits the tokens
        ((), "dp", {}, False),  # fp32 compute: one copy
        ((BF16, "precision.grads_reduce=bfloat16"), "dp", {}, False),  # bf16 sums asked for
    ],
)
def test_wide_gradients_only_where_no_cross_device_sum_needs_them(overrides, rules, mesh, wide):
    n = int(np.prod(list(mesh.values()))) if mesh else 1
    assert Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh), jax.devices()[:n]).wide_grads is wide


def test_projections_take_wide_weights_only_with_a_compute_copy_in_the_compute_dtype():
    """A compute copy kept in fp32 (``precision.params=float32``) is cast before the projections, as ever."""
    assert precision.takes_wide(tiny_config(BF16))
    assert not precision.takes_wide(tiny_config(BF16, "precision.params=float32"))
    assert not precision.takes_wide(tiny_config())  # fp32 compute


def test_one_device_bf16_weight_gradients_are_fp32_and_unrounded(monkeypatch):
    """The projections' gradients come out fp32 with most values off the bf16 grid (the rounding is gone),
    and equal the rounded path's to bf16 precision."""
    config = tiny_config(BF16, "train.seq_len=16", "train.global_batch=4")
    wide = Trainer.build(config, jax.devices()[:1])
    assert wide.wide_grads
    params, batch = wide.init_state().params, wide.batch(0)
    loss, grads = wide.loss_and_grads(params, batch)
    monkeypatch.setattr(Trainer, "wide_grads", property(lambda self: False))  # the former path, for reference
    ref_loss, ref_grads = Trainer.build(config, jax.devices()[:1]).loss_and_grads(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    for name in PROJECTIONS:
        g, r = np.asarray(grads["blocks"]["attn"][name]), np.asarray(ref_grads["blocks"]["attn"][name])
        assert g.dtype == np.float32 and r.dtype == jnp.bfloat16
        off_grid = np.mean(g != g.astype(jnp.bfloat16).astype(np.float32))
        assert off_grid > 0.9, (name, off_grid)
        assert rel_err(g, r.astype(np.float32)) <= 1e-2, name
