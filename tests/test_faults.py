"""Faults as a user meets them: unwritable or full checkpoint storage, earlier runs' metrics, damaged
checkpoints, the schedule's length on resume, runs of skipped updates, bad token files, bad flags.

Each is one line (``jaxscale: error: ...``), nothing is lost, and nothing waits on a timeout.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, assert_trees_equal, subprocess_env, tiny_config

from jaxscale import cli
from jaxscale.checkpoint.store import Checkpointer, CheckpointError
from jaxscale.config.read import ConfigError, load_config
from jaxscale.data.prepare import prepare_data
from jaxscale.training.loop import NonFiniteError
from jaxscale.training.report import read_records
from jaxscale.training.trainer import Trainer

ONE_DEVICE = ["train.log_every=1", "mesh.data=1"]


def trainer(run_dir: Path, *overrides: str) -> Trainer:
    """The tiny model on one device, writing to ``run_dir``."""
    return Trainer.build(tiny_config(*ONE_DEVICE, f"run_dir={run_dir}", *overrides), jax.devices()[:1])


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


# -- 1. checkpoint storage that cannot be written -------------------------------------------------


def test_a_checkpoint_dir_that_is_a_file_fails_before_compiling(tmp_path):
    (tmp_path / "file").write_text("")
    t = trainer(tmp_path, "checkpoint.every=1", f"checkpoint.dir={tmp_path / 'file'}")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"checkpoint\.dir .*/file is a file, not a directory"):
        t.fit(progress=False)
    assert time.perf_counter() - start < 2  # nothing compiled
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_failed_async_save_stops_the_run_and_is_never_logged(tmp_path, monkeypatch):
    """The disk fills up while step 2 is written in the background: the run stops at once with the
    error of that step; its checkpoint record is never logged, the committed step 1 is kept."""
    from orbax.checkpoint._src.serialization import serialization

    write = serialization.async_serialize_from_host
    failed_at = []

    async def full_disk(rslices, tensorstore_spec, **kwargs):
        if "/2.orbax-checkpoint-tmp/" in json.dumps(tensorstore_spec, default=str):
            failed_at.append(time.perf_counter())
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write(rslices, tensorstore_spec, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    t = trainer(tmp_path, "train.steps=6", "checkpoint.every=1")
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 was not saved .*No space left on device.*"
                                              r"the latest complete checkpoint is step 1"):
        t.fit(progress=False)
    assert time.perf_counter() - failed_at[0] < 10
    logged = [r["checkpoint"] for r in records(tmp_path) if "checkpoint" in r]
    assert logged == [1]
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]


MOUNT_AND_TRAIN = """
set -u
mount -t tmpfs -o size=300k tmpfs "$1/full" || exit 77
mount -t tmpfs -o ro tmpfs "$1/ro" || exit 77
shift
for dir in full ro; do
  start=$(date +%s.%N)
  python3 -m jaxscale train "$@" --set checkpoint.dir="$RUN/$dir" --set run_dir="$RUN/run-$dir" 2> "$RUN/$dir.err"
  echo "$dir $? $start $(date +%s.%N)"
done
"""


def test_a_full_disk_and_a_read_only_dir_are_one_line_each(tmp_path):
    """Real storage faults: tmpfs mounts (a 300 KiB one, and a read-only one) in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private mount namespace")
    for name in ("full", "ro"):
        (tmp_path / name).mkdir()
    sets = [*TINY, *ONE_DEVICE, "mesh.fsdp=1", "mesh.tensor=1", "rules=dp", "train.steps=6", "checkpoint.every=2"]
    args = ["--no-progress", *(a for s in sets for a in ("--set", s))]
    env = {**subprocess_env("--xla_force_host_platform_device_count=1"), "RUN": str(tmp_path)}
    result = subprocess.run(["unshare", "-m", "bash", "-c", MOUNT_AND_TRAIN, "-", str(tmp_path), *args],
                            env=env, capture_output=True, text=True, timeout=300)
    if result.returncode == 77 or "unshare failed" in result.stderr:
        pytest.skip(f"no private mounts here: {result.stderr.strip()[-200:]}")
    runs = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    full_err, ro_err = ((tmp_path / f"{d}.err").read_text().splitlines() for d in ("full", "ro"))
    assert runs["full"][0] == "1" and len(full_err) == 1, full_err
    assert full_err[0].startswith("jaxscale: error: checkpoint step 2 was not saved") and "No space left" in full_err[0]
    assert not [r for r in records(tmp_path / "run-full") if "checkpoint" in r]
    assert runs["ro"][0] == "2" and ro_err == [f"jaxscale: error: checkpoint.dir {tmp_path}/ro is not writable: "
                                               "Read-only file system"]
    assert float(runs["ro"][2]) - float(runs["ro"][1]) < 10


