"""Bad input as new users give it, tried kind by kind; each outcome classified; a JSON summary printed.

    nice python benchmarks/bad_inputs.py [--only SUBSTRING] [--out FILE]

Each kind runs the command line in this process (``jaxscale.cli.main``, so jax starts once) in a fresh
temporary directory, and is classified as:

- ``one_line``: exit status 2 (bad input) or another non-zero one, exactly one ``jaxscale: error`` line
  on stderr, naming what it must name;
- ``misleading``: one line, exit non-zero, but it does not name what it must (the wrong key);
- ``traceback``: an exception escaped the command, or stderr holds more than one line;
- ``silent``: exit 0 where the input should have been refused;
- ``data_lost``: files that must survive (an earlier run's checkpoints, an earlier corpus) changed;
- ``ok``: a kind that must succeed did (one input file to prepare-data, say) with the expected result.

The kinds are those of issue 24's list (config values out of range, misspelt keys, duplicate keys,
malformed Hugging Face inputs, paths that are files or locked, torn metrics, ...) and issue 37's last ones
(:func:`last_kinds`); ``--only`` runs those whose name contains a string. :class:`Kind` and the
classification are ``benchmarks/bad_input_kind.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from bad_input_kind import RUN, Kind, classify, train, write

from jaxscale import cli
from jaxscale.config.bounds import RANGES
from jaxscale.config.read import CONFIG_DIR

# -- the kinds -----------------------------------------------------------------------------------------------


def _bad_value(key: str) -> str:
    """A value outside ``RANGES[key]``."""
    allowed = RANGES[key]
    if key.endswith("[]"):
        return "[0]"
    if allowed.low != -math.inf:
        below = allowed.low - 1 if allowed.low == int(allowed.low) and not allowed.open_low else allowed.low
        if isinstance(below, float) and below.is_integer() and key not in FLOATS:
            below = int(below)
        return str(below)
    return ".nan"


FLOATS = {"model.rope_theta", "model.norm_eps", "model.init_std", "model.moe.capacity_factor",
          "model.moe.aux_loss_weight", "model.moe.z_loss_weight", "train.learning_rate", "train.min_lr_ratio",
          "train.weight_decay", "train.b1", "train.b2", "train.eps", "train.clip_norm", "train.peak_flops"}


def range_kinds() -> list[Kind]:
    kinds = []
    for key in RANGES:
        base = key.removesuffix("[]")
        value = _bad_value(key)
        moe = ["model.moe={}"] if base.startswith("model.moe.") else []
        dcn = ["mesh.dcn={}"] if base.startswith("mesh.dcn.") else []
        kinds.append(Kind(f"range {base}={value}", train(*moe, *dcn, f"{base}={value}"), (base,)))
        if base in FLOATS:
            kinds.append(Kind(f"range {base}=nan", train(*moe, f"{base}=.nan"), (base,)))
    kinds += [
        Kind("range train.b2=1.5", train("train.b2=1.5"), ("train.b2",)),
        Kind("range train.min_lr_ratio=2", train("train.min_lr_ratio=2"), ("train.min_lr_ratio",)),
        Kind("range train.seed=2**40", train(f"train.seed={2**40}"), ("train.seed",)),
        Kind("range model.moe.top_k>experts", train("model.moe={experts: 2, top_k: 3}"), ("model.moe.top_k",)),
        Kind("range mesh.tensor=0", train("mesh.tensor=0"), ("mesh.tensor",)),
        Kind("range mesh two -1", train("mesh.data=-1", "mesh.fsdp=-1"), ("mesh.data", "mesh.fsdp")),
    ]
    return kinds


def config_kinds() -> list[Kind]:
    conf = lambda tmp: ["train", "--no-progress", "--config", str(tmp / "exp.yaml"), "--set", *RUN,  # noqa: E731
                        f"run_dir={tmp / 'run'}"]
    return [
        Kind("unknown key train.stpes", train("train.stpes=3"), ("train.stpes",)),
        Kind("unknown key model.embedd", train("model.embedd=3"), ("model.embedd",)),
        Kind("wrong type train.steps=abc", train("train.steps=abc"), ("train.steps",)),
        Kind("wrong type model.tie_embeddings=3", train("model.tie_embeddings=3"), ("model.tie_embeddings",)),
        Kind("bad choice model.dtype=fp8", train("model.dtype=fp8"), ("model.dtype",)),
        Kind("malformed override", train("train.steps"), ("train.steps",)),
        Kind("moe switched on by accident", train("model.moe.experts=4"), ("model.moe",)),
        Kind("rules key typo", train("rules=" + "{tmp}/typo.yaml"), ("haeds",)),
        Kind("duplicate YAML section", conf, ("appears twice",),
             write("exp.yaml", "train:\n  steps: 2\ntrain:\n  steps: 3\n")),
        Kind("duplicate YAML key", conf, ("appears twice",), write("exp.yaml", "train:\n  steps: 2\n  steps: 3\n")),
        Kind("non-UTF-8 config", conf, ("not UTF-8",),
             write("exp.yaml", "train:\n  steps: 2 # caf\xe9\n".encode("latin-1"))),
        Kind("invalid YAML", conf, ("not valid YAML",), write("exp.yaml", "train: [1, 2\n")),
        Kind("config not a mapping", conf, ("mapping",), write("exp.yaml", "- 1\n")),
        Kind("config missing", lambda tmp: ["train", "--config", str(tmp / "nope.yaml")], ("config file not found",)),
        Kind("unknown rules preset", train("rules=dpp"), ("dpp",)),
        Kind("unknown model preset", train("model=llama-9000"), ("llama-9000",)),
        Kind("mesh too large", train("mesh.fsdp=16", "mesh.tensor=1"), ("mesh",)),
        Kind("layout not divisible", train("model.mlp=99"), ("mlp",)),
        Kind("xla flag malformed", train("xla.flags=[nope]"), ("xla.flags",)),
        Kind("cudnn in fp32", train("model.attention=cudnn"), ("model.attention",)),
        Kind("tokens source without path", train("data.source=tokens"), ("data.path",)),
        Kind("stdlib vocab too small", train("model.vocab_size=100"), ("model.vocab_size",)),
    ]


def _typo_rules(tmp: Path) -> None:
    text = (CONFIG_DIR / "rules" / "fsdp_tp.yaml").read_text().replace("  heads: tensor", "  haeds: tensor")
    (tmp / "typo.yaml").write_text(text)


def _prepare(tmp: Path, name: str = "tokens", *extra: str) -> None:
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(200)))
    assert cli.main(["prepare-data", str(docs), "--out", str(tmp / name), "--val-fraction", "0.1", *extra]) == 0


def _big_ids(tmp: Path) -> None:
    _prepare(tmp)
    tokens = np.memmap(tmp / "tokens" / "train.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 400
    tokens.flush()


def _locked(tmp: Path) -> None:
    code = ("import sys, time; from jaxscale.runtime import runlock; runlock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp / "run")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    HOLDERS.append(holder)


HOLDERS: list[subprocess.Popen] = []


def _checkpoints(tmp: Path, damage_steps: tuple[int, ...] = ()) -> None:
    assert cli.main(train("checkpoint.every=1", "rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")(tmp)) == 0
    for step in damage_steps:
        for path in (tmp / "run" / "checkpoints" / str(step) / "state").rglob("*"):
            if path.is_file() and path.parent.name == "d":
                path.write_bytes(b"\0" * 64)


def run_kinds() -> list[Kind]:
    dp = ("rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")
    tokens = lambda tmp: [f"data.path={tmp / 'tokens'}"]  # noqa: E731
    return [
        Kind("run_dir is a file", train(), ("run_dir",), write("run", "")),
        Kind("run_dir under a file", lambda tmp: [*train()(tmp)[:3], f"run_dir={tmp / 'f' / 'run'}", *RUN],
             ("run_dir",), write("f", "")),
        Kind("checkpoint.dir is a file", train("checkpoint.every=1", "checkpoint.dir={tmp}/f"), ("checkpoint.dir",),
             write("f", "")),
        Kind("run_dir in use", train("checkpoint.every=1"), ("in use", "process"), _locked),
        Kind("second run into a run_dir with checkpoints", train("checkpoint.every=1", *dp), ("--resume",),
             _checkpoints, keep="run/checkpoints"),
        Kind("resume without a checkpoint", lambda tmp: [*train()(tmp), "--resume"], ("--resume",)),
        Kind("every checkpoint damaged", lambda tmp: [*train("checkpoint.every=1", *dp)(tmp), "--resume"],
             ("no readable checkpoint",), lambda tmp: _checkpoints(tmp, (1, 2))),
        Kind("token ids above vocab_size", lambda tmp: train("data.source=tokens", *tokens(tmp),
                                                             "model.vocab_size=300")(tmp), ("token id 400",), _big_ids),
        Kind("vocab below the tokenizer's", lambda tmp: train("data.source=tokens", *tokens(tmp),
                                                              "model.vocab_size=200")(tmp), ("model.vocab_size",),
             _prepare),
        Kind("data.path missing", train("data.source=tokens", "data.path={tmp}/none"), ("data.path",)),
        Kind("seq_len longer than the data", train("data.max_bytes=100"), ("data.max_bytes", "train.seq_len")),
        Kind("init_from missing", train("checkpoint.init_from={tmp}/none"), ("not a parameters checkpoint",)),
        Kind("inspect bad key", lambda tmp: ["inspect", "--set", "train.stpes=1"], ("train.stpes",)),
    ]


def prepare_kinds() -> list[Kind]:
    def prep(*args: str) -> Callable[[Path], list[str]]:
        return lambda tmp: ["prepare-data", *(a.format(tmp=tmp) for a in args)]

    def one_file_trains(tmp: Path) -> bool:
        meta = json.loads((tmp / "out" / "meta.json").read_text())
        return meta["splits"]["train"]["documents"] == 1

    def no_half_split(tmp: Path) -> bool:
        meta = json.loads((tmp / "out" / "meta.json").read_text())
        return meta["splits"]["train"]["documents"] == 2

    return [
        Kind("prepare over an existing corpus", prep("{tmp}/docs.jsonl", "--out", "{tmp}/tokens"), ("--overwrite",),
             _prepare, keep="tokens"),
        Kind("prepare --overwrite that fails", prep("{tmp}/docs.jsonl", "{tmp}/bad.jsonl", "--out", "{tmp}/tokens",
                                                    "--overwrite"), ("bad.jsonl:2",),
             lambda tmp: (_prepare(tmp), write("bad.jsonl", '{"text": "a"}\n{"x": 1}\n')(tmp)), keep="tokens"),
        Kind("prepare --out is a file", prep("{tmp}/a.txt", "--out", "{tmp}/a.txt"), ("--out",), write("a.txt", "hi")),
        Kind("prepare --out under a file", prep("{tmp}/a.txt", "--out", "{tmp}/a.txt/x"), ("--out",),
             write("a.txt", "hi")),
        Kind("prepare input missing", prep("{tmp}/none.txt", "--out", "{tmp}/out"), ("none.txt",)),
        Kind("prepare input not UTF-8", prep("{tmp}/a.txt", "--out", "{tmp}/out"), ("not UTF-8",),
             write("a.txt", b"caf\xe9")),
        Kind("prepare bad JSON line", prep("{tmp}/a.jsonl", "--out", "{tmp}/out"), ("a.jsonl:1",),
             write("a.jsonl", "{nope\n")),
        Kind("prepare val-fraction 1.5", prep("{tmp}/a.txt", "--out", "{tmp}/out", "--val-fraction", "1.5"),
             ("--val-fraction",), write("a.txt", "hi")),
        Kind("prepare tokenizer missing", prep("{tmp}/a.txt", "--out", "{tmp}/out", "--tokenizer", "{tmp}/t.json"),
             ("--tokenizer",), write("a.txt", "hi")),
        Kind("prepare one input file", prep("{tmp}/a.txt", "--out", "{tmp}/out"), (), write("a.txt", "one doc"),
             succeeds=one_file_trains),
        Kind("prepare two files at 0.01", prep("{tmp}/a.txt", "{tmp}/b.txt", "--out", "{tmp}/out"), (),
             lambda tmp: (write("a.txt", "first " * 50)(tmp), write("b.txt", "second " * 50)(tmp)),
             succeeds=no_half_split),
    ]


def _parquet(tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2], "body": ["a text", "another"]}), tmp / "docs.parquet")


def data_kinds() -> list[Kind]:
    """Issue 27's bad inputs: mixtures, sources, prompt/response records, documents, first-fit packing."""
    tokens = ("data.source=tokens", "data.path={tmp}/tokens", "model.vocab_size=264")
    mixture = "data.mixture=[{path: '{tmp}/tokens', weight: 0.5, name: a}, {path: '{tmp}/%s', weight: %s, name: b}]"
    return [
        Kind("mixture weight not positive", train(*tokens[::2], mixture % ("tokens", "0")),
             ("data.mixture[1].weight",), _prepare),
        Kind("mixture source missing", train(*tokens[::2], mixture % ("none", "0.5")),
             ("data.mixture[1].path", "none"), _prepare),
        Kind("parquet without the column", lambda tmp: ["prepare-data", str(tmp / "docs.parquet"), "--out",
                                                        str(tmp / "out")], ("docs.parquet", "'text'"), _parquet),
        Kind("response field missing", lambda tmp: ["prepare-data", str(tmp / "qa.jsonl"), "--out", str(tmp / "out"),
                                                    "--prompt-field", "q", "--response-field", "a"],
             ("qa.jsonl:2", "'a'"), write("qa.jsonl", '{"q": "a", "a": "b"}\n{"q": "no response"}\n')),
        Kind("first_fit document longer than a sequence", train(*tokens, "data.documents=true",
                                                                "data.packing=first_fit", "train.seq_len=32"),
             ("data.packing=first_fit", "train.seq_len"), _prepare),
        Kind("documents under cudnn", train(*tokens, "data.documents=true", "model.attention=cudnn",
                                            "model.dtype=bfloat16"), ("data.documents", "blockwise"), _prepare),
    ]


