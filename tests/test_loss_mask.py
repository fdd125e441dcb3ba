"""Loss masks: prompt/response records train on the response only; the loss is the mean over the trained
targets of the global batch, the same with gradient accumulation, the chunked loss and a pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, rel_err, tiny_config

from jaxscale.config.read import ConfigError
from jaxscale.data.batches import IGNORE
from jaxscale.data.prepare import TokenDir, prepare_data
from jaxscale.ops.loss import chunked_cross_entropy, cross_entropy
from jaxscale.training.trainer import Trainer

B, S, E, V = 4, 24, 16, 300


def masked_inputs():
    kh, kw, kt, km = jax.random.split(jax.random.key(1), 4)
    hidden = jax.random.normal(kh, (B, S, E))
    w = 0.3 * jax.random.normal(kw, (E, V))
    targets = jax.random.randint(kt, (B, S), 0, V)
    return hidden, w, jnp.where(jax.random.bernoulli(km, 0.4, (B, S)), IGNORE, targets)


def reference_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean of -log softmax(logits)[target] over the trained positions, in float64."""
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    keep = targets >= 0
    return float(-np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0][keep].mean())


def test_masked_targets_leave_the_mean_and_have_no_gradient():
    hidden, w, targets = masked_inputs()
    logits = jnp.einsum("bse,ev->bsv", hidden, w)
    assert rel_err(cross_entropy(logits, targets), reference_loss(logits, np.asarray(targets))) <= 1e-6
    d_logits = jax.grad(cross_entropy)(logits, targets)
    masked = np.asarray(targets) < 0
    assert masked.sum() > 10 and np.all(np.asarray(d_logits)[masked] == 0)
    assert np.all(np.abs(np.asarray(d_logits)[~masked]).sum(-1) > 0)
    # The chunked loss: the same value and gradients, zero for the hidden states of a masked position.
    plain = jax.value_and_grad(lambda h, w_: cross_entropy(jnp.einsum("bse,ev->bsv", h, w_), targets), (0, 1))
    want, want_grads = jax.jit(plain)(hidden, w)
    for chunk in (1, 8):
        got, grads = jax.jit(jax.value_and_grad(chunked_cross_entropy, (0, 1)), static_argnums=3)(
            hidden, w, targets, chunk)
        assert rel_err(got, want) <= 1e-6
        for g, r in zip(grads, want_grads, strict=True):
            assert rel_err(g, r) <= 1e-6
        assert np.all(np.asarray(grads[0])[masked] == 0)
    nothing = jnp.full_like(targets, IGNORE)
    assert float(cross_entropy(logits, nothing)) == 0.0 and not np.any(jax.grad(cross_entropy)(logits, nothing))


def qa_records(count: int = 80) -> list[dict[str, str]]:
    """Prompts and responses of uneven lengths (the microbatches then hold different numbers of trained tokens)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return [{"q": "Q: " + " ".join(rng.choice(words, rng.integers(1, 12))),
             "a": " ".join(rng.choice(words, rng.integers(1, 6)))} for _ in range(count)]


@pytest.fixture(scope="module")
def qa(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_records()))
    return path


def test_prepare_data_masks_the_prompt(qa, tmp_path):
    meta = prepare_data([qa], tmp_path / "out", prompt_field="q", response_field="a", val_fraction=0.0)
    data = TokenDir.open(tmp_path / "out")
    tokens, mask, starts = np.asarray(data.tokens("train")), np.asarray(data.mask("train")), data.documents("train")
    assert meta["masked"] and len(mask) == len(tokens)
    for record, a, b in zip(qa_records(), starts[:-1], starts[1:], strict=True):
        prompt = len(record["q"].encode())
        assert bytes(tokens[a : a + prompt].tolist()).decode() == record["q"]
        assert not mask[a : a + prompt].any() and mask[a + prompt : b].all()  # the response and its eod
        assert bytes(tokens[a + prompt : b - 1].tolist()).decode() == record["a"]


def qa_config(qa: Path, *overrides: str, **layout):
    return tiny_config("data.source=tokens", f"data.path={qa}", "data.prompt_field=q", "data.response_field=a",
                       "model.vocab_size=264", *overrides, **layout)


@pytest.fixture(scope="module")
def one_device(qa):
    """One device, no accumulation: a masked batch from the prompt/response set, the state, loss and grads."""
    trainer = Trainer.build(qa_config(qa), jax.devices()[:1])
    state = trainer.init_state()
    batch = trainer.batch(0)
    loss, grads = trainer.loss_and_grads(state.params, batch)
    return trainer, jax.device_get(state.params), jax.device_get(batch), float(loss), grads


def test_the_loss_is_the_mean_over_response_tokens_and_prompts_have_no_gradient(one_device):
    trainer, params, batch, loss, grads = one_device
    targets = batch["targets"]
    assert 0.2 < (targets == IGNORE).mean() < 0.8  # prompts are masked, responses trained

    def model_logits(p):
        with trainer.scope():
            return nnx.merge(trainer.graphdef, p)(jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"]))

    logits = jax.jit(model_logits)(params)
    assert rel_err(loss, reference_loss(logits, targets)) <= 1e-5

    def trained_only(p):  # the formula: the trained positions' cross-entropy, gathered by a boolean index
        lp = jax.nn.log_softmax(model_logits(p).astype(jnp.float32))
        keep = np.nonzero(targets >= 0)
        return -jnp.mean(lp[keep[0], keep[1], targets[keep]])

    assert_trees_close(grads, jax.jit(jax.grad(trained_only))(params))


def test_accumulation_equals_one_batch_under_masks(one_device, qa):
    _, params, batch, ref_loss, ref_grads = one_device
    trainer = Trainer.build(qa_config(qa, "train.microbatches=4"), jax.devices()[:1])
    loss, grads = trainer.loss_and_grads(params, batch)
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_trees_close(grads, ref_grads)
    # The test has teeth: the plain mean of the microbatches' means is not the batch's mean.
    counts = [(batch["targets"][i::4] >= 0).sum() for i in range(4)]
    assert len(set(counts)) > 1


def test_a_pipeline_and_data_shards_equal_one_device_under_masks(one_device, qa):
    _, params, batch, ref_loss, ref_grads = one_device
    trainer = Trainer.build(qa_config(qa, "pipeline.microbatches=4", rules="pp", mesh={"stage": 2, "data": 4}))
    placed = jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), placed)
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_trees_close(grads, ref_grads)


def test_bad_prompt_response_input_is_one_line(qa, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a", "a": "b"}\n{"q": "no response"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no string field 'a'$"):
        prepare_data([bad], tmp_path / "out", prompt_field="q", response_field="a")
    with pytest.raises(ConfigError, match=r"--prompt-field and --response-field go together"):
        prepare_data([qa], tmp_path / "out2", prompt_field="q")