# -- 2. an earlier run's metrics ------------------------------------------------------------------


def test_metrics_of_earlier_runs_are_kept(tmp_path):
    """A fresh run moves an earlier run's metrics.jsonl aside; a resume appends after a marker."""
    t = trainer(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.resume=auto")
    t.fit(progress=False, stop_at=3)  # saves 2 (and 3, at the stop): the crash comes after 3 is logged
    Checkpointer(tmp_path / "checkpoints").manager.delete(3)  # as if killed while saving step 3
    first = records(tmp_path)
    t.fit(progress=False)
    lines = records(tmp_path)
    assert lines[: len(first)] == first  # nothing rewritten
    assert lines[len(first)] == {"step": 2, "event": "resumed"}
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl") if "loss" in r] == [0, 1, 2, 3]
    shutil.rmtree(tmp_path / "checkpoints")
    t.fit(progress=False)  # a fresh run into the same run_dir
    assert records(tmp_path, "metrics.1.jsonl") == lines
    assert records(tmp_path)[0] == {"step": 0, "event": "earlier_run_kept", "path": "metrics.1.jsonl"}


# -- 3. damaged checkpoints -----------------------------------------------------------------------


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, capsys):
    t = trainer(tmp_path / "straight", "train.steps=4", "checkpoint.every=1", "checkpoint.resume=auto")
    want, _ = t.fit(progress=False)
    t.config.run_dir = str(tmp_path / "run")  # the same compiled step
    t.fit(progress=False, stop_at=3)
    for path in (tmp_path / "run" / "checkpoints" / "3" / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 100:
            path.write_bytes(b"\0" * 64)  # the arrays of the latest step are damaged
    state, history = t.fit(progress=False)
    event = history[0]
    assert event["event"] == "damaged_checkpoint"
    assert event["message"].startswith("checkpoint step 3 is damaged (") and "resuming from step 2" in event["message"]
    assert [line for line in capsys.readouterr().err.splitlines() if "damaged" in line] == [
        f"jaxscale: warning: {event['message']}"]
    assert [r["step"] for r in history if "loss" in r] == [2, 3]
    assert_trees_equal(state, want)
    assert (tmp_path / "run" / "checkpoints" / "3.damaged").is_dir()
    assert Checkpointer(tmp_path / "run" / "checkpoints").all_steps() == [2, 3, 4]  # keep=3


def test_a_checkpoint_dir_of_garbage_is_one_line(tmp_path):
    steps = tmp_path / "checkpoints" / "5"
    steps.mkdir(parents=True)
    (steps / "state").write_text("not a checkpoint")
    (tmp_path / "checkpoints" / "notes.txt").write_text("hello")
    t = trainer(tmp_path, "checkpoint.resume=auto")
    with pytest.raises(ConfigError, match=r"^no readable checkpoint in .*/checkpoints \(step 5: [^\n]*\)$"):
        t.fit(progress=False)


# -- 4. the schedule's length is part of the run --------------------------------------------------


@pytest.mark.slow  # jaxscale's own logic, the same on every JAX: the whole suite (Python 3.11) runs it
def test_four_steps_then_resume_to_eight_equals_eight_straight(tmp_path):
    eight = trainer(tmp_path / "straight", "train.steps=8", "train.warmup_steps=2")
    want, straight = eight.fit(progress=False)
    four = trainer(tmp_path / "split", "train.steps=4", "train.schedule_steps=8", "train.warmup_steps=2",
                   "checkpoint.every=4")
    four.fit(progress=False)
    eight.config.run_dir = str(tmp_path / "split")
    eight.config.checkpoint.resume = "auto"
    state, second = eight.fit(progress=False)
    assert_trees_equal(state, want)
    losses = {r["step"]: (r["loss"], r["lr"]) for r in straight if "loss" in r}
    assert {r["step"]: (r["loss"], r["lr"]) for r in second if "loss" in r} == {s: losses[s] for s in range(4, 8)}


@pytest.mark.slow  # jaxscale's own logic, the same on every JAX: the whole suite (Python 3.11) runs it
def test_resume_with_another_schedule_length_needs_the_key(tmp_path):
    trainer(tmp_path, "train.steps=2", "checkpoint.every=2").fit(progress=False)
    longer = trainer(tmp_path, "train.steps=6", "checkpoint.resume=auto")
    with pytest.raises(ConfigError, match=r"checkpoint step 2 follows a learning-rate schedule of 2 steps, this "
                                          r"config's would be 6 \(train\.steps\): set train\.schedule_steps=2 .*"
                                          r"or train\.schedule_steps=6"):
        longer.fit(progress=False)
    kept = trainer(tmp_path, "train.steps=3", "train.schedule_steps=2", "checkpoint.resume=auto")
    _, history = kept.fit(progress=False)
    assert [r["lr"] for r in history if "loss" in r] == [pytest.approx(0.01 * 0.1)]  # past its end: the final rate


# -- 6. runs of skipped updates ---------------------------------------------------------------------


def poison_from(t: Trainer, first: int) -> None:
    """Every step from ``first`` on reads a token outside the vocabulary: its loss is NaN."""
    read = t.batch

    def batch(step: int):
        out = read(step)
        if step < first:
            return out
        inputs = np.array(out["inputs"])
        inputs[0, 0] = 10**6
        return {**out, "inputs": jax.device_put(inputs, out["inputs"].sharding)}

    t.batch = batch


def test_consecutive_skipped_updates_are_limited(tmp_path):
    t = trainer(tmp_path, "train.steps=8", "train.nonfinite=skip", "train.max_consecutive_skips=3")
    poison_from(t, 2)
    with pytest.raises(NonFiniteError, match=r"^step 5: 4 updates in a row skipped .*max_consecutive_skips=3"):
        t.fit(progress=False)
    assert [r["skipped_updates"] for r in records(tmp_path) if "loss" in r] == [0, 0, 1, 2, 3]


def test_the_summary_counts_skipped_updates(tmp_path, capsys):
    # A rate of 1e30 from step 1 on: the update of step 1 makes every later loss non-finite.
    sets = [*TINY, "rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "train.steps=4",
            "train.learning_rate=1e30", "train.nonfinite=skip", f"run_dir={tmp_path}"]
    assert cli.main(["train", "--no-progress", *(a for s in sets for a in ("--set", s))]) == 0
    assert "; 2 updates skipped (non-finite)" in capsys.readouterr().out


# -- 7. bad input, before anything compiles ---------------------------------------------------------


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("text")
    (src / "a.txt").write_text("some text to tokenize " * 400)
    out = tmp_path_factory.mktemp("tokens")
    prepare_data([str(src / "a.txt")], out, "byte", val_fraction=0.0)
    return out


def copy_tokens(token_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tokens"
    shutil.copytree(token_dir, out)
    return out


def test_a_truncated_token_file_is_one_line_before_compiling(token_dir, tmp_path):
    data = copy_tokens(token_dir, tmp_path)
    with open(data / "train.bin", "r+b") as f:
        f.truncate(1000)
    config = tiny_config(*ONE_DEVICE, "data.source=tokens", f"data.path={data}", "model.vocab_size=264")
    with pytest.raises(ConfigError, match=r"train\.bin has 1000 bytes, meta\.json says \d+ uint16 tokens"):
        Trainer.build(config, jax.devices()[:1])


@pytest.mark.parametrize("dtype", ["object", "float32", "<U4", 7])
def test_a_bad_token_dtype_is_one_line_before_compiling(token_dir, tmp_path, dtype):
    data = copy_tokens(token_dir, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "dtype": dtype}))
    config = tiny_config(*ONE_DEVICE, "data.source=tokens", f"data.path={data}", "model.vocab_size=264")
    with pytest.raises(ConfigError, match=rf"dtype {dtype!r} is not one of uint8, uint16, int32, uint32"):
        Trainer.build(config, jax.devices()[:1])


