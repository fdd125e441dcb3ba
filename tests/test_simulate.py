"""jaxscale.simulate_devices: simulated CPU devices for scripts, before jax starts, and a clear error after."""

import subprocess
import sys

import jax
import pytest
from helpers import subprocess_env

import jaxscale
from jaxscale.config.read import ConfigError

SCRIPT = """
import os, sys
import jaxscale
assert "jax" not in sys.modules  # the call needs no jax
jaxscale.simulate_devices(3)
import jax
print(jax.device_count(), jax.default_backend(), os.environ["XLA_FLAGS"])
"""


def test_a_fresh_script_gets_the_devices_it_asks_for():
    env = subprocess_env("--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=5")
    del env["JAX_PLATFORMS"]
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    count, backend, flags = out.stdout.split(maxsplit=2)
    assert (count, backend) == ("3", "cpu")
    assert flags.split() == ["--xla_cpu_enable_fast_math=false", "--xla_force_host_platform_device_count=3"]


def test_after_jax_started_the_same_count_is_accepted_another_refused():
    jax.devices()  # the test session runs on 8 simulated devices (conftest)
    jaxscale.simulate_devices(jax.device_count())
    with pytest.raises(ConfigError, match=r"^simulate_devices\(3\): jax has already started with 8 cpu device"):
        jaxscale.simulate_devices(3)


@pytest.mark.parametrize("count", [0, -2, 2.0, "8", True])
def test_the_count_is_a_positive_integer(count):
    with pytest.raises(ConfigError, match="positive integer"):
        jaxscale.simulate_devices(count)
