"""``Trainer.logits``, the public forward: under ZeRO-3, FSDP x TP, expert parallelism (with routing biases),
an interleaved pipeline, ring attention and fp8 state, equal to one device's logits of the same state."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from helpers import ROOT, RTOL, tiny_config

from jaxscale.config.read import ConfigError, load_config
from jaxscale.inference.sampling import generate
from jaxscale.training.trainer import Trainer

TOKENS = np.random.default_rng(0).integers(0, 256, (8, 16), dtype=np.int32)
INTERLEAVED = ("model.layers=4", "pipeline.repeats=2", "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=4")
RING = ("model.attention=ring", "model.attention_block=2")  # 2 chunks of 2 tokens per device in the zig-zag
# moe-tiny under ep with DeepSeek's sign balancing (so the state holds routing biases); capacity for every token.
MOE = ["model=moe-tiny", "model.moe.balance=sign", "model.moe.capacity_factor=4", "train.global_batch=8",
       "train.seq_len=16", "data.max_bytes=100000"]


def one_device(config) -> Trainer:
    return Trainer.build(config, jax.devices()[:1])


def close(ours: jax.Array, ref: jax.Array) -> None:
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == (*TOKENS.shape, 256) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= RTOL * np.abs(ref).max()


def drawn(tree, seed: int, scale: float):
    """``tree``'s arrays redrawn at random (N(0, scale) magnitudes), each in its own sharding."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jax.device_put(np.abs(rng.normal(0, scale, a.shape)).astype(a.dtype), a.sharding), tree
    )


@pytest.mark.parametrize(
    "rules, mesh, extra",
    [("zero3", {"fsdp": 8}, ()), ("fsdp_tp", {"fsdp": 4, "tensor": 2}, ()),
     ("pp", {"stage": 2, "data": 4}, INTERLEAVED), ("cp", {"context": 4, "data": 2}, RING)],
)
def test_logits_under_a_layout_equal_one_devices(rules, mesh, extra):
    trainer = Trainer.build(tiny_config(*extra, rules=rules, mesh=mesh))
    one = one_device(tiny_config(*extra))  # the same seed: the same canonical parameters
    close(trainer.logits(trainer.init_state(), TOKENS), one.logits(one.init_state().params, TOKENS))
    if trainer.pipelined:  # the stack in the interleaved pipeline's storage, read back in the model's order
        assert not trainer.storage.canonical_order
    if rules == "cp":  # ring attention: the tokens in its zig-zag order, the logits back in theirs
        assert trainer.config.model.attention == "ring"


def test_a_user_models_logits_under_a_pipeline_equal_one_devices_and_it_generates():
    spec = importlib.util.spec_from_file_location("parallel_block", ROOT / "examples" / "parallel_block.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    extra = ("model.layers=4", "pipeline.microbatches=2")
    trainer = Trainer.build(tiny_config(*extra, rules="pp", mesh={"stage": 2, "data": 4}), model=example.ParallelLM)
    one = Trainer.build(tiny_config(*extra), jax.devices()[:1], model=example.ParallelLM)
    params = one.init_state().params
    ref = one.logits(params, TOKENS)
    close(trainer.logits(trainer.init_state(), TOKENS), ref)
    # Generation runs any model by its full forward: each greedy token is the argmax of the tokens so far.
    new = generate(one, params, TOKENS[:2, :4], 3).tokens
    rows = np.concatenate([TOKENS[:2, :4], new], axis=1)
    np.testing.assert_array_equal(new, np.asarray(one.logits(params, rows))[:, 3:-1].argmax(-1))


def test_logits_with_routing_biases_under_ep_equal_one_devices():
    config = load_config(None, [*MOE, "rules=ep", "mesh.expert=4", "mesh.data=2"])
    trainer = Trainer.build(config)
    state = trainer.init_state()
    state = state._replace(balance=drawn(state.balance, 1, 0.5))
    host = jax.device_get(state)
    one = one_device(load_config(None, MOE))
    ref = one.logits(host, TOKENS)
    close(trainer.logits(state, TOKENS), ref)
    # The biases choose the experts: bare parameters (a fresh start's zero biases) give other logits.
    assert np.abs(np.asarray(one.logits(host.params, TOKENS)) - np.asarray(ref)).max() > 1e-2


def test_logits_with_fp8_histories_equal_one_devices():
    overrides = ("precision.fp8=delayed",)
    trainer = Trainer.build(tiny_config(*overrides, rules="fsdp_tp", mesh={"fsdp": 4, "tensor": 2}))
    state = trainer.init_state()
    state = state._replace(fp8=drawn(state.fp8, 2, 4.0))  # amax histories: the scales the matmuls use
    host = jax.device_get(state)
    one = one_device(tiny_config(*overrides))
    ref = one.logits(host, TOKENS)
    close(trainer.logits(state, TOKENS), ref)
    assert np.abs(np.asarray(one.logits(host.params, TOKENS)) - np.asarray(ref)).max() > 1e-4


def test_logits_positions_and_bad_tokens():
    trainer = one_device(tiny_config())
    params = trainer.init_state().params
    shifted = np.broadcast_to(np.arange(0, 32, 2), TOKENS.shape)
    # Positions reach RoPE: rows spaced by 2 give other logits than 0, 1, ... (the default).
    assert np.abs(np.asarray(trainer.logits(params, TOKENS, shifted) - trainer.logits(params, TOKENS))).max() > 1e-6
    with pytest.raises(ConfigError, match=r"tokens must be \[batch, length\]"):
        trainer.logits(params, TOKENS[0])
    with pytest.raises(ConfigError, match="positions"):
        trainer.logits(params, TOKENS, shifted[:, :3])
    sharded = Trainer.build(tiny_config(rules="zero3", mesh={"fsdp": 8}))
    with pytest.raises(ConfigError, match=r"dimension 0 \('batch', size 3\) is not divisible"):
        sharded.logits(sharded.init_state().params, TOKENS[:3])
