"""Mixed precision (jaxscale/precision.py): the copies' bytes per device, the gathers' dtype, checkpoints."""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from jaxscale import precision
from jaxscale.checkpoint import Checkpointer
from jaxscale.config import ConfigError
from jaxscale.inspect import per_device_bytes
from jaxscale.train import Trainer

N = 8
BF16 = "model.dtype=bfloat16"


def test_policy_resolves_from_the_model_and_refuses_a_narrow_master():
    p = precision.policy(tiny_config(BF16))
    assert (p.compute.name, p.master.name, p.reduce.name, p.two_copies) == ("bfloat16", "float32", "float32", True)
    assert not precision.policy(tiny_config()).two_copies  # fp32 training: one copy
    # fp32 weights cast to bf16 in the model (jaxscale's bf16 training before the policy): one copy too
    assert not precision.policy(tiny_config(BF16, "precision.params=float32")).two_copies
    with pytest.raises(ConfigError, match=r"precision\.master \(bfloat16\) is narrower than the compute copy"):
        tiny_config("precision.master=bfloat16")
    with pytest.raises(ConfigError, match=r"precision\.grads_reduce: 'float16' is not one of float32, bfloat16"):
        tiny_config("precision.grads_reduce=float16")


@pytest.mark.parametrize(("rules", "mesh", "bytes_per_param"), [
    ("zero1", {"data": N}, 2 + 12 / N),
    ("zero2", {"data": N}, 2 + 12 / N),
    ("zero3", {"fsdp": N}, 16 / N),
])
def test_state_bytes_per_device_are_the_playbooks(rules, mesh, bytes_per_param):
    """Compute copy + master + Adam moments per device, from the trainer's sharded state: ZeRO-1/2 within 5%
    of 2Ψ + 12Ψ/N, ZeRO-3 at most 16Ψ/N (+5%); the compute copy bf16 in the parameters' layout, the
    master fp32 in the optimizer's."""
    trainer = Trainer.build(tiny_config(BF16, rules=rules, mesh=mesh))
    state = trainer.abstract_state()
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_params))
    held = per_device_bytes((state.params, state.master, state.opt_state))
    print(f"{rules}: {held / psi:.3f} bytes per parameter per device (playbook {bytes_per_param:.3f})")
    if rules == "zero3":
        assert held <= 1.05 * bytes_per_param * psi
    else:
        assert abs(held - bytes_per_param * psi) <= 0.05 * bytes_per_param * psi
    assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"bfloat16"}
    assert {x.dtype.name for x in jax.tree.leaves(state.master)} == {"float32"}
    assert per_device_bytes(state.master) == psi * 4 / N


def test_fp32_training_keeps_one_copy():
    trainer = Trainer.build(tiny_config(rules="zero1", mesh={"data": N}))
    state = trainer.abstract_state()
    assert state.master == {} and trainer.state_shardings.master == {}
    assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"float32"}


def partitioned_collectives(trainer: Trainer, tmp_path) -> list[tuple[str, str, int]]:
    """(dtype, collective, elements) of every all-gather / all-reduce / reduce-scatter of the compiled step, read
    from XLA's dump of the module right after SPMD partitioning (before XLA:CPU widens bf16 to f32)."""
    options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "spmd-partitioning"}
    trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile(compiler_options=options)
    (path,) = glob.glob(f"{tmp_path}/*train_step*after_spmd-partitioning*.txt")
    text = Path(path).read_text()
    found = re.findall(r"= (\w+)\[([\d,]*)\][^\n]*? (all-gather|all-reduce|reduce-scatter)\(", text)
    return [(dtype, op, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims, op in found]


@pytest.mark.parametrize(("rules", "mesh"), [("zero3", {"fsdp": N}), ("zero1", {"data": N})])
def test_parameter_gathers_of_a_bf16_step_are_bf16(rules, mesh, tmp_path):
    """Every all-gather of a parameter-sized array moves bf16: ZeRO-3's gathers in forward and backward
    (the compute copy is cast from the master shard, then gathered), ZeRO-1's gather of the new compute
    copy after the update on the shard. Read from the partitioned HLO (XLA dump after spmd-partitioning)."""
    trainer = Trainer.build(tiny_config(BF16, rules=rules, mesh=mesh))
    gathers = [(dtype, size) for dtype, op, size in partitioned_collectives(trainer, tmp_path) if op == "all-gather"]
    smallest = min(math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_params["blocks"]["attn"]))
    weights = [(dtype, size) for dtype, size in gathers if size >= smallest]
    assert len(weights) >= 7, gathers  # wq, wk, wv, wo, w_gate, w_up, w_down at least
    assert {dtype for dtype, _ in weights} == {"bf16"}, weights


