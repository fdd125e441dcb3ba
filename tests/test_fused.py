"""Fused projections (``model.fused_projections``): the layout's conversion, the same loss and gradients
as separate projections (one device and sharded layouts), and checkpoints of one layout in the other."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, tiny_config

from jaxscale.config.read import ConfigError
from jaxscale.models.fusion import fuse, fuse_qkv, separate_reader, unfuse
from jaxscale.training.trainer import Trainer

FUSED = "model.fused_projections=true"


def test_fuse_puts_each_query_head_under_its_key_value_head_and_unfuse_inverts_it():
    rng = np.random.default_rng(0)
    wq, wk, wv = rng.normal(size=(2, 5, 6, 3)), rng.normal(size=(2, 5, 2, 3)), rng.normal(size=(2, 5, 2, 3))
    w = fuse_qkv(wq, wk, wv)
    assert w.shape == (2, 5, 2, 5, 3)  # [layers, embed, kv_heads, 6 / 2 queries + key + value, head_dim]
    for head in range(6):  # query head i is grouped-query attention's head of key/value head i // 3
        np.testing.assert_array_equal(w[:, :, head // 3, head % 3], wq[:, :, head])
    np.testing.assert_array_equal(w[:, :, :, 3], wk)
    np.testing.assert_array_equal(w[:, :, :, 4], wv)
    tree = {"attn": {"wq": wq, "wk": wk, "wv": wv}, "mlp": {"w_gate": wq[..., 0], "w_up": wq[..., 1], "w_down": wk},
            "experts": {"router": wk, "w_gate": wq, "w_up": wq}}
    fused = fuse(tree)
    assert sorted(fused["attn"]) == ["w_qkv"] and sorted(fused["mlp"]) == ["w_down", "w_gate_up"]
    np.testing.assert_array_equal(fused["mlp"]["w_gate_up"][..., 1, :], wq[..., 1])
    assert fused["experts"].keys() == tree["experts"].keys()  # an MoE block's experts stay separate
    jax.tree.map(np.testing.assert_array_equal, unfuse(fused), tree)
    reader = separate_reader(lambda path: fused[path[0]][path[1]], {"attn.w_qkv", "experts.w_gate"})
    np.testing.assert_array_equal(reader(("attn", "wk")), wk)
    np.testing.assert_array_equal(reader(("experts", "w_gate")), wq)  # saved as such: read as such


def loss_and_grads(config, params, devices=None):
    trainer = Trainer.build(config, devices)
    params = jax.device_put(params, trainer.param_shardings())
    loss, grads = trainer.loss_and_grads(params, trainer.batch(0))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def separate():
    """One device, separate projections: the initial parameters, loss and gradients."""
    trainer = Trainer.build(tiny_config(), jax.devices()[:1])
    params = jax.device_get(trainer.init_state().params)
    return params, *loss_and_grads(tiny_config(), params, jax.devices()[:1])


@pytest.mark.parametrize(
    ("rules", "mesh", "overrides"),
    [("dp", {}, ()), ("fsdp_tp", {"fsdp": 4, "tensor": 2}, ()), ("tp_sp", {"tensor": 2}, ("model.tp_overlap=true",))],
    ids=["one-device", "fsdp_tp", "tp_sp-collective-matmul"],
)
def test_fused_equals_separate_one_device(rules, mesh, overrides, separate):
    params, ref_loss, ref_grads = separate
    devices = jax.devices()[: int(np.prod(list(mesh.values())))] if mesh else jax.devices()[:1]
    loss, grads = loss_and_grads(tiny_config(FUSED, *overrides, rules=rules, mesh=mesh), fuse(params), devices)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_trees_close(unfuse(grads), ref_grads, rtol=1e-5)


def test_fused_with_fp8_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^model\.fused_projections: not supported with precision\.fp8"):
        tiny_config(FUSED, "precision.fp8=current")
