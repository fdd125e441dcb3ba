"""Issue 24's bad inputs, items 5-12 of its list: each is one line (exit 2 for bad input, non-zero
otherwise) soon after the cause, with nothing on disk lost and no traceback.

5. two runs on one run_dir; 6. prepare-data over an existing corpus; 7. held-out documents;
8. Ctrl-C; 9. the damaged-checkpoint fallback again and again; 10. out-of-range and misspelt
settings; 11. token ids and values that make the first loss NaN; 12. malformed files and paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import MAX_SECONDS, TINY, fails_early, subprocess_env, tiny_config

from jaxscale import cli
from jaxscale.checkpoint import params as checkpoint
from jaxscale.checkpoint.preemption import Preemption
from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.read import CONFIG_DIR, ConfigError, load_config
from jaxscale.data.prepare import TokenDir, prepare_data
from jaxscale.layout.rules import Rules
from jaxscale.runtime import runlock
from jaxscale.training.loop import NonFiniteError
from jaxscale.training.trainer import Trainer, abstract_model

ONE_DEVICE = [*TINY, "rules=dp", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "train.log_every=1"]


def sets(*overrides: str) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def one_line(capsys: pytest.CaptureFixture, code: int, *names: str) -> str:
    """The one line a command printed on stderr (``jaxscale: error: ...``), checked for ``names``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("jaxscale: error: "), err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def timed_main(argv: list[str]) -> int:
    start = time.perf_counter()
    code = cli.main(argv)
    assert time.perf_counter() - start < MAX_SECONDS
    return code


def digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones included) by its sha256."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    """The tiny model on one device, its step compiled once for the module (run_dir set per test)."""
    config = tiny_config("train.log_every=1", "train.steps=3", "checkpoint.every=1", "checkpoint.resume=auto")
    return Trainer.build(config, jax.devices()[:1])


# -- 5. one run per run_dir ----------------------------------------------------------------------------


def hold_in_another_process(directory: Path) -> subprocess.Popen:
    """A process (no jax) that holds ``directory``'s run lock until killed."""
    code = ("import sys, time; from jaxscale.runtime import runlock; runlock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_run_on_a_run_dir_is_refused_naming_the_first(tmp_path, capsys):
    holder = hold_in_another_process(tmp_path)
    try:
        code = timed_main(["train", "--no-progress", *sets(*ONE_DEVICE, f"run_dir={tmp_path}")])
        one_line(capsys, code, f"run_dir {tmp_path} is in use by another run (process {holder.pid} on ")
        code = timed_main(["train", *sets(*ONE_DEVICE, f"run_dir={tmp_path / 'b'}", "checkpoint.every=1",
                                          f"checkpoint.dir={tmp_path}")])
        one_line(capsys, code, f"checkpoint.dir {tmp_path} is in use", f"process {holder.pid}")
        assert not (tmp_path / "b").exists()  # the refused run left nothing
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_dead_run_is_taken_over_and_said_so(tmp_path, capsys):
    (tmp_path / runlock.LOCK_FILE).write_text("999999999 gone-host\n")  # a run killed with -9 left it
    with runlock.hold((tmp_path, "run_dir")):
        assert (tmp_path / runlock.LOCK_FILE).read_text().startswith(f"{os.getpid()} ")
        with runlock.hold((tmp_path, "run_dir")):  # held again by the same process (the CLI, then the loop)
            pass
        assert (tmp_path / runlock.LOCK_FILE).read_text().startswith(f"{os.getpid()} ")
    assert capsys.readouterr().err == (
        f"jaxscale: warning: run_dir {tmp_path}: took over the lock of process 999999999 on gone-host, "
        "which is no longer running\n")
    assert (tmp_path / runlock.LOCK_FILE).read_text() == ""  # released


def wait_for(predicate, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_real_run_is_locked_and_ctrl_c_saves_at_the_step_boundary(tmp_path, capsys):
    """Run A trains; B on the same run_dir is refused at once naming A; Ctrl-C to A saves the step it
    reached, says so in one line and exits 130; A's checkpoints and metrics are whole."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "jaxscale", "train", "--no-progress",
            *sets(*ONE_DEVICE, "train.steps=100000", "checkpoint.every=50", f"run_dir={run}")]
    # No XLA_FLAGS: the command line makes the one CPU device the mesh asks for.
    first = subprocess.Popen(args, env=subprocess_env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run / "checkpoints" / "50").is_dir() or first.poll() is not None)
        assert first.poll() is None, first.communicate()[1]
        before = digest(run / "checkpoints" / "50")
        code = timed_main(["train", "--no-progress", *sets(*ONE_DEVICE, f"run_dir={run}")])
        one_line(capsys, code, f"in use by another run (process {first.pid} on ")
        first.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = first.communicate(timeout=60)
        assert time.monotonic() - sent < MAX_SECONDS
    finally:
        first.kill()
    assert first.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxscale: interrupted (Ctrl-C) after ") and last.endswith(" updates; checkpoint saved")
    stopped = int(last.split(" after ")[1].split()[0])
    steps = Checkpointer(run / "checkpoints").all_steps()
    assert steps[-1] == stopped and 50 in steps
    assert digest(run / "checkpoints" / "50") == before
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "preempted" and records[-1]["signal"] == "SIGINT"
    logged = [r["step"] for r in records if "loss" in r]
    assert logged == list(range(stopped))  # one run's records, in order


def test_a_second_ctrl_c_exits_at_once(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    before = signal.getsignal(signal.SIGINT)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
        assert preemption.reached(1) and preemption.signal == "SIGINT" and exits == []
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [130]
    assert capsys.readouterr().err.startswith("jaxscale: interrupted again (Ctrl-C): exiting at once")
    assert signal.getsignal(signal.SIGINT) is before


# -- 6, 7. prepare-data ----------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> tuple[list[str], Path]:
    """Two small text files and a token directory prepared from them."""
    files = []
    for name, text in (("a.txt", "the first document " * 20), ("b.txt", "a second one " * 20)):
        (tmp_path / name).write_text(text)
        files.append(str(tmp_path / name))
    out = tmp_path / "tokens"
    prepare_data(files, out, val_fraction=0.0)
    return files, out


def test_prepare_data_refuses_an_existing_directory_and_keeps_it(corpus, tmp_path, capsys):
    files, out = corpus
    before = digest(out)
    code = timed_main(["prepare-data", *files, "--out", str(out)])
    one_line(capsys, code, f"--out {out} already exists (a token directory)", "--overwrite")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    code = timed_main(["prepare-data", files[0], str(bad), "--out", str(out), "--overwrite"])
    one_line(capsys, code, "bad.jsonl:2: no string field 'text'")
    assert digest(out) == before  # the old corpus, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "bad.jsonl", "tokens"]  # no leftovers
    assert cli.main(["prepare-data", files[1], "--out", str(out), "--overwrite"]) == 0
    assert TokenDir.open(out).meta["splits"]["train"]["documents"] == 1


def test_prepare_data_out_that_is_a_file_or_unwritable_is_one_line(corpus, tmp_path, capsys):
    files, _ = corpus
    code = timed_main(["prepare-data", *files, "--out", files[0]])
    one_line(capsys, code, f"--out {files[0]} is a file, not a directory")
    code = timed_main(["prepare-data", *files, "--out", f"{files[0]}/sub"])
    one_line(capsys, code, f"--out {files[0]}/sub: cannot write (Not a directory)")


def test_held_out_documents_are_chosen_by_hash_not_position(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 50)
    meta = prepare_data([one], tmp_path / "single", val_fraction=0.01)
    assert meta["splits"]["train"]["documents"] == 1 and meta["splits"]["val"]["documents"] == 0
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(4000)))
    for fraction in (0.01, 0.1, 0.5):
        meta = prepare_data([docs], tmp_path / f"split-{fraction}", val_fraction=fraction)
        assert meta["splits"]["val"]["documents"] == round(4000 * fraction)
    again = prepare_data([docs], tmp_path / "again", val_fraction=0.1)
    assert again["fingerprint"] == prepare_data([docs], tmp_path / "again2", val_fraction=0.1)["fingerprint"]
    two = [tmp_path / "x.txt", tmp_path / "y.txt"]
    for path in two:
        path.write_text(f"{path.stem} " * 100)
    meta = prepare_data(two, tmp_path / "two", val_fraction=0.01)
    assert meta["splits"]["train"]["documents"] == 2  # not a 50% split


# -- 9. damaged checkpoints, again and again ------------------------------------------------------------


def damage(step_dir: Path) -> None:
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"\0" * 64)


def test_the_damaged_checkpoint_fallback_works_every_time(trainer, tmp_path, capfd):
    trainer.config.run_dir = str(tmp_path)
    trainer.fit(progress=False)
    ckpts = tmp_path / "checkpoints"
    for name in ["3.damaged", "3.damaged.2"]:
        damage(ckpts / "3")
        _, history = trainer.fit(progress=False)
        assert history[0]["message"].endswith(f"kept as {name}; resuming from step 2"), history[0]
        assert (ckpts / name).is_dir() and Checkpointer(ckpts).all_steps()[-1] == 3
    for step in Checkpointer(ckpts).all_steps():
        damage(ckpts / str(step))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^no readable checkpoint in .*checkpoints \(step 3: [^\n]*\)$"):
        trainer.fit(progress=False)
    assert time.perf_counter() - start < MAX_SECONDS
    import gc

    gc.collect()  # what was left of the failed reads is collected now: no "Exception ignored in: <coroutine"
    assert "Exception ignored" not in capfd.readouterr().err


# -- 10. values out of range, misspelt rules, duplicate keys, features switched on by accident ---------


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.learning_rate=-0.1", r"^train\.learning_rate must be at least 0, got -0\.1$"),
        ("train.learning_rate=.nan", r"^train\.learning_rate must be at least 0, got nan$"),
        ("train.clip_norm=-1", r"^train\.clip_norm must be positive, got -1\.0$"),
        ("train.min_lr_ratio=-0.5", r"^train\.min_lr_ratio must be in \[0, 1\], got -0\.5$"),
        ("train.warmup_steps=-3", r"^train\.warmup_steps must be at least 0, got -3$"),
        ("train.b2=1.5", r"^train\.b2 must be in \[0, 1\), got 1\.5$"),
        ("train.seed=-1", r"^train\.seed must be in \[0, 4294967295\], got -1$"),
        ("model.rope_theta=0", r"^model\.rope_theta must be positive, got 0\.0$"),
        ("model.norm_eps=-1", r"^model\.norm_eps must be positive, got -1\.0$"),
        ("train.weight_decay=.inf", r"^train\.weight_decay must be at least 0, got inf$"),
        ("data.max_bytes=0", r"^data\.max_bytes must be at least 1, got 0$"),
        ("pipeline.layers_per_stage=[2, -1]", r"every virtual stage needs at least one layer$"),
        ("model.moe.experts=4", r"^model\.moe\.experts: model\.moe is off \(null\) in this config; switch it on "),
    ],
)
def test_out_of_range_and_accidental_settings_are_one_line(override, match):
    with fails_early(match):
        tiny_config(override)


def test_too_few_bytes_for_a_sequence_name_the_byte_key():
    with fails_early(r"^data\.max_bytes \(20\) is too few bytes for train\.seq_len=32 \(at least 34\)$"):
        Trainer.build(tiny_config("data.max_bytes=20"), jax.devices()[:1])


def test_every_float_range_refuses_nan():
    from jaxscale.config.bounds import RANGES

    assert all(float("nan") not in allowed for allowed in RANGES.values())
    assert tiny_config("model.moe={experts: 4}", "model.moe.top_k=1").model.moe.experts == 4  # switched on by name


def test_a_rules_key_that_is_not_a_logical_axis_is_refused(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text((CONFIG_DIR / "rules" / "fsdp_tp.yaml").read_text().replace("  heads: tensor", "  haeds: tensor"))
    with fails_early(r"^rules 'typo' rules\.haeds: not a logical axis \(one of: batch, "):
        Rules.load(str(path))


def test_a_duplicate_yaml_key_is_refused(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 5\nmodel: tiny\ntrain:\n  steps: 7\n")
    with fails_early(r"twice\.yaml: not valid YAML at line 4, column 1: key 'train' appears twice \(lines 1 and 4\)$"):
        load_config(path)


def test_a_non_utf8_config_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 5 # café\n".encode("latin-1"))
    code = timed_main(["train", "--config", str(path)])
    one_line(capsys, code, "latin1.yaml: not UTF-8 text (invalid continuation byte at byte 23)")


# -- 11. the first loss NaN: token ids, values, weights ---------------------------------------------------


def test_token_ids_at_or_above_the_vocabulary_are_refused_before_compiling(corpus, tmp_path):
    _, out = corpus
    meta = json.loads((out / "meta.json").read_text())
    assert meta["max_token_id"] == 256  # the end-of-document id of the byte tokenizer
    tokens = np.memmap(out / "train.bin", dtype=np.uint16, mode="r+")
    tokens[7] = 300  # a token file damaged, or written by another tokenizer
    tokens.flush()
    config = tiny_config("data.source=tokens", f"data.path={out}", "model.vocab_size=264")
    with fails_early(rf"^data\.path: {out} holds token id 300, not below model\.vocab_size \(264\): "):
        Trainer.build(config, jax.devices()[:1])
    del meta["max_token_id"]  # a directory from before max_token_id: the sample finds it
    (out / "meta.json").write_text(json.dumps(meta))
    with fails_early(r"holds token id 300, not below model\.vocab_size"):
        Trainer.build(config, jax.devices()[:1])


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_first_loss_names_the_likely_keys(trainer, tmp_path, policy):
    read = trainer.batch
    trainer.config.run_dir, trainer.config.train.nonfinite = str(tmp_path), policy

    def poisoned(step: int):
        out = read(step)
        inputs = np.array(out["inputs"])
        inputs[0, 0] = 10**6  # no embedding row: a NaN loss
        return {**out, "inputs": jax.device_put(inputs, out["inputs"].sharding)}

    trainer.batch = poisoned
    try:
        with pytest.raises(NonFiniteError, match=r"^step 0: loss nan, .* before any update: a configuration or "
                           r"data problem, not a spike to skip; look at model\.init_std, model\.rope_theta, "):
            trainer.fit(progress=False)
    finally:
        trainer.batch, trainer.config.train.nonfinite = read, "stop"
    assert not (tmp_path / "checkpoints" / "1").exists()


# -- 12. malformed files and paths ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama in Hugging Face's layout, exported from random parameters."""
    from jaxscale.hf import convert

    root = tmp_path_factory.mktemp("hf")
    model = load_config(None, TINY).model
    shapes = abstract_model(load_config(None, TINY))[1]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0, 0.05, a.shape).astype(np.float32), shapes)
    checkpoint.save_params(root / "ckpt", params, dataclasses.asdict(model))
    convert.jaxscale_to_hf(root / "ckpt", root / "hf", max_shard_mb=0.1)  # several shards and an index
    return root / "hf"


