"""Chunked cross-entropy equals the plain one (value and gradients), alone and in the model under a sharded
layout; ``model.attention: auto`` resolves to a concrete kernel."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_trees_close, rel_err, tiny_config

from jaxscale.analysis.hlo_compute import scoped_bytes
from jaxscale.config.read import ConfigError
from jaxscale.models.attention import resolve_attention
from jaxscale.ops.loss import HEAD_GRADIENT, chunked_cross_entropy, cross_entropy
from jaxscale.training.trainer import Trainer

B, S, E, V = 4, 24, 16, 300


def inputs(dtype=jnp.float32):
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (B, S, E)).astype(dtype)
    w = (0.3 * jax.random.normal(kw, (E, V))).astype(dtype)
    return hidden, w, jax.random.randint(kt, (B, S), 0, V)


def plain(hidden, w, targets):
    return cross_entropy(jnp.einsum("bse,ev->bsv", hidden, w), targets)


@pytest.mark.parametrize("chunk", [1, 8, S])
def test_chunked_equals_plain_fp32(chunk):
    hidden, w, targets = inputs()
    want, want_grads = jax.value_and_grad(plain, (0, 1))(hidden, w, targets)
    got, grads = jax.jit(jax.value_and_grad(chunked_cross_entropy, (0, 1)), static_argnums=3)(hidden, w, targets, chunk)
    assert rel_err(got, want) <= 1e-6
    for g, r in zip(grads, want_grads, strict=True):
        assert rel_err(g, r) <= 1e-6


def test_chunked_bf16_accumulates_in_fp32():
    """bf16 inputs: the loss is the fp32 loss of the same (rounded) inputs; gradients to bf16 precision."""
    hidden, w, targets = inputs(jnp.bfloat16)
    want, want_grads = jax.value_and_grad(plain, (0, 1))(hidden.astype(jnp.float32), w.astype(jnp.float32), targets)
    got, grads = jax.value_and_grad(chunked_cross_entropy, (0, 1))(hidden, w, targets, 6)
    assert got.dtype == jnp.float32 and rel_err(got, want) <= 1e-5
    for g, r in zip(grads, want_grads, strict=True):
        assert g.dtype == jnp.bfloat16 and rel_err(g, r) <= 1e-2


def test_chunk_must_divide_the_sequence():
    hidden, w, targets = inputs()
    with pytest.raises(ValueError, match="chunk 5 does not divide the sequence length 24"):
        chunked_cross_entropy(hidden, w, targets, 5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.loss_chunk=-1", r"^model\.loss_chunk must be at least 0 \(0: the plain loss\), got -1$"),
        ("model.loss_chunk=5", r"^model\.loss_chunk \(5\) does not divide train\.seq_len \(32\)$"),
        ("model.attention=flash", r"^model\.attention: 'flash' is not one of dot, blockwise, ring, cudnn, auto$"),
    ],
)
def test_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(override)


def grads_of(config, devices=None):
    """Loss and gradients at the initial parameters, and the compiled program's text and temp bytes."""
    trainer = Trainer.build(config, devices)
    state = trainer.init_state()
    batch = trainer.batch(0)
    compiled = trainer.jit_loss_and_grads.lower(state.params, batch).compile()
    loss, grads = compiled(state.params, batch)
    return float(loss), grads, compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


MODEL = ["model.vocab_size=8192", "model.tie_embeddings=true"]
SHARDED = {"rules": "fsdp_tp_sp", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}


@pytest.fixture(scope="module")
def reference():
    """One device, the plain loss."""
    return grads_of(tiny_config(*MODEL), jax.devices()[:1])


@pytest.fixture(scope="module")
def sharded():
    """fsdp_tp_sp on 8 devices, the chunked loss: 4 tokens of 32 a chunk, so 8 vocabulary slices."""
    return grads_of(tiny_config(*MODEL, "model.loss_chunk=4", **SHARDED))


