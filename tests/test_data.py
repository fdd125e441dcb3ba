"""Data: prepare-data round trips through both tokenizer kinds, the packed loader, per-process slices, eval."""

from __future__ import annotations

import hashlib
import itertools
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_config
from jax.sharding import NamedSharding

from jaxscale import cli
from jaxscale.config.read import ConfigError, load_config
from jaxscale.data.batches import (
    Batches,
    PackedBatches,
    builtin_bytes,
    byte_streams,
    make_loader,
    process_rows,
    stdlib_bytes,
)
from jaxscale.data.prepare import TokenDir, document_hash, prepare_data
from jaxscale.layout.mesh import make_mesh
from jaxscale.training.loop import evaluate, fit
from jaxscale.training.trainer import BATCH_AXES, Trainer

DOCS = [
    "héllo wörld\nsecond line, ünïcode ✓",
    "def f(x):\n    return x * 2\n",
    "the quick brown fox jumps over the lazy dog",
    "日本語のテキスト and mixed text",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "a final document",
]


def write_inputs(tmp_path: Path) -> list[str]:
    """The documents as two plain text files and a JSONL file (with an extra field)."""
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(DOCS[1], encoding="utf-8")
    lines = [json.dumps({"id": i, "text": doc}) for i, doc in enumerate(DOCS[2:])]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [str(tmp_path / name) for name in ("a.txt", "b.txt", "docs.jsonl")]


def decoded_documents(directory: Path, split: str) -> list[str]:
    """Every document of a split, decoded; checks each is followed by the end-of-document token."""
    data = TokenDir.open(directory)
    tokens, starts = np.asarray(data.tokens(split)), data.documents(split)
    tokenizer = data.tokenizer()
    assert starts[-1] == len(tokens)
    assert all(tokens[end - 1] == data.meta["eod_id"] for end in starts[1:])
    return [tokenizer.decode(tokens[a : b - 1]) for a, b in itertools.pairwise(starts)]


def assert_round_trip(directory: Path, val_fraction: float) -> None:
    hashes = [document_hash(doc) for doc in DOCS]
    held_out = [h in sorted(hashes)[: round(len(DOCS) * val_fraction)] for h in hashes]  # the lowest hashes
    assert any(held_out) and not all(held_out)
    assert decoded_documents(directory, "train") == [d for d, h in zip(DOCS, held_out, strict=True) if not h]
    assert decoded_documents(directory, "val") == [d for d, h in zip(DOCS, held_out, strict=True) if h]


def test_prepare_data_round_trips_through_the_byte_tokenizer(tmp_path, capsys):
    out = tmp_path / "bytes"
    assert cli.main(["prepare-data", *write_inputs(tmp_path), "--out", str(out), "--val-fraction", "0.3"]) == 0
    assert "vocab_size 257, uint16" in capsys.readouterr().out
    meta = TokenDir.open(out).meta
    assert (meta["vocab_size"], meta["eod_id"], meta["dtype"]) == (257, 256, "uint16")
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(DOCS)
    assert_round_trip(out, 0.3)


def train_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE tokenizer.json, trained here on the test documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS * 4, trainer)
    tokenizer.save(str(path))


def test_prepare_data_round_trips_through_a_tokenizer_json(tmp_path):
    train_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "bpe"
    meta = prepare_data(write_inputs(tmp_path), out, str(tmp_path / "tokenizer.json"), val_fraction=0.3)
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert meta["vocab_size"] == reference.get_vocab_size() and meta["eod_id"] == reference.token_to_id("<|endoftext|>")
    assert meta["dtype"] == "uint16" and (out / "tokenizer.json").exists()
    assert meta["splits"]["train"]["tokens"] < sum(len(d.encode()) for d in DOCS)  # merges were applied
    assert_round_trip(out, 0.3)


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w65999 w69999")
    meta = prepare_data([tmp_path / "a.txt"], tmp_path / "out", str(tmp_path / "tokenizer.json"), val_fraction=0.0)
    assert meta["dtype"] == "uint32" and meta["eod_id"] == 70_001
    assert decoded_documents(tmp_path / "out", "train") == ["w1 w65999 w69999"]


