"""Issue 37's last bad inputs and smaller findings: each one line (exit 2) before anything runs, or the
documented behaviour, with nothing left behind.

Settings ignored as written (``model.remat_names``, an empty ``run_dir``), command-line numbers out of range
(``plan --verify``, ``convert --max-shard-mb``), a finished run resumed, ``prepare-data`` interrupted or
given only empty records, raw ``data.path`` sources tokenized into the user's cache, a bench suite larger
than the host, a model whose output is not logits, exported files' modes, and the wording of a few lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY, compilations, fails_early, subprocess_env, tiny_config
from test_bad_input import one_line, sets, timed_main

from jaxscale import cli
from jaxscale.analysis import bench
from jaxscale.checkpoint import params as checkpoint
from jaxscale.config.mesh_size import mesh_shape
from jaxscale.config.read import ConfigError, MeshConfig, load_config
from jaxscale.config.schema import DataConfig
from jaxscale.data.prepare import prepare_data
from jaxscale.data.tokencache import cache_root
from jaxscale.hf import convert
from jaxscale.training.trainer import Trainer, abstract_model

# In this process: the 8 simulated devices of conftest.py.
EIGHT = [*TINY, "rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "train.log_every=1"]

# -- settings that would be ignored ------------------------------------------------------------------------


def test_remat_names_that_the_model_does_not_mark_are_refused_naming_its_names():
    with fails_early(r"^model\.remat_names: 'bogus' is not the checkpoint_name of any activation of this model "
                     r"\(its names: attention, attention_out, key, mlp_hidden, mlp_out, query, value\)$"):
        Trainer.build(tiny_config("model.remat=save_named", "model.remat_names=[query, bogus]"), jax.devices()[:1])
    with fails_early(r"^model\.remat_names: read only by model\.remat=save_named, not full \(set "):
        tiny_config("model.remat=full", "model.remat_names=[query]")


def test_remat_names_refused_by_the_command_line_in_one_line(capsys):
    code = timed_main(["train", "--no-progress", *sets(*EIGHT, "model.remat=save_named",
                                                       "model.remat_names=[bogus]")])
    one_line(capsys, code, "model.remat_names: 'bogus' is not the checkpoint_name", "(its names: attention, ")


def test_an_empty_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = timed_main(["train", "--no-progress", *sets(*EIGHT, "run_dir=")])
    one_line(capsys, code, "run_dir is empty: name a directory (run_dir=. for the working directory)")
    assert list(tmp_path.iterdir()) == []


# -- numbers out of range on the command line ----------------------------------------------------------------


@pytest.mark.parametrize("k", ["-1", "0"])
def test_plan_verify_below_one_is_refused(capsys, k):
    code = timed_main(["plan", "--model", "tiny", "--cluster", "h100", "--global-batch-tokens", "4096",
                       "--seq-len", "512", "--verify", k])
    one_line(capsys, code, f"--verify must be at least 1, got {k}")


@pytest.mark.parametrize("mb", ["0", "-5", "nan"])
def test_convert_max_shard_mb_not_positive_is_refused(tmp_path, capsys, mb):
    code = timed_main(["convert", "jaxscale-to-hf", "--from", str(tmp_path / "ckpt"), "--to", str(tmp_path / "hf"),
                       "--max-shard-mb", mb])
    one_line(capsys, code, f"--max-shard-mb must be positive (MiB per safetensors file), got {mb}")
    assert list(tmp_path.iterdir()) == []


# -- a finished run resumed ---------------------------------------------------------------------------------


def test_resuming_a_finished_run_says_so_in_one_line_without_compiling(tmp_path, capsys):
    run = [*EIGHT, f"run_dir={tmp_path}", "checkpoint.every=1"]
    assert cli.main(["train", "--no-progress", *sets(*run)]) == 0
    assert "metrics in " + str(tmp_path / "metrics.jsonl") in capsys.readouterr().out
    with compilations() as compiled:
        assert timed_main(["train", "--no-progress", "--resume", *sets(*run)]) == 0
    out, err = capsys.readouterr()
    assert out == (f"run_dir {tmp_path}: the run is finished: resumed at step 2, and train.steps is 2; "
                   "nothing to train\n")
    assert err == "" and compiled == []


# -- prepare-data: interrupted, stale work, empty records -----------------------------------------------------


def big_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A JSONL corpus that takes seconds to prepare, and a token directory already prepared from another."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(60_000)))
    small = tmp_path / "small.txt"
    small.write_text("a small document " * 20)
    prepare_data([small], tmp_path / "tok", val_fraction=0.0)
    return docs, tmp_path / "tok"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_prepare_overwrite_leaves_nothing(tmp_path, sig):
    docs, out = big_corpus(tmp_path)
    before = (out / "train.bin").read_bytes()
    args = [sys.executable, "-m", "jaxscale", "prepare-data", str(docs), "--out", str(out), "--overwrite"]
    # Ctrl-C's default disposition in the child: an xdist worker ignores SIGINT, and a child would inherit that.
    child = subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 60
        while not list(tmp_path.glob(".tok.partial-*")):  # preparing (a corpus that takes seconds)
            assert child.poll() is None and time.monotonic() < end, child.communicate()
            time.sleep(0.01)
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 128 + sig and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "small.txt", "tok"]
    assert (out / "train.bin").read_bytes() == before


def test_work_left_by_a_dead_process_is_removed_by_the_next_preparation(tmp_path, capsys):
    docs = tmp_path / "a.txt"
    docs.write_text("one document " * 30)
    dead = tmp_path / ".tok.partial-999999999"  # the form before the host was named; pid not running
    elsewhere = tmp_path / ".tok.partial-another-host-1"
    for path in (dead, elsewhere):
        path.mkdir()
        (path / "train.bin").write_bytes(b"x")
    assert cli.main(["prepare-data", str(docs), "--out", str(tmp_path / "tok")]) == 0
    err = capsys.readouterr().err
    assert err == f"jaxscale: warning: removed {dead}, left by process 999999999, which is no longer running\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [elsewhere.name, "a.txt", "tok"]  # another host's: kept


@pytest.mark.parametrize(
    "lines, fields, names",
    [
        (['{"q": "a", "a": ""}', '{"q": "b", "a": ""}'], ["--prompt-field", "q", "--response-field", "a"],
         "no training documents in 1 input file: all 2 records have an empty response field 'a' (a record with an "
         "empty response is skipped)"),
        (['{"text": ""}'], [], "no training documents in 1 input file: 1 record has an empty text field 'text'"),
        ([], [], "no training documents in 1 input file: they hold no records"),
    ],
)
def test_records_all_empty_name_the_field(tmp_path, capsys, lines, fields, names):
    (tmp_path / "qa.jsonl").write_text("".join(line + "\n" for line in lines))
    code = timed_main(["prepare-data", str(tmp_path / "qa.jsonl"), "--out", str(tmp_path / "out" / "deep"), *fields])
    one_line(capsys, code, names)
    assert [p.name for p in tmp_path.iterdir()] == ["qa.jsonl"]  # nor the parents it made


# -- raw sources: tokenized into the cache, never beside the data --------------------------------------------


def test_a_raw_file_as_data_path_is_prepared_into_the_cache(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "docs.jsonl").write_text("".join(json.dumps({"text": f"text {i} " * 400}) + "\n" for i in range(40)))
    cache = tmp_path / "cache"
    config = tiny_config("data.source=tokens", f"data.path={data / 'docs.jsonl'}", "model.vocab_size=264",
                         f"data.cache_dir={cache}")
    Trainer.build(config, jax.devices()[:1])
    assert [p.name for p in data.iterdir()] == ["docs.jsonl"]
    (entry,) = cache.iterdir()
    assert entry.name.startswith("docs.jsonl-") and (entry / "meta.json").is_file()


def test_a_raw_source_that_fails_leaves_nothing_anywhere(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    cache = tmp_path / "cache"
    config = tiny_config("data.source=tokens", f"data.path={tmp_path / 'bad.jsonl'}", f"data.cache_dir={cache}")
    with fails_early(r"bad\.jsonl:1: no string field 'text'"):
        Trainer.build(config, jax.devices()[:1])
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no bad.jsonl.tokens/, no cache directory


def test_the_default_cache_is_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root(DataConfig()) == tmp_path / "jaxscale" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(DataConfig()) == tmp_path / "home" / ".cache" / "jaxscale" / "tokens"


# -- bench: a suite larger than the host, refused from its prediction ---------------------------------------


def test_a_bench_suite_larger_than_a_24_gib_host_is_refused_before_running(tmp_path, capsys, monkeypatch):
    """The README's example: on an idle 24 GiB host (MemAvailable 24.5 GB) llama-150m's predicted 21.5 GB is
    more than the 0.8 of a CPU host a step may use."""
    monkeypatch.setattr(bench, "available_memory", lambda device: (24_465_530_880, True))
    monkeypatch.setattr(bench, "run_one", lambda *a, **k: pytest.fail("a run started"))
    code = timed_main(["bench", "--suite", "full", "--models", "tiny,llama-150m", "--out", str(tmp_path / "b.json")])
    one_line(capsys, code, "bench: run 'llama-150m' needs 21.5 GB (2.69 GB x 8 CPU devices, the analytic model's "
             "prediction) but a step may use 19.6 GB (0.8 of the 24.5 GB available)")
    assert not (tmp_path / "b.json").exists()


# -- a model whose output is not logits ----------------------------------------------------------------------


class Scores(nnx.Module):
    """A plain-form model that returns one score per token, [batch, length], where logits belong."""

    def __init__(self, config, rngs: nnx.Rngs):
        m = config.model
        self.embedding = nnx.Embed(m.vocab_size, m.embed, rngs=rngs,
                                   embedding_metadata={"out_sharding": ("vocab", "embed")})

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.embedding(tokens).sum(-1)


def test_a_model_returning_no_logits_names_the_contract():
    with fails_early(r"^model Scores: __call__\(tokens, positions\) returned shape \(16, 32\), not logits "
                     r"\[batch, length, vocab\] = \[16, 32, vocab\] \(the model contract, docs/models\.md\)"):
        Trainer.build(tiny_config(), jax.devices()[:1], model=Scores)


# -- files written with the user's umask ---------------------------------------------------------------------


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exported_safetensors_follow_the_umask(tmp_path, umask, mode):
    config = load_config(None, TINY)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0, 0.05, a.shape).astype(np.float32), abstract_model(config)[1])
    checkpoint.save_params(tmp_path / "ckpt", params, dataclasses.asdict(config.model))
    before = os.umask(umask)
    try:
        files = convert.jaxscale_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(before)
    assert [f.name for f in files] == ["model.safetensors"]
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {
        "model.safetensors": mode, "config.json": mode}


# -- what the README's commands write is ignored by git; wording ------------------------------------------------


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_the_readme_outputs_are_git_ignored():
    paths = ["data/corpus/train.bin", "bench.json", "memory.png", "plan.png", "ckpt/my-llama/x", "hf/finetuned/x"]
    done = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == paths


def test_one_device_is_singular():
    with pytest.raises(ConfigError, match=r"^mesh: data=8 needs 8 devices, but 1 is available$"):
        mesh_shape(MeshConfig(data=8, fsdp=1, tensor=1), 1)
    with fails_early(r"^pipeline\.layers_per_stage has 1 entry; it needs one per virtual stage, mesh\.stage \(2\)"):
        Trainer.build(tiny_config("pipeline.layers_per_stage=[2]", rules="pp", mesh={"stage": 2, "data": 4}))


def test_plan_on_one_device_advises_no_sharded_layout(capsys):
    code = cli.main(["plan", "--model", "llama3-8b", "--cluster", "h100", "--set", "devices_per_node=1",
                     "--global-batch-tokens", "8192", "--seq-len", "2048"])
    out = capsys.readouterr().out
    assert code == 0 and "(1 device, 72.0 GB usable each)" in out
    assert "largest: model state 160.6 GB; would fit with: more devices to shard it over (ZeRO-3), or a smaller " \
           "model" in out
    assert "shard it: ZeRO-3 (fsdp)" not in out