def broken_copy(hf_dir: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "hf"
    copy.mkdir()
    for path in hf_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    edit(copy)
    return copy


def set_json(name: str, change) -> object:
    def edit(d: Path) -> None:
        data = json.loads((d / name).read_text())
        change(data)
        (d / name).write_text(json.dumps(data))
    return edit


def first_shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


@pytest.mark.parametrize(
    "edit, names",
    [
        (lambda d: (d / "config.json").write_text("{not json"), ["config.json: not a readable JSON file"]),
        (lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json: expected a JSON object, got list"]),
        (set_json("config.json", lambda c: c.pop("hidden_size")), ["config.json: no 'hidden_size'"]),
        (set_json("config.json", lambda c: c.update(num_attention_heads=0)),
         ["config.json: num_attention_heads must be a positive integer, got 0"]),
        (set_json("config.json", lambda c: c.update(rope_theta=-1)),
         ["config.json: model.rope_theta must be positive"]),
        (lambda d: first_shard(d).write_bytes(b"garbage" * 10), ["not a readable safetensors file"]),
        (lambda d: first_shard(d).write_bytes(b""), ["not a readable safetensors file"]),
        (lambda d: first_shard(d).write_bytes(first_shard(d).read_bytes()[:-1000]), ["safetensors"]),
        (lambda d: first_shard(d).unlink(), ["model.safetensors.index.json: names model-00001-of-"]),
        (set_json("model.safetensors.index.json", lambda c: c.pop("weight_map")), ["no 'weight_map'"]),
    ],
)
def test_malformed_hugging_face_inputs_are_one_line(hf_dir, tmp_path, capsys, edit, names):
    source = broken_copy(hf_dir, tmp_path, edit)
    code = timed_main(["convert", "hf-to-jaxscale", "--from", str(source), "--to", str(tmp_path / "out")])
    one_line(capsys, code, *names)
    assert not (tmp_path / "out" / "params").exists()


def test_convert_to_an_existing_file_and_nan_weights_are_one_line(hf_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code = timed_main(["convert", "hf-to-jaxscale", "--from", str(hf_dir), "--to", str(tmp_path / "file")])
    one_line(capsys, code, f"--to {tmp_path / 'file'} is a file, not a directory")
    from safetensors.numpy import load_file, save_file

    def poison(d: Path) -> None:
        tensors = load_file(first_shard(d))
        name = sorted(tensors)[0]
        tensors[name][0] = np.nan
        save_file(tensors, first_shard(d), metadata={"format": "pt"})

    code = timed_main(["convert", "hf-to-jaxscale", "--from", str(broken_copy(hf_dir, tmp_path, poison)),
                       "--to", str(tmp_path / "out")])
    one_line(capsys, code, "holds NaN or infinite values")


def test_report_reads_past_a_torn_last_line_and_names_a_bad_one(tmp_path, capsys):
    from jaxscale.training.metrics import MetricsLogger
    from jaxscale.training.report import read_metrics

    good = [{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 2, "lo')
    assert read_metrics(tmp_path) == good  # what kill -9 leaves: the last line cut short
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with fails_early(r"metrics\.jsonl: line 2 is not a metrics record: '\{\"step\": 1, \"lo'$"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(good[0]) + '\n{"step": 1, "lo')
    MetricsLogger(tmp_path, 4, enabled=True, bar=False, resume_step=1).close()  # a resume cuts the torn line
    assert read_metrics(tmp_path) == [good[0], {"step": 1, "event": "resumed"}]


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_a_run_dir_that_cannot_be_written_is_one_line_before_compiling(tmp_path, capsys, kind):
    run = tmp_path / "run"
    if kind == "unwritable" and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    if kind == "file":
        run.write_text("")
    else:
        tmp_path.chmod(0o500)
    try:
        code = timed_main(["train", *sets(*ONE_DEVICE, f"run_dir={run}")])
    finally:
        tmp_path.chmod(0o700)
    if kind == "file":
        one_line(capsys, code, f"run_dir {run} is a file, not a directory")
    else:
        one_line(capsys, code, f"run_dir {run} is not writable: Permission denied")


def test_plan_refuses_a_negative_sequence_length(capsys):
    code = timed_main(["plan", "--model", "tiny", "--cluster", "h100", "--global-batch-tokens", "4096",
                       "--seq-len", "-8192"])
    one_line(capsys, code, "--seq-len must be at least 1, got -8192")