def test_bf16_checkpoints_resume_exactly_and_reshard(tmp_path):
    """The master is saved with the state: stop at 2, resume to 4, equal to 4 straight; restored onto
    another layout (zero1 -> zero3); a resume with one copy is refused."""
    base = [BF16, "train.steps=4", "checkpoint.every=2", "train.log_every=1"]
    trainer = Trainer.build(tiny_config(*base, f"run_dir={tmp_path / 'a'}", rules="zero1", mesh={"data": N}))
    state, _ = trainer.fit(progress=False)
    trainer.config.run_dir, trainer.config.checkpoint.resume = str(tmp_path / "b"), "auto"  # the same compiled step
    trainer.fit(progress=False, stop_at=2)
    again, _ = trainer.fit(progress=False)
    for a, b in zip(jax.tree.leaves(jax.device_get(again)), jax.tree.leaves(jax.device_get(state)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.leaves(state.master)

    other = Trainer.build(tiny_config(*base, rules="zero3", mesh={"fsdp": N}))
    checkpoints = Checkpointer(tmp_path / "a" / "checkpoints")
    restored = checkpoints.restore(other.abstract_state(), 4).state
    for array, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(other.state_shardings), strict=True):
        assert array.sharding == sharding
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(jax.device_get(state)), strict=True):
        np.testing.assert_array_equal(a, b)
    checkpoints.close()

    one_copy = Trainer.build(tiny_config(*base, "precision.params=float32", f"run_dir={tmp_path / 'a'}",
                                         "checkpoint.resume=auto", rules="zero1", mesh={"data": N}))
    with pytest.raises(ConfigError, match=r"keeps compute copy bfloat16 \+ master float32, the config compute copy"):
        one_copy.fit(progress=False)


STEPS, WINDOW, SMOOTHED_TOL = 200, 20, 0.05


def test_two_copies_follow_the_one_copy_bf16_curve():
    """200 steps of the tiny model in bf16: the bf16 compute copy with an fp32 master stays within 0.05 nats
    (20-step means) of one fp32 copy cast to bf16 in the model (jaxscale's bf16 training before this policy)."""
    curves = {}
    for params in ("auto", "float32"):
        settings = (f"train.steps={STEPS}", "train.learning_rate=0.003", "train.warmup_steps=10")
        trainer = Trainer.build(tiny_config(BF16, f"precision.params={params}", *settings), jax.devices()[:1])
        state, losses = trainer.init_state(), []
        for k in range(STEPS):
            state, metrics = trainer.step(state, trainer.batch(k))
            losses.append(metrics["loss"])
        curves[params] = np.asarray(jax.device_get(losses), np.float64)

    def smooth(x: np.ndarray) -> np.ndarray:
        return np.convolve(x, np.ones(WINDOW) / WINDOW, mode="valid")

    two, one = smooth(curves["auto"]), smooth(curves["float32"])
    gap = np.abs(two - one)
    print(f"bf16 20-step means at the end: two copies {two[-1]:.4f}, one copy {one[-1]:.4f}; gap {gap.max():.4f}")
    assert curves["auto"][0] - two[-1] > 2.0  # it learns
    assert not np.array_equal(curves["auto"], curves["float32"])
    assert gap.max() <= SMOOTHED_TOL, f"smoothed loss {gap.max():.3f} apart at step {gap.argmax()}"
