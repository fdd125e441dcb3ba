"""Sources: Parquet, Arrow and saved ``datasets`` directories read by prepare-data and as ``data.path`` (tokenized
once into the cache, ``data.cache_dir``, nothing written beside the data), and their errors."""

from __future__ import annotations

import itertools
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_config

from jaxscale import cli
from jaxscale.config.read import ConfigError
from jaxscale.data.prepare import TokenDir, document_hash, held_out_below, prepare_data
from jaxscale.data.tokencache import token_dir
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def texts() -> list[str]:
    """30 standard-library sources: enough tokens for the tiny model's batches in both splits."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))[:30]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """The same documents as JSONL, Parquet (two row groups), Arrow IPC and a saved datasets dataset."""
    root = tmp_path_factory.mktemp("corpus")
    docs = texts()
    (root / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    table = pa.table({"id": list(range(len(docs))), "body": docs})
    pq.write_table(table, root / "docs.parquet", row_group_size=len(docs) // 2)
    with pa.ipc.new_file(str(root / "docs.arrow"), table.schema) as writer:
        writer.write_table(table)
    out = {"jsonl": root / "docs.jsonl", "parquet": root / "docs.parquet", "arrow": root / "docs.arrow"}
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(root / "saved"))
    out["datasets"] = root / "saved"
    return out


def test_every_form_prepares_to_the_same_tokens(corpus, tmp_path):
    prints = {}
    for kind, path in corpus.items():
        meta = prepare_data([path], tmp_path / kind, text_field="body")
        prints[kind] = meta["fingerprint"]
        assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(texts())
    assert len(set(prints.values())) == 1, prints
    data = TokenDir.open(tmp_path / "parquet")
    tokens, starts = np.asarray(data.tokens("train")), data.documents("train")
    assert all(tokens[b - 1] == 256 for b in starts[1:])  # each document ends with end-of-document
    decoded = [bytes(tokens[a : b - 1].tolist()).decode() for a, b in itertools.pairwise(starts)]
    cutoff = held_out_below([document_hash(d) for d in texts()], 0.01)
    assert decoded == [d for d in texts() if document_hash(d) >= cutoff]  # the bytes, in order


def test_a_parquet_file_and_a_saved_dataset_train_from_the_cache(corpus, tmp_path):
    before = sorted(p.name for p in corpus["parquet"].parent.iterdir())
    base = ["data.source=tokens", "data.text_field=body", "model.vocab_size=264", f"run_dir={tmp_path}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    trainer = Trainer.build(tiny_config(*base, f"data.path={corpus['parquet']}", mesh={"data": 8}))
    cache = list((tmp_path / "cache").iterdir())
    assert len(cache) == 1 and cache[0].name.startswith("docs.parquet-") and (cache[0] / "meta.json").is_file()
    written = (cache[0] / "meta.json").stat().st_mtime_ns
    state, history = fit(trainer, progress=False)
    losses = [r["loss"] for r in history if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # Built again: the cache is read, not written again.
    assert token_dir(corpus["parquet"], trainer.config.data) == cache[0]
    assert (cache[0] / "meta.json").stat().st_mtime_ns == written

    saved = Trainer.build(tiny_config(*base, f"data.path={corpus['datasets']}", mesh={"data": 8}))
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()) == ["docs.parquet", "saved"]
    assert sorted(p.name for p in corpus["parquet"].parent.iterdir()) == before  # nothing beside the data
    batch, same = saved.batches.rows(0), trainer.batches.rows(0)
    for key in batch:
        np.testing.assert_array_equal(batch[key], same[key])
    step = trainer.compiled_guarded_step[0]  # the same shapes and layout: the step fit compiled
    _, out = step(state, saved.batch(2))
    assert np.isfinite(float(out["loss"]))


def test_bad_sources_are_one_line(corpus, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"docs\.parquet: no column 'text' \(columns: id, body\)$"):
        prepare_data([corpus["parquet"]], tmp_path / "a")
    with pytest.raises(ConfigError, match=r"docs\.arrow: no column 'text' \(columns: id, body\)$"):
        prepare_data([corpus["arrow"]], tmp_path / "b")
    assert cli.main(["prepare-data", str(tmp_path / "nowhere.parquet"), "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip().endswith("input file not found: " + str(tmp_path / "nowhere.parquet"))
    with pytest.raises(ConfigError, match=r"data\.path: .*missing\.parquet does not exist$"):
        Trainer.build(tiny_config("data.source=tokens", f"data.path={tmp_path / 'missing.parquet'}",
                                  mesh={"data": 8}))
    pq.write_table(pa.table({"body": ["text", None]}), tmp_path / "null.parquet")
    with pytest.raises(ConfigError, match=r"null\.parquet: row 1: field 'body' is None, not a string$"):
        prepare_data([tmp_path / "null.parquet"], tmp_path / "d", text_field="body")
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["x"]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"dict: a DatasetDict; name one split's directory \(train\)$"):
        prepare_data([tmp_path / "dict"], tmp_path / "e")
