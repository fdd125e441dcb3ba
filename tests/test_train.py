"""The training loop, its metrics, and remat / precision options (tests/test_readme.py runs the README's examples)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, assert_trees_close, subprocess_env, tiny_config

from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu"}


def test_loss_falls_and_metrics_are_logged(run_dir):
    config = tiny_config("train.steps=40", "train.log_every=10", f"run_dir={run_dir}", rules="zero3", mesh={"fsdp": 8})
    _, history = fit(Trainer.build(config), progress=False)
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 20, 30, 39]
    assert records == history
    assert all(r.keys() >= METRIC_KEYS for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert records[0]["lr"] == 0.0 and records[1]["lr"] > 0
    assert all(r["tokens_per_sec"] > 0 and r["mfu"] > 0 for r in records)


def test_qk_norm_under_fsdp_tp_matches_one_device():
    # model.qk_norm: one q and one k scale [head_dim] per layer, shared by the heads the tensor axis splits.
    ref = Trainer.build(tiny_config("model.qk_norm=true"), jax.devices()[:1])
    trainer = Trainer.build(tiny_config("model.qk_norm=true", rules="fsdp_tp", mesh={"fsdp": 4, "tensor": 2}))
    ref_loss, ref_grads = ref.loss_and_grads(ref.init_state().params, ref.batch(0))
    loss, grads = trainer.loss_and_grads(trainer.init_state().params, trainer.batch(0))
    assert abs(float(loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)
    scale = ref_grads["blocks"]["attn"]["q_norm"]["scale"]
    assert scale.shape == (2, 8) and float(jnp.abs(scale).min()) > 0


@pytest.mark.parametrize("remat", ["full", "selective", "save_dots", "save_named"])
def test_remat_policies_keep_gradients(remat, one_device):
    params, batch = one_device.trainer.init_state().params, one_device.trainer.batch(0)
    names = ["model.remat_names=[query,key,value,mlp_hidden]"] if remat == "save_named" else []
    trainer = Trainer.build(tiny_config(f"model.remat={remat}", *names), jax.devices()[:1])
    loss, grads = trainer.loss_and_grads(params, batch)
    ref_loss, ref_grads = one_device.loss, one_device.grads
    assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_bfloat16_compute_keeps_fp32_master_weights():
    trainer = Trainer.build(tiny_config("model.dtype=bfloat16", rules="fsdp_tp_sp", mesh={"fsdp": 2, "tensor": 4}))
    state = trainer.init_state()
    state, out = trainer.step(state, trainer.batch(0))
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(state.params))  # the compute copy
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(state.master))
    assert np.isfinite(float(out["loss"])) and abs(float(out["loss"]) - np.log(256)) < 0.5


@pytest.mark.slow
def test_cli_trains_and_writes_metrics(tmp_path):
    cmd = [sys.executable, "-m", "jaxscale", "train", "--no-progress", "--set", "train.steps=2",
           "--set", f"run_dir={tmp_path}", "--set", "data.max_bytes=100000"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert "loss" in result.stdout
