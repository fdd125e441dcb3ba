"""Generation (jaxscale/inference/sampling.py, jaxscale/models/decode.py, ``jaxscale generate``): the key/value
cache's logits
equal the full forward's at every generated position (dense GQA, and a mixture of experts in groups of
blocks), sampling within the top k and seeded, the command on a run trained for a few steps, and the tokenizer
it reads (the run's, a converted checkpoint's, ``--tokenizer``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import tiny_config

from jaxscale.cli import main
from jaxscale.config.read import ConfigError
from jaxscale.data.prepare import ByteTokenizer, prepare_data
from jaxscale.inference.generate import text, tokenizer_of
from jaxscale.inference.sampling import generate
from jaxscale.training.trainer import Trainer

PROMPT = np.random.default_rng(0).integers(0, 256, (2, 5), dtype=np.int32)
NEW = 6
# Experts in every second layer (a stacked unit of two blocks), dropless: the decode's one token and the full
# forward's many route alike.
MOE = ("model.layers=4", "model.moe={}", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.mlp=32",
       "model.moe.every_n_layers=2", "model.moe.dispatch=dropless")


def trained_like(overrides: tuple[str, ...]) -> tuple[Trainer, dict]:
    """A one-device trainer and its initial parameters scaled up, so that the logits rank tokens decisively."""
    trainer = Trainer.build(tiny_config(*overrides), jax.devices()[:1])
    return trainer, jax.tree.map(lambda p: 4 * p, trainer.init_state().params)


@pytest.fixture(scope="module")
def dense():
    return trained_like(())


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_cached_decode_equals_the_full_forward_at_every_position(model, dense):
    trainer, params = dense if model == "dense" else trained_like(MOE)
    out = generate(trainer, params, PROMPT, NEW)
    assert out.tokens.shape == (2, NEW) and out.logits.shape == (2, NEW, 256)
    full = np.asarray(trainer.logits(params, np.concatenate([PROMPT, out.tokens], axis=1)))
    ref = full[:, PROMPT.shape[1] - 1: -1]  # the logits each new token was picked from
    assert np.abs(out.logits - ref).max() <= 1e-5 * np.abs(ref).max()
    np.testing.assert_array_equal(out.tokens, ref.argmax(-1))  # greedy
    # The recomputed forward (any model's path) picks the same tokens.
    np.testing.assert_array_equal(generate(trainer, params, PROMPT, NEW, cache=False).tokens, out.tokens)


def test_sampling_is_seeded_and_stays_in_the_top_k(dense):
    trainer, params = dense
    draw = generate(trainer, params, PROMPT, NEW, temperature=1.0, top_k=3, seed=7)
    ranks = (draw.logits > np.take_along_axis(draw.logits, draw.tokens[..., None], -1)).sum(-1)
    assert ranks.max() < 3  # fewer than 3 logits above each drawn token's
    np.testing.assert_array_equal(generate(trainer, params, PROMPT, NEW, temperature=1.0, top_k=3, seed=7).tokens,
                                  draw.tokens)
    others = [generate(trainer, params, PROMPT, NEW, temperature=1.0, top_k=3, seed=s).tokens for s in (8, 9)]
    assert any((o != draw.tokens).any() for o in others)
    with pytest.raises(ConfigError, match="--top-k must be between 0"):
        generate(trainer, params, PROMPT, NEW, top_k=300)
    with pytest.raises(ConfigError, match=r"token id 256, not below model\.vocab_size"):
        generate(trainer, params, np.full((1, 3), 256), NEW)


def test_generate_command_on_a_trained_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--no-progress", "--set", f"run_dir={run}", "train.steps=2", "checkpoint.every=2",
                 "train.seq_len=32", "train.warmup_steps=1"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > len("def \n")
    for argv, line in [
        ([str(run), "--prompt", ""], "--prompt is empty"),
        ([str(run), "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        ([str(tmp_path), "--prompt", "a"], "no complete checkpoint in"),
        ([str(tmp_path / "missing"), "--prompt", "a"], "does not exist"),
    ]:
        assert main(["generate", *argv]) == 2
        err = capsys.readouterr().err
        assert line in err and len(err.strip().splitlines()) == 1


def test_the_tokenizer_is_the_runs_or_the_checkpoints(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2, "</s>": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world")
    prepare_data([tmp_path / "a.txt"], tmp_path / "tokens", str(tmp_path / "tokenizer.json"), val_fraction=0.0)
    prepared = {"source": "tokens", "path": str(tmp_path / "tokens")}
    raw = {"source": "tokens", "path": str(tmp_path / "a.txt"), "tokenizer": str(tmp_path / "tokenizer.json")}
    for data in (prepared, raw):
        tok = tokenizer_of(None, data, tmp_path)
        assert tok.eod_id == 3 and tok.encode_batch(["hello world"])[0].tolist() == [0, 1]
        assert text(tok, [0, 1, 3, 0]) == "hello world"  # up to the end of document
    assert isinstance(tokenizer_of(None, {"source": "builtin"}, tmp_path), ByteTokenizer)
    assert isinstance(tokenizer_of("byte", prepared, tmp_path), ByteTokenizer)  # --tokenizer wins
    assert text(ByteTokenizer(), [104, 105, 0xFF, 256, 120]) == "hi\ufffd"
    converted = tmp_path / "ckpt"
    converted.mkdir()
    with pytest.raises(ConfigError, match=r"names no tokenizer: give --tokenizer byte or a tokenizer\.json$"):
        tokenizer_of(None, None, converted)
    (converted / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    assert tokenizer_of(None, None, converted).eod_id == 3