def _hf(tmp: Path) -> None:
    """A tiny Llama in Hugging Face's layout under ``tmp/hf``, in several shards with an index."""
    import jax

    from jaxscale.checkpoint import params as checkpoint
    from jaxscale.config.read import load_config
    from jaxscale.hf import convert
    from jaxscale.training.trainer import abstract_model

    config = load_config(None, ["model.embed=64", "model.layers=2", "model.heads=8", "model.kv_heads=4",
                                "model.head_dim=8", "model.mlp=128"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0, 0.05, a.shape).astype(np.float32), abstract_model(config)[1])
    checkpoint.save_params(tmp / "ckpt", params, dataclasses.asdict(config.model))
    convert.jaxscale_to_hf(tmp / "ckpt", tmp / "hf", max_shard_mb=0.1)


def _hf_edit(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        _hf(tmp)
        edit(tmp / "hf")
    return setup


def _json_edit(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = json.loads((d / name).read_text())
        change(data)
        (d / name).write_text(json.dumps(data))
    return edit


def _shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def _nan_shard(d: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(_shard(d))
    tensors[sorted(tensors)[0]][0] = np.nan
    save_file(tensors, _shard(d), metadata={"format": "pt"})


def convert_kinds() -> list[Kind]:
    to_ours = lambda tmp: ["convert", "hf-to-jaxscale", "--from", str(tmp / "hf"), "--to", str(tmp / "out")]  # noqa: E731
    cases: list[tuple[str, Callable[[Path], None], str]] = [
        ("config.json invalid", lambda d: (d / "config.json").write_text("{nope"), "config.json"),
        ("config.json a list", lambda d: (d / "config.json").write_text("[]"), "config.json"),
        ("config.json partial", _json_edit("config.json", lambda c: c.pop("hidden_size")), "hidden_size"),
        ("config.json zero heads", _json_edit("config.json", lambda c: c.update(num_attention_heads=0)),
         "num_attention_heads"),
        ("config.json string layers", _json_edit("config.json", lambda c: c.update(num_hidden_layers="2")),
         "num_hidden_layers"),
        ("config.json rope_theta 0", _json_edit("config.json", lambda c: c.update(rope_theta=0)), "rope_theta"),
        ("config.json missing", lambda d: (d / "config.json").unlink(), "config.json"),
        ("safetensors garbage", lambda d: _shard(d).write_bytes(b"garbage" * 20), "safetensors"),
        ("safetensors empty", lambda d: _shard(d).write_bytes(b""), "safetensors"),
        ("safetensors truncated", lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:-500]), "safetensors"),
        ("index names a missing shard", lambda d: _shard(d).unlink(), "index.json"),
        ("index invalid", lambda d: (d / "model.safetensors.index.json").write_text("{"), "index.json"),
        ("index without weight_map", _json_edit("model.safetensors.index.json", lambda c: c.pop("weight_map")),
         "weight_map"),
        ("a tensor missing", _json_edit("model.safetensors.index.json",
                                        lambda c: c["weight_map"].pop(sorted(c["weight_map"])[0])), "missing"),
        ("NaN weights", _nan_shard, "NaN"),
    ]
    kinds = [Kind(f"convert {name}", to_ours, (names,), _hf_edit(edit)) for name, edit, names in cases]
    kinds += [
        Kind("convert --to an existing file", lambda tmp: [*to_ours(tmp)[:-1], str(tmp / "f")], ("--to",),
             lambda tmp: (_hf(tmp), write("f", "")(tmp))),
        Kind("convert --from missing", lambda tmp: ["convert", "hf-to-jaxscale", "--from", str(tmp / "none"), "--to",
                                                    str(tmp / "out")], ("config.json",)),
        Kind("convert back from nothing", lambda tmp: ["convert", "jaxscale-to-hf", "--from", str(tmp), "--to",
                                                       str(tmp / "out")], ("not a parameters checkpoint",)),
    ]
    return kinds


def other_kinds() -> list[Kind]:
    plan = ["plan", "--model", "tiny", "--cluster", "h100", "--global-batch-tokens", "65536"]
    good = "".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(3))
    return [
        Kind("report torn last line", lambda tmp: ["report", str(tmp), "--out", str(tmp / "r.png")], (),
             write("metrics.jsonl", good + '{"step": 3, "lo'), succeeds=lambda tmp: (tmp / "r.png").exists()),
        Kind("report bad middle line", lambda tmp: ["report", str(tmp)], ("line 2",),
             write("metrics.jsonl", '{"step": 0}\n{"ste\n{"step": 1}\n')),
        Kind("report no metrics", lambda tmp: ["report", str(tmp)], ("metrics.jsonl",)),
        Kind("report --out unwritable", lambda tmp: ["report", str(tmp), "--out", str(tmp / "f" / "r.png")],
             ("r.png",), lambda tmp: (write("metrics.jsonl", good)(tmp), write("f", "")(tmp))),
        Kind("plan --seq-len -8192", lambda tmp: [*plan, "--seq-len", "-8192"], ("--seq-len",)),
        Kind("plan --global-batch-tokens 0", lambda tmp: [*plan[:-1], "0", "--seq-len", "512"],
             ("--global-batch-tokens",)),
        Kind("plan --top 0", lambda tmp: [*plan, "--seq-len", "512", "--top", "0"], ("--top",)),
        Kind("plan unknown model", lambda tmp: ["plan", "--model", "gpt9", "--cluster", "h100",
                                                "--global-batch-tokens", "4096", "--seq-len", "512"], ("gpt9",)),
        Kind("plan unknown cluster", lambda tmp: ["plan", "--model", "tiny", "--cluster", "a1000",
                                                  "--global-batch-tokens", "4096", "--seq-len", "512"], ("a1000",)),
        Kind("plan missing arguments", lambda tmp: ["plan", "--model", "tiny"], ("--cluster",)),
        Kind("bench --steps 0", lambda tmp: ["bench", "--steps", "0", "--out", str(tmp / "b.json")], ("--steps",)),
        Kind("bench --layers x", lambda tmp: ["bench", "--suite", "compile", "--layers", "x"], ("--layers",)),
    ]


