"""Eight simulated CPU devices for every test, set before jax is imported."""

import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from jaxscale.config import Config, load_config  # noqa: E402

# A model small enough to compile in seconds, with every dimension divisible by 8.
TINY = [
    "model.vocab_size=256",
    "model.embed=64",
    "model.layers=2",
    "model.heads=8",
    "model.kv_heads=4",
    "model.head_dim=8",
    "model.mlp=128",
    "train.global_batch=16",
    "train.seq_len=32",
    "train.steps=2",
    "train.warmup_steps=1",
    "train.learning_rate=0.01",
    "data.max_bytes=200000",
]


def tiny_config(*overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None) -> Config:
    """The test model with a rules preset and mesh sizes (unnamed axes are 1)."""
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, **(mesh or {})}
    mesh_args = [f"mesh.{k}={v}" for k, v in sizes.items()]
    return load_config(None, [*TINY, f"rules={rules}", *mesh_args, *overrides])


ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(xla_flags: str | None = "--xla_force_host_platform_device_count=8") -> dict[str, str]:
    """The environment for a jaxscale subprocess: this checkout's code, CPU devices as asked."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return env


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")
