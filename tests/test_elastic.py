"""distributed.elastic: a run on fewer devices than its mesh shrinks the data axis, the global batch kept by more
microbatches; resumed so (and re-expanded when all are back), it ends equal (within a changed reduction order) to
the run on the whole mesh."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from helpers import subprocess_env, tiny_config
from test_multihost import free_port

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.read import ConfigError
from jaxscale.runtime import elastic
from jaxscale.training.report import parse_records, read_records
from jaxscale.training.trainer import Trainer

STEPS = 8
RUN = ["train.global_batch=12", f"train.steps={STEPS}", "train.log_every=1"]


@pytest.mark.parametrize(
    ("overrides", "devices", "want"),
    [
        (["mesh.data=4", "mesh.tensor=2"], 6, (3, 2)),  # 12 rows: 3 a replica -> 2 a microbatch on 3 replicas
        (["mesh.data=4", "mesh.tensor=2"], 8, (4, 1)),  # all there: unchanged
        (["mesh.data=4", "train.microbatches=3"], 2, (2, 6)),  # 1 row a microbatch and replica, as before
        (["mesh.data=2", "mesh.fsdp=2", "train.global_batch=8"], 2, (1, 2)),  # fsdp splits the batch too
    ],
)
def test_the_data_axis_shrinks_and_microbatches_grow(overrides, devices, want):
    config = tiny_config("distributed.elastic=true", "train.global_batch=12", *overrides)
    shrunk, line = elastic.fit(config, devices)
    assert (shrunk.mesh.data, shrunk.train.microbatches) == want
    assert shrunk.train.global_batch == config.train.global_batch
    assert (line is None) == (shrunk is config)


def test_what_does_not_shrink():
    full = ["mesh.data=4", "mesh.tensor=2", "train.global_batch=12"]
    assert elastic.fit(tiny_config(*full), 6)[0].mesh.data == 4  # not elastic: the build says the mesh needs 8
    with pytest.raises(ConfigError, match=r"distributed\.elastic: 1 devices cannot hold the mesh's other axes"):
        elastic.fit(tiny_config("distributed.elastic=true", *full), 1)
    with pytest.raises(ConfigError, match=r"train\.global_batch=8 does not split over data=3"):
        elastic.fit(tiny_config("distributed.elastic=true", "mesh.data=4", "train.global_batch=8"), 3)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r}


def test_resumed_on_fewer_replicas_equals_the_whole_mesh(tmp_path):
    whole = tiny_config("mesh.data=4", *RUN, "distributed.elastic=true", f"run_dir={tmp_path / 'whole'}")
    Trainer.build(whole, jax.devices()[:4]).fit(progress=False)
    run = [*RUN, "mesh.data=4", "distributed.elastic=true", "checkpoint.every=3", "checkpoint.resume=auto",
           f"run_dir={tmp_path / 'run'}"]
    Trainer.build(tiny_config(*run), jax.devices()[:4]).fit(progress=False, stop_at=5)  # saves 3 and 5
    Checkpointer(tmp_path / "run" / "checkpoints").manager.delete(5)  # lost with the host: resumes at 3
    shrunk, _ = elastic.fit(tiny_config(*run), 3)
    assert (shrunk.mesh.data, shrunk.train.microbatches) == (3, 2)
    Trainer.build(shrunk, jax.devices()[:3]).fit(progress=False)
    assert sorted(losses(tmp_path / "run")) == list(range(STEPS))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)


def start(run_dir: Path, processes: int, *extra: str) -> list[subprocess.Popen]:
    """``processes`` jaxscale processes of one CPU device each, on a mesh of data=4."""
    env = subprocess_env("--xla_force_host_platform_device_count=1")
    port = free_port()
    sets = [*RUN, "rules=dp", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "train.seq_len=32", "model.layers=2",
            "data.max_bytes=200000", f"run_dir={run_dir}", "distributed.heartbeat_timeout_s=10",
            "distributed.elastic=true", f"train.schedule_steps={STEPS}", *extra]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jaxscale", "train", "--no-progress", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(processes), "--process-id", str(pid), *[a for s in sets for a in ("--set", s)]],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for pid in range(processes)
    ]


def wait(procs: list[subprocess.Popen]) -> list[str]:
    return [p.communicate(timeout=600)[1] for p in procs]


@pytest.mark.slow
def test_four_processes_one_killed_the_three_left_continue(tmp_path):
    whole = tmp_path / "whole"
    procs = start(whole, 4)
    errors = wait(procs)
    assert all(p.returncode == 0 for p in procs), errors[0][-2000:]
    run = tmp_path / "run"
    ckpt = ["checkpoint.every=2", "checkpoint.resume=auto"]
    procs = start(run, 4, *ckpt)
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "2").is_dir():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint was committed"
        time.sleep(0.2)
    procs[3].kill()
    wait(procs)
    survivors = start(run, 3, *ckpt, "train.steps=6")  # data 4 -> 3, microbatches 1 -> 2, to step 6
    errors = wait(survivors)
    assert all(p.returncode == 0 for p in survivors), errors[0][-2000:]
    assert "mesh.data 4 -> 3, train.microbatches 1 -> 2" in errors[0]
    again = start(run, 4, *ckpt)  # the host back: re-expanded to data=4
    errors = wait(again)
    assert all(p.returncode == 0 for p in again), errors[0][-2000:]
    assert "distributed.elastic" not in errors[0]
    records = parse_records(run / "metrics.jsonl")
    shrunk_from, expanded_from = [r["from_step"] for r in records if "from_step" in r][-2:]
    assert 2 <= shrunk_from < 6 and expanded_from == 6
    kept = losses(run)
    assert sorted(kept) == list(range(STEPS))  # every step's batch once: 12 sequences each
    assert kept == pytest.approx(losses(whole), rel=1e-5)