def test_resume_without_a_checkpoint_is_one_line(tmp_path, capsys):
    sets = [*TINY, "rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", f"run_dir={tmp_path}"]
    assert cli.main(["train", "--resume", *(a for s in sets for a in ("--set", s))]) == 2
    assert capsys.readouterr().err == (f"jaxscale: error: --resume: no complete checkpoint in {tmp_path}/checkpoints "
                                       "(leave out --resume to start afresh)\n")


def test_zero_steps_is_refused():
    with pytest.raises(ConfigError, match=r"^train\.steps must be at least 1, got 0$"):
        load_config(None, ["train.steps=0"])
    with pytest.raises(ConfigError, match=r"^train\.schedule_steps must be at least 1"):
        load_config(None, ["train.schedule_steps=0"])


def test_the_data_key_named_on_resume(tmp_path):
    trainer(tmp_path, "train.steps=1", "checkpoint.every=1").fit(progress=False)
    other = trainer(tmp_path, "train.steps=2", "train.schedule_steps=1", "checkpoint.resume=auto", "train.seq_len=16")
    with pytest.raises(ConfigError, match=r"trained with train\.seq_len=32, this config has 16$"):
        other.fit(progress=False)


# jax 0.12 continues a log's status over lines (seen from a survivor of a killed coordinator).
CONTINUED = [
    b":UNAVAILABLE:Stream removed (Socket closed)\n",
    b"=== Source Location Trace: ===\n",
    b"external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89\n",
    b". This is only expected if one of the tasks is unhealthy. Check the logs for the actual root cause.\n",
    b"\n",
]


