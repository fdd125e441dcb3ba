"""Eight simulated CPU devices for every test, set before jax is imported; the session's fixtures."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from helpers import Run, Trainers, run_steps  # noqa: E402  (after the devices are set up)


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture(scope="session")
def trainers() -> Trainers:
    """Built trainers and compiled steps shared by the whole session (:class:`helpers.Trainers`)."""
    return Trainers()


@pytest.fixture(scope="session")
def one_device(trainers) -> Run:
    """The test model (rules dp) on one device, two steps: the run every layout must reproduce."""
    return run_steps(*trainers.step(devices=1))
