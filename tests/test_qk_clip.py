"""QK-clip (jaxscale/training/qk_clip.py): a step scales exactly the heads whose largest logit exceeded tau, by
the factor written here from that logit, and leaves everything else as the step without it; under sharded and
context layouts the clipped run equals one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, fails_early, run_steps, tiny_config

from jaxscale.layout.sharding import param_name
from jaxscale.parallel.logit_max import QK_LOGITS
from jaxscale.training.trainer import Trainer

TAU = 0.08  # the test model's largest logits at its initial weights: 0.067 to 0.104 (some heads over, some under)
CLIP = (f"train.qk_clip={TAU}",)


def named(params) -> dict[str, np.ndarray]:
    return {param_name(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("kv_heads", [4, pytest.param(8, marks=pytest.mark.slow)], ids=["gqa", "mha"])
def test_a_step_scales_the_heads_over_tau(trainers, kv_heads):
    heads = (f"model.kv_heads={kv_heads}",)
    clipped, clipped_step = trainers.step(*CLIP, *heads, devices=1)
    plain, plain_step = trainers.step(*heads, devices=1)
    state, batch = clipped.init_state(), clipped.batch(0)
    # the step's largest logits per layer and head, at the weights it starts from (the kernels' tests check them)
    logits = np.asarray(jax.jit(clipped.loss_and_metrics)(state.params, batch)[1][QK_LOGITS], np.float64)
    assert (logits > TAU).any() and (logits < TAU).any()
    after, out = clipped_step(state, batch)
    want, _ = plain_step(plain.init_state(), batch)
    np.testing.assert_allclose(out["max_logit"], logits.max(-1), rtol=1e-6)
    got, ref = named(after.params), named(want.params)
    gamma = np.minimum(1.0, TAU / logits)  # [layers, heads]
    q_factor = gamma if kv_heads < 8 else np.sqrt(gamma)  # shared keys: the whole factor on the queries
    k_factor = np.ones((len(gamma), kv_heads)) if kv_heads < 8 else np.sqrt(gamma)
    np.testing.assert_allclose(got["blocks.attn.wq"], ref["blocks.attn.wq"] * q_factor[:, None, :, None], rtol=1e-6)
    np.testing.assert_allclose(got["blocks.attn.wk"], ref["blocks.attn.wk"] * k_factor[:, None, :, None], rtol=1e-6)
    for name in set(got) - {"blocks.attn.wq", "blocks.attn.wk"}:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    # the next forward on the same batch: the first layer's clipped heads (same input) now reach tau exactly
    again = np.asarray(jax.jit(clipped.loss_and_metrics)(after.params, batch)[1][QK_LOGITS])[0]
    unclipped = np.asarray(jax.jit(clipped.loss_and_metrics)(want.params, batch)[1][QK_LOGITS])[0]
    np.testing.assert_allclose(again, unclipped * gamma[0], rtol=1e-5)


MUON = ("train.optimizer=muon", "train.muon.ns_dtype=float32")  # MuonClip
LAYOUTS = {  # name -> (the run's settings, the layout's own, rules, mesh)
    "muon_fsdp_tp": (MUON, (), "fsdp_tp", {"fsdp": 4, "tensor": 2}),
    "cp_ring": ((), ("model.attention=ring", "model.attention_block=16"), "fsdp_cp", {"fsdp": 2, "context": 4}),
    "explicit_zero3": ((), ("mesh.axis_types=explicit",), "zero3", {"fsdp": 8}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "muon_fsdp_tp" else pytest.mark.slow)
                                  for n in LAYOUTS])
def test_clipped_steps_under_a_layout_are_one_device(trainers, name):
    settings, extra, rules, mesh = LAYOUTS[name]
    one = run_steps(*trainers.step(*CLIP, *settings, devices=1), steps=3)
    run = run_steps(*trainers.step(*CLIP, *settings, *extra, rules=rules, mesh=mesh), steps=3)
    for a, b in zip(run.metrics, one.metrics, strict=True):
        np.testing.assert_allclose(a["max_logit"], b["max_logit"], rtol=1e-5)
    assert_trees_close(run.params, one.params)


DEEPSEEK = ("model=deepseek-v3-tiny", "train.seq_len=32")
NOPE = 16  # configs/models/deepseek-v3-tiny.yaml: qk_nope_head_dim (then 8 rotary columns)


@pytest.mark.slow
def test_mla_scales_the_heads_own_parts_as_kimi_k2(trainers):
    """Multi-head latent attention: each head's non-rotary query and key columns by sqrt(gamma), its rotary query
    columns by gamma; the shared rotary key (wkv_a), the values and the MTP depth's attention untouched."""
    clipped, clipped_step = trainers.step(*DEEPSEEK, "train.qk_clip=0.045", devices=1)
    plain, plain_step = trainers.step(*DEEPSEEK, devices=1)
    state, batch = clipped.init_state(), clipped.batch(0)
    logits = np.asarray(jax.jit(clipped.loss_and_metrics)(state.params, batch)[1][QK_LOGITS], np.float64)
    assert logits.shape == (3, 4) and (logits > 0.045).any() and (logits < 0.045).any()
    gamma = np.minimum(1.0, 0.045 / logits)
    got, ref = named(clipped_step(state, batch)[0].params), named(plain_step(plain.init_state(), batch)[0].params)
    want = dict(ref)
    for stack, rows in (("dense", gamma[:1]), ("blocks", gamma[1:])):  # the dense block is the model's first
        root, full = np.sqrt(rows)[:, None, :, None], rows[:, None, :, None]
        wq, wkv = ref[f"{stack}.attn.wq_b"].copy(), ref[f"{stack}.attn.wkv_b"].copy()
        wq[..., :NOPE] *= root
        wq[..., NOPE:] *= full
        wkv[..., :NOPE] *= root
        want[f"{stack}.attn.wq_b"], want[f"{stack}.attn.wkv_b"] = wq, wkv
    for name in ref:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


def test_what_qk_clip_cannot_serve_is_one_line():
    from test_own_model import factory

    with fails_early(r"^train\.qk_clip must be positive, got 0\.0$"):
        tiny_config("train.qk_clip=0")
    with fails_early(r"^train\.qk_clip: with model\.qk_norm "):
        tiny_config(*CLIP, "model.qk_norm=true")
    with fails_early(r"^train\.qk_clip: QK-clip scales the built-in models' attention weights"):
        Trainer.build(tiny_config(*CLIP), jax.devices()[:1], model=factory)
