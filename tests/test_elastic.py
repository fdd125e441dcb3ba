"""distributed.elastic: a run on fewer devices than its mesh shrinks the data axis, the global batch kept by more
microbatches; resumed so (and re-expanded when all are back), it ends equal (within a changed reduction order) to
the run on the whole mesh. launch/multiprocess.sh --elastic does it by itself: a process lost, the survivors go on,
and all start again every distributed.rejoin_every steps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from helpers import ROOT, subprocess_env, tiny_config
from test_multihost import free_port

from jaxscale.analysis import shrink_check
from jaxscale.checkpoint.store import Checkpointer
from jaxscale.commands import DEFAULT_EXPERIMENT
from jaxscale.config.read import ConfigError, load_config
from jaxscale.runtime import elastic
from jaxscale.training import loop
from jaxscale.training.report import parse_records, read_records
from jaxscale.training.trainer import Trainer

STEPS = 8
RUN = ["train.global_batch=12", f"train.steps={STEPS}", "train.log_every=1"]
# The run of the tests below, on 4 data replicas: in one process, or in 4 processes of one CPU device each.
SETS = [*RUN, "rules=dp", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "train.seq_len=32", "model.layers=2",
        "data.max_bytes=200000", "distributed.heartbeat_timeout_s=10", "distributed.elastic=true"]


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


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[int, float]:
    """The losses of the run on 4 data replicas of one process, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("whole")
    Trainer.build(load_config(DEFAULT_EXPERIMENT, [*SETS, f"run_dir={run_dir}"]), jax.devices()[:4]).fit(progress=False)
    return losses(run_dir)


def test_resumed_on_fewer_replicas_equals_the_whole_mesh(tmp_path, whole):
    run = [*SETS, "checkpoint.every=3", "checkpoint.resume=auto", f"run_dir={tmp_path}"]
    Trainer.build(load_config(DEFAULT_EXPERIMENT, run), jax.devices()[:4]).fit(progress=False, stop_at=5)
    Checkpointer(tmp_path / "checkpoints").manager.delete(5)  # lost with the host: resumes at 3
    shrunk, _ = elastic.fit(load_config(DEFAULT_EXPERIMENT, run), 3)
    assert (shrunk.mesh.data, shrunk.train.microbatches) == (3, 2)
    state, _ = loop.fit(Trainer.build(shrunk, jax.devices()[:3]), progress=False, steps=2)  # 3 -> 5, saved
    assert int(state.step) == 5
    Trainer.build(load_config(DEFAULT_EXPERIMENT, run), jax.devices()[:4]).fit(progress=False)  # re-expanded
    assert [r["from_step"] for r in parse_records(tmp_path / "metrics.jsonl") if "from_step" in r] == [0, 3, 5]
    assert sorted(losses(tmp_path)) == list(range(STEPS))
    assert losses(tmp_path) == pytest.approx(whole, rel=1e-5)


def test_the_planner_refuses_a_shrunk_mesh_over_the_memory():
    config, _ = elastic.fit(tiny_config("distributed.elastic=true", "mesh.data=4", "train.global_batch=12"), 2)
    trainer = Trainer.build(config, jax.devices()[:2])
    shrink_check.check(trainer, budget=2**40)  # a TiB a device: fits
    with pytest.raises(ConfigError, match=r"^distributed\.elastic: on a data axis of 2 the planner predicts 0\.\d+ GiB "
                                          r"a device, over the 0\.00 GiB usable: the run cannot shrink"):
        shrink_check.check(trainer, budget=1024)


def launcher(*args: str, env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / "launch" / "multiprocess.sh"), *args], env=env, text=True, **popen)


def pid_of(run_dir: Path, process_id: int) -> int | None:
    """The pid of the jaxscale process ``process_id`` training in ``run_dir``, None while there is none."""
    wanted = [f"--process-id\0{process_id}\0".encode(), f"run_dir={run_dir}\0".encode()]
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if b"jaxscale" in cmdline and all(w in cmdline for w in wanted):
            return int(entry.name)
    return None