def test_the_stderr_filter_replaces_jax_fatal_log_by_one_line():
    """What a survivor of a lost coordinator prints (jaxscale/runtime/distributed.py: JAX aborts it), jax 0.12's
    continuation lines too."""
    import os

    from jaxscale.runtime.distributed import _filter

    read, write = os.pipe()
    logs = [
        b"step 3 loss 5.1\n",
        b"W1123 21:47:51.699933   25797 preemption_sync_manager.cc:147] Failed to retrieve preemption notice\n",
        b"Additional GRPC error information from remote target coordination_service while calling\n",
        b":UNKNOWN:Error received from peer  {grpc_message:\"Socket closed\", grpc_status:14}\n",
        b"E1123 21:47:51.700014   25797 coordination_service_agent.cc:289] Polled an error\n",
        *CONTINUED,
        b"F1123 21:47:51.7 client.cc:12] Terminating process because the JAX distributed service detected fatal "
        b"errors. This most likely indicates that another task died. absl::Status: UNAVAILABLE: Failed to send RPC "
        b"to coordination service. Either the leader task was preempted\n",
        *CONTINUED,
        b"*** Check failure stack trace: ***\n",
        b"    @     0x7f991dcf0321  tsl::RPCState<>::OnCompleted()\n",
        b"\rtrain: 10%",
    ]
    os.write(write, b"".join(logs))
    os.close(write)
    out_read, out_write = os.pipe()
    _filter(read, out_write, 1)
    os.close(out_write)
    with os.fdopen(out_read, "rb") as f:
        assert f.read().decode() == (
            "step 3 loss 5.1\njaxscale: error: process 1 lost process 0 (the coordinator): UNAVAILABLE: Failed to "
            "send RPC to coordination service\n\rtrain: 10%"
        )


def test_the_stderr_filter_judges_a_line_split_across_reads_whole():
    """The trainer's lost-peer line arrives in two reads, then JAX's fatal log: one line goes on, not two."""
    import os
    import threading
    import time

    from jaxscale.runtime.distributed import _filter

    read, write = os.pipe()
    out_read, out_write = os.pipe()
    worker = threading.Thread(target=_filter, args=(read, out_write, 1))
    worker.start()
    for piece in (b"jaxscale: error: process 1 lost process 0 (the coordinator): Gloo all-reduce",
                  b" failed\n",
                  b"F1123 21:47:51.7 client.cc:12] Terminating process because the JAX distributed service detected "
                  b"fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service\n"):
        os.write(write, piece)
        time.sleep(0.2)  # each piece is a read of its own
    os.close(write)
    worker.join(timeout=10)
    os.close(out_write)
    with os.fdopen(out_read, "rb") as f:
        one = "jaxscale: error: process 1 lost process 0 (the coordinator): Gloo all-reduce failed\n"
        assert f.read().decode() == one