def test_prepare_data_errors_name_the_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no string field 'text'$"):
        prepare_data([bad], tmp_path / "out")
    assert cli.main(["prepare-data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith("input file not found: " + str(tmp_path / "missing.txt"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"no end-of-document token among .*; name one with --eod-token"):
        prepare_data([bad], tmp_path / "out", str(tmp_path / "tokenizer.json"))


def sequence_ids(windows: np.ndarray, seq_len: int) -> list[int]:
    """The packed sequence each window is, for tokens ``arange(n)``: its first token / seq_len."""
    return [int(w[0]) // seq_len for w in windows]


def test_packed_loader_packs_shuffles_per_epoch_and_is_deterministic():
    seq_len, batch, count = 8, 4, 12
    tokens = np.arange(count * seq_len + 1, dtype=np.uint16)
    loader = PackedBatches(tokens, batch, seq_len, seed=3, identity={})
    rows = loader.rows(0)
    np.testing.assert_array_equal(rows["targets"][:, :-1], rows["inputs"][:, 1:])
    np.testing.assert_array_equal(np.diff(rows["inputs"], axis=1), 1)  # consecutive tokens of one stream
    epochs = [[i for step in range(e * 3, e * 3 + 3) for i in sequence_ids(loader.rows(step)["inputs"], seq_len)]
              for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(count))  # every sequence once per epoch
    assert epochs[0] != epochs[1] and epochs[0] != list(range(count))  # shuffled, afresh each epoch
    again = PackedBatches(tokens, batch, seq_len, seed=3, identity={})
    other = PackedBatches(tokens, batch, seq_len, seed=4, identity={})
    np.testing.assert_array_equal(again.rows(4)["inputs"], loader.rows(4)["inputs"])
    assert not np.array_equal(other.rows(4)["inputs"], loader.rows(4)["inputs"])
    assert loader.state(4)["epoch"] == 1 and loader.state(4)["sequences_read"] == 16


def test_byte_sources_keep_their_batches():
    """Windows at offsets drawn from (seed, step); the held-out bytes are the stream's last ``eval_bytes``."""
    train, held_out = byte_streams("stdlib", 30_000, 20_000)
    tokens = stdlib_bytes(50_000)
    np.testing.assert_array_equal(train, tokens[:30_000])
    np.testing.assert_array_equal(held_out, tokens[30_000:])
    loader = Batches(tokens, 8, 16, seed=5)
    offsets = np.random.default_rng([5, 7]).integers(0, len(tokens) - 17, size=8)
    np.testing.assert_array_equal(loader.rows(7)["inputs"], [tokens[o : o + 16] for o in offsets])


def test_the_default_corpus_is_the_same_on_every_machine():
    """The default source is the corpus shipped with the package: these 620,448 bytes on every Python. The
    stream is its first ``max_bytes + eval_bytes`` (all of it by default), the last ``eval_bytes`` held out."""
    defaults = load_config(None).data
    assert (defaults.source, defaults.max_bytes, defaults.eval_bytes) == ("builtin", 8_000_000, 60_000)
    corpus = builtin_bytes(10**7)
    assert len(corpus) == 620_448
    assert hashlib.sha256(corpus.tobytes()).hexdigest() == (
        "64d02dc560da7ce9aeeca15abb0d48be1415c47cfb4b4f922392debab5289b0c"
    )
    train, held_out = byte_streams("builtin", 8_000_000, 60_000)
    np.testing.assert_array_equal(train, corpus[:560_448])
    np.testing.assert_array_equal(held_out, corpus[560_448:])
    config = tiny_config()  # data.max_bytes=200000
    train, held_out = make_loader(config, "train"), make_loader(config, "eval")
    np.testing.assert_array_equal(train.tokens, corpus[:200_000])
    np.testing.assert_array_equal(held_out.tokens, corpus[200_000:260_000])
    assert train.identity["source"] == "builtin" and held_out.identity["split"] == "eval"
    with pytest.raises(ConfigError, match=r"data\.eval_bytes \(620448\) leaves no training bytes of the 620448"):
        make_loader(tiny_config("data.eval_bytes=620448"))


@pytest.mark.parametrize(
    ("mesh", "processes"),
    [({"data": 8}, 8), ({"data": 2, "fsdp": 2, "tensor": 2}, 4), ({"fsdp": 4, "tensor": 2}, 2)],
)
def test_process_slices_are_disjoint_and_cover_the_global_batch(mesh, processes):
    """Processes own consecutive blocks of the mesh (its outer axes); each reads only its rows."""
    config = tiny_config(mesh=mesh)
    jax_mesh = make_mesh(config.mesh)
    from jaxscale.layout.sharding import Rules

    sharding = NamedSharding(jax_mesh, Rules.load("fsdp_tp").spec(BATCH_AXES))
    shape = (16, 32)
    devices = list(jax_mesh.devices.flat)
    per = len(devices) // processes
    ranges = [process_rows(sharding, shape, devices[p * per : (p + 1) * per]) for p in range(processes)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 16
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # disjoint, no gap
    tokens = np.arange(40 * 32 + 1, dtype=np.uint16)
    loader = PackedBatches(tokens, 16, 32, seed=0, identity={})
    pieces = [loader.rows(3, start, stop)["inputs"] for start, stop in ranges]
    np.testing.assert_array_equal(np.concatenate(pieces), loader.rows(3)["inputs"])


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    """Byte tokens of 40 standard-library files, a quarter of the documents held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:40]
    out = tmp_path_factory.mktemp("tokens")
    prepare_data(files, out, "byte", val_fraction=0.25)
    return out


def test_eval_loss_is_logged_on_the_held_out_split(token_dir, tmp_path):
    overrides = ["data.source=tokens", f"data.path={token_dir}", "model.vocab_size=264", "train.steps=4",
                 "train.eval_every=2", "train.eval_steps=2", f"run_dir={tmp_path}"]
    trainer = Trainer.build(tiny_config(*overrides, mesh={"data": 8}))
    state, history = fit(trainer, progress=False)
    evals = [r for r in history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert evals[-1]["eval_loss"] == evaluate(trainer, state.params)
    held_out = np.asarray(TokenDir.open(token_dir).tokens("val"))
    first = trainer.eval_batches.rows(0)["inputs"]
    np.testing.assert_array_equal(first[0], held_out[:32])  # the val split, read in order
    assert make_loader(trainer.config).identity["source"] == "tokens"
    assert 2.0 < evals[-1]["eval_loss"] < np.log(264) + 0.5


def test_token_data_is_checked_before_compiling(token_dir):
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(256\) is below the 257 tokens of data\.path="):
        Trainer.build(tiny_config("data.source=tokens", f"data.path={token_dir}", mesh={"data": 8}))
    with pytest.raises(ConfigError, match=r"data\.path: required with data\.source=tokens"):
        tiny_config("data.source=tokens")
    with pytest.raises(ConfigError, match=r"data\.path: .* has no meta\.json"):
        Trainer.build(tiny_config("data.source=tokens", f"data.path={token_dir.parent}", "model.vocab_size=264",
                                  mesh={"data": 8}))
