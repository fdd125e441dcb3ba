"""xla.preset / xla.flags: the flag strings, merging with flags already set, and what a run does with them."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from helpers import subprocess_env, tiny_config

from jaxscale.config.read import ConfigError, XlaConfig, load_config
from jaxscale.runtime import xla_flags
from jaxscale.training.trainer import Trainer

DEVICES = "--xla_force_host_platform_device_count=8"


def test_each_preset_sets_its_flags_in_its_variable():
    gpu = xla_flags.environment(XlaConfig("gpu"), {})
    assert list(gpu) == ["XLA_FLAGS"]
    assert gpu["XLA_FLAGS"].split() == list(xla_flags.GPU_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in gpu["XLA_FLAGS"].split()
    tpu = xla_flags.environment(XlaConfig("tpu"), {})
    assert list(tpu) == ["LIBTPU_INIT_ARGS"]  # only libtpu reads it; XLA_FLAGS stays untouched
    assert tpu["LIBTPU_INIT_ARGS"].split() == list(xla_flags.TPU_FLAGS)
    assert "--xla_tpu_enable_async_collective_fusion=true" in tpu["LIBTPU_INIT_ARGS"].split()
    assert xla_flags.environment(XlaConfig("none"), {}) == {}
    own = XlaConfig("none", ["--xla_dump_to=/tmp/dump"])
    assert xla_flags.environment(own, {"XLA_FLAGS": DEVICES}) == {"XLA_FLAGS": f"--xla_dump_to=/tmp/dump {DEVICES}"}
    for preset in ("gpu", "tpu"):  # every flag once, each --name=value
        names = [xla_flags.flag_name(f) for f in xla_flags.PRESETS[preset]]
        assert len(set(names)) == len(names)
        assert all(f.startswith("--") and "=" in f for f in xla_flags.PRESETS[preset])


def test_gpu_preset_follows_the_h100_recipes_and_holds_no_removed_flag():
    """What the JAX-Toolbox and MaxText H100 recipes agree on is in the preset; the names they still list that
    jaxlib 0.10.2 no longer knows (its parser aborts the process on them) are not."""
    names = {xla_flags.flag_name(f): f.split("=", 1)[1] for f in xla_flags.GPU_FLAGS}
    agreed = {
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_pipelined_all_gather": "true",
        "xla_gpu_enable_pipelined_reduce_scatter": "true",
        "xla_gpu_enable_while_loop_double_buffering": "true",
        "xla_gpu_enable_triton_gemm": "false",
        "xla_disable_hlo_passes": "rematerialization",  # jaxscale's remat, sized by the planner, decides
    }
    assert {k: names.get(k) for k in agreed} == agreed
    removed = {"xla_gpu_enable_triton_softmax_fusion", "xla_gpu_graph_level", "xla_gpu_enable_async_collectives",
               "xla_gpu_enable_async_all_gather", "xla_gpu_simplify_all_fp_conversions"}
    assert not removed & set(names)
    assert "xla_gpu_enable_command_buffer" not in names  # XLA's default (on) is kept


def test_flags_already_set_are_kept_and_win():
    user = f"{DEVICES} --xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    merged = xla_flags.environment(XlaConfig("gpu", ["--xla_dump_to=/tmp/y"]), {"XLA_FLAGS": user})["XLA_FLAGS"]
    assert merged.endswith(user)  # nothing dropped, and last (XLA keeps a flag's last value)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged.split()
    assert "--xla_dump_to=/tmp/y" not in merged.split()
    assert set(merged.split()) == set(user.split()) | set(xla_flags.GPU_FLAGS[1:])


def test_bad_xla_config_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"xla.preset: 'cuda' is not one of none, gpu, tpu"):
        load_config(None, ["xla.preset=cuda"])
    with pytest.raises(ConfigError, match=r"xla.flags\[1\]: 'xla_foo=1' is not one flag"):
        load_config(None, ["xla.flags=[--xla_a=1, xla_foo=1]"])


def test_after_the_backend_started_apply_refuses_and_build_warns(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
    jax.devices()  # the backend starts here, if no test has started it before
    with pytest.raises(ConfigError, match="the jax backend has already started"):
        xla_flags.apply(XlaConfig("gpu"))
    assert "latency_hiding" not in os.environ["XLA_FLAGS"]
    with pytest.warns(UserWarning) as record:
        Trainer.build(tiny_config("xla.preset=gpu", rules="dp", mesh={"data": 8}))
    messages = sorted(str(w.message) for w in record if str(w.message).startswith("xla."))
    assert messages == [
        "xla.preset=gpu on the cpu backend: its flags have no effect there",
        f"xla.preset=gpu: {len(xla_flags.GPU_FLAGS)} flag(s) not in XLA_FLAGS "
        "(e.g. xla_gpu_enable_latency_hiding_scheduler): call "
        "jaxscale.runtime.xla_flags.apply(config.xla) before jax starts, or use the jaxscale command",
    ]


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [*(a for o in overrides for a in ("--set", o)), "--set", f"run_dir={tmp_path}"]
    tiny = ["model.layers=1", "model.embed=32", "model.mlp=64", "model.heads=4", "model.kv_heads=2",
            "model.head_dim=8", "train.seq_len=16", "train.global_batch=4", "train.steps=1",
            "data.max_bytes=50000", "rules=dp", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"]
    cmd = [sys.executable, "-m", "jaxscale", "train", "--no-progress", *(a for o in tiny for a in ("--set", o)), *sets]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=subprocess_env(None))


@pytest.mark.slow
def test_cli_applies_the_gpu_preset_before_the_backend_starts(tmp_path):
    # jaxlib's CPU wheel parses the GPU flags too (one set of XLA debug options): the run goes on, the
    # preset in XLA_FLAGS next to the simulated devices, with a note that it does nothing on CPU.
    result = _train(tmp_path, "xla.preset=gpu")
    assert result.returncode == 0, result.stderr
    assert "xla.preset=gpu on the cpu backend: its flags have no effect there" in result.stderr
    assert "not in XLA_FLAGS" not in result.stderr
    # A name XLA does not know reaches XLA's parser, which ends the process before anything runs.
    result = _train(tmp_path, "xla.flags=[--xla_no_such_flag=1]")
    assert result.returncode != 0
    assert "Unknown flag in XLA_FLAGS: --xla_no_such_flag=1" in result.stderr