def test_model_loss_chunked_with_accumulation_equals_plain_one_device(reference):
    """Tied embeddings: the head is the embedding, its gradient the sum of both uses."""
    ref_loss, ref_grads, _, _ = reference
    loss, grads, _, _ = grads_of(tiny_config(*MODEL, "model.loss_chunk=8", "train.microbatches=2"), jax.devices()[:1])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_trees_close(grads, ref_grads)


def test_model_loss_chunked_sharded_equals_plain_one_device(sharded, reference):
    ref_loss, ref_grads, _, _ = reference
    loss, grads, _, _ = sharded
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_trees_close(grads, ref_grads)


def test_chunked_step_never_holds_the_logits(sharded):
    """Under fsdp_tp_sp no per-device [batch, length, vocab/tensor] buffer is compiled, and temp memory falls."""
    _, _, plain_text, plain_temp = grads_of(tiny_config(*MODEL, **SHARDED))
    _, _, text, temp = sharded
    logits = "f32[4,32,4096]"  # 16 sequences over data x fsdp, 32 tokens, 8192 words over tensor
    assert logits in plain_text and logits not in text
    assert "f32[4,32,1,512]" in text  # one slice: [rows, tokens, tensor shard, 4096 / 8 words]
    assert temp < plain_temp - 4 * 32 * 4096 * 4 / 2, (temp, plain_temp)  # at least half of that buffer less


def test_head_gradient_bytes_and_temp_memory_do_not_grow_with_the_chunks(sharded):
    """2 vocabulary slices against 8: the head gradient's instructions write the same bytes per step (each
    slice's gradient once, no accumulator rewritten per slice), and temp memory does not grow."""
    trainer = Trainer.build(tiny_config(*MODEL, "model.loss_chunk=16", **SHARDED))
    state = trainer.abstract_state()
    compiled = trainer.jit_loss_and_grads.lower(state.params, trainer.abstract_batch()).compile()
    two, eight = compiled.as_text(), sharded[2]
    assert "f32[4,32,1,2048]" in two and "f32[4,32,1,512]" in eight  # 2 and 8 slices
    # Per device the head is [64 embed, 4096 words]: its fp32 gradient is 1 MiB, written once by the dot, once
    # by its sum over fsdp (all-reduce on CPU), then halved (the fsdp slice) and summed over data: 3 MiB.
    head = 64 * 4096 * 4
    assert scoped_bytes(two, HEAD_GRADIENT) == scoped_bytes(eight, HEAD_GRADIENT)
    assert 3 * head <= scoped_bytes(eight, HEAD_GRADIENT) <= 3 * head + 64
    assert sharded[3] <= compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    ("platform", "overrides", "seq_len", "context", "want"),
    [
        ("cpu", [], 32, 1, "dot"),
        ("cpu", [], 4096, 1, "blockwise"),
        ("cpu", ["model.attention_block=8"], 33, 1, "blockwise"),
        ("gpu", ["model.dtype=bfloat16"], 32, 1, "cudnn"),
        ("gpu", ["model.dtype=float32"], 4096, 1, "blockwise"),
        ("gpu", ["model.dtype=bfloat16", "model.head_dim=12"], 32, 1, "dot"),
        ("tpu", ["model.dtype=bfloat16"], 32, 1, "dot"),
        ("gpu", ["model.dtype=bfloat16"], 32, 4, "ring"),
    ],
)
def test_resolve_attention(platform, overrides, seq_len, context, want):
    model = tiny_config("model.attention=auto", *overrides).model
    assert resolve_attention(model, platform, seq_len, context) == want
    assert resolve_attention(tiny_config(*overrides).model, platform, seq_len, context) == "dot"  # explicit: kept


def test_trainer_resolves_auto_attention():
    assert Trainer.build(tiny_config("model.attention=auto"), jax.devices()[:1]).config.model.attention == "dot"
    cp = Trainer.build(tiny_config("model.attention=auto", rules="cp", mesh={"fsdp": 2, "context": 4}))
    assert cp.config.model.attention == "ring" and cp.sequence_order is not None