def last_kinds() -> list[Kind]:
    """Issue 37's: settings ignored as written, numbers out of range, a finished run resumed, empty records."""
    plan = ["plan", "--model", "tiny", "--cluster", "h100", "--global-batch-tokens", "65536", "--seq-len", "512"]
    back = lambda tmp, mb: ["convert", "jaxscale-to-hf", "--from", str(tmp / "ckpt"), "--to", str(tmp / "hf"),  # noqa: E731
                            "--max-shard-mb", mb]
    dp = ("rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "checkpoint.every=1")
    qa = ["--prompt-field", "q", "--response-field", "a"]
    return [
        Kind("remat_names bogus", train("model.remat=save_named", "model.remat_names=[bogus]"),
             ("model.remat_names: 'bogus'", "query")),
        Kind("remat_names without save_named", train("model.remat_names=[query]"), ("model.remat=save_named",)),
        Kind("run_dir empty", lambda tmp: ["train", "--no-progress", "--set", "run_dir=", *RUN], ("run_dir is empty",)),
        Kind("plan --verify -1", lambda tmp: [*plan, "--verify", "-1"], ("--verify",)),
        Kind("convert --max-shard-mb 0", lambda tmp: back(tmp, "0"), ("--max-shard-mb",)),
        Kind("convert --max-shard-mb -5", lambda tmp: back(tmp, "-5"), ("--max-shard-mb",)),
        Kind("resume a finished run", lambda tmp: [*train(*dp)(tmp), "--resume"], (), _checkpoints,
             keep="run/checkpoints", succeeds=lambda tmp: True, prints="the run is finished: resumed at step 2"),
        Kind("prepare responses all empty", lambda tmp: ["prepare-data", str(tmp / "qa.jsonl"), "--out",
                                                         str(tmp / "out"), *qa], ("empty response field 'a'",),
             write("qa.jsonl", '{"q": "a", "a": ""}\n')),
    ]


def all_kinds() -> list[Kind]:
    kinds = [*range_kinds(), *config_kinds(), *run_kinds(), *prepare_kinds(), *data_kinds(), *convert_kinds(),
             *other_kinds(), *last_kinds()]
    for kind in kinds:
        if kind.name == "rules key typo":
            kind.setup = _typo_rules
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the kinds whose name contains this")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    kinds = [k for k in all_kinds() if not args.only or args.only in k.name]
    results = []
    try:
        for kind in kinds:
            with tempfile.TemporaryDirectory() as tmp:
                results.append(classify(kind, Path(tmp)))
            print(f"{results[-1]['outcome']:>10}  {kind.name}: {results[-1]['line'][:150]}", file=sys.stderr)
            for holder in HOLDERS:
                holder.kill()
            HOLDERS.clear()
    finally:
        for holder in HOLDERS:
            holder.kill()
    counts: dict[str, int] = {}
    for r in results:
        counts[str(r["outcome"])] = counts.get(str(r["outcome"]), 0) + 1
    summary = {"kinds": len(results), "counts": counts, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({"kinds": len(results), "counts": counts,
                      "not_one_line": [r for r in results if r["outcome"] not in ("one_line", "ok")]}, indent=1))


if __name__ == "__main__":
    main()