@pytest.mark.slow
def test_the_launcher_continues_on_three_of_four_then_re_expands(tmp_path, whole):
    run = tmp_path / "run"
    sets = [*SETS, "checkpoint.every=2", f"run_dir={run}"]
    env = {**subprocess_env(None), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = launcher("--processes", "4", "--devices", "1", "--port", str(free_port()), "--grace", "20",
                    "--restarts", "1", "--elastic", "--rejoin-every", "2", "--no-progress",
                    *[a for s in sets for a in ("--set", s)], env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "2").is_dir():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint was committed"
        time.sleep(0.1)
    os.kill(pid_of(run, 3), 9)  # the harness kills one process; the launcher does the rest
    errors = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0, errors[-3000:]
    assert "1 of 4 processes lost (exit 137): continuing on 3" in errors
    assert "mesh.data 4 -> 3, train.microbatches 1 -> 2" in errors
    assert "re-expanding 3 -> 4 processes" in errors
    starts = [r["from_step"] for r in parse_records(run / "metrics.jsonl") if "from_step" in r]
    assert len(starts) == 3 and starts[0] == 0 and starts[1] in (2, 4) and starts[2] == starts[1] + 2
    kept = losses(run)
    assert sorted(kept) == list(range(STEPS))  # every step's batch once in the run as it stands
    final = Checkpointer(run / "checkpoints")
    assert final.read_json(STEPS).data["sequences_read"] == STEPS * 12  # none repeated or skipped: counted
    final.close()
    assert kept == pytest.approx(whole, rel=1e-5)


SHIM = """#!/usr/bin/env bash
# launch/multiprocess.sh's "python3 -m jaxscale train ...": in the first attempt process 3 is killed (kill -9) and
# the others end as when they lose a peer (exit 1); an attempt of 3 ends with $SHRUNK_EXIT (its second one creates
# $REJOIN_FILE first, where set); one of 4 after the first succeeds. The arguments of each start are kept.
here="$(dirname "$0")"
echo "$*" >> "$here/starts"
n=$(sed -E 's/.*--num-processes ([0-9]+).*/\\1/' <<< "$*")
id=$(sed -E 's/.*--process-id ([0-9]+).*/\\1/' <<< "$*")
if [[ $n == 4 && $* != *resume=auto* ]]; then
  if [[ $id == 3 ]]; then kill -9 $$; fi
  sleep 0.5; exit 1
fi
if [[ $n == 3 ]]; then
  shrunk=$(grep -c -- '--num-processes 3 --process-id 0' "$here/starts")
  if [[ $id == 0 && -n ${REJOIN_FILE:-} && $shrunk == 2 ]]; then touch "$REJOIN_FILE"; fi
  sleep 0.3; exit "$SHRUNK_EXIT"
fi
"""


@pytest.mark.parametrize(
    ("shrunk_exit", "rejoin", "attempts", "line"),
    [
        ("75", False, [4, 3, 4], "the lost hosts are back: re-expanding 3 -> 4 processes"),
        ("75", True, [4, 3, 3, 4], "the lost hosts are back: re-expanding 3 -> 4 processes"),
        ("2", False, [4, 3, 4], "3 processes cannot hold the run (the line above): restarting all 4 from the "
                                "newest checkpoint"),
    ],
)
def test_the_launchers_elastic_policy(tmp_path, shrunk_exit, rejoin, attempts, line):
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(SHIM)
    shim.chmod(0o755)
    rejoin_file = tmp_path / "back"
    env = {**subprocess_env(), "PATH": f"{shim.parent}:/usr/bin:/bin", "SHRUNK_EXIT": shrunk_exit,
           **({"REJOIN_FILE": str(rejoin_file)} if rejoin else {})}
    args = ["--processes", "4", "--grace", "5", "--restarts", "2", "--elastic", "--rejoin-every", "5",
            *(["--rejoin", str(rejoin_file)] if rejoin else []), "--set", "a=1"]
    out = launcher(*args, env=env, stderr=subprocess.PIPE).communicate(timeout=60)[1]
    assert "1 of 4 processes lost (exit 137): continuing on 3" in out and line in out, out
    starts = (shim.parent / "starts").read_text().splitlines()
    counts = [int(s.split("--num-processes ")[1].split()[0]) for s in starts if "--process-id 0 " in s]
    assert counts == attempts
    elastic_sets = "--set distributed.elastic=true --set distributed.rejoin_every=5 --set a=1"
    assert all(s.endswith(elastic_sets) for s in starts)
    assert ["resume=auto" in s for s in starts if "--process-id 0 " in s] == [False] + [True] * (len(attempts) - 1)
    assert not rejoin_file.exists()  # used up by the launcher


def test_the_launcher_refuses_rejoin_without_elastic():
    out = launcher("--rejoin-every", "3", stderr=subprocess.PIPE).communicate(timeout=10)[1]
    assert out == "launch/multiprocess.sh: error: --rejoin-every and --rejoin re-expand a shrunk run: add --elastic\n"
