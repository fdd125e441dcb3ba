"""Simulated CPU devices for scripts and notebooks: ``jaxscale.simulate_devices(8)`` before jax starts.

The ``jaxscale`` commands ask XLA for as many CPU devices as the experiment's mesh needs; code that
builds a :class:`~jaxscale.training.trainer.Trainer` itself makes the same request with this one call, which
must come before jax's first computation (XLA reads ``XLA_FLAGS`` once, when its backend starts).
Importing this module does not import jax.
"""

from __future__ import annotations

import os
import re

from jaxscale.config.read import ConfigError
from jaxscale.runtime.xla_flags import backend_started

COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulate_devices(count: int) -> None:
    """Make jax see ``count`` CPU devices: sets ``--xla_force_host_platform_device_count`` in
    ``XLA_FLAGS`` (replacing a count already there, keeping the other flags) and ``JAX_PLATFORMS=cpu``
    (unless set). After jax's backend has started this is a :class:`ConfigError`, unless it already
    shows ``count`` CPU devices."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"simulate_devices: the device count must be a positive integer, got {count!r}")
    if backend_started():
        import jax

        if jax.default_backend() == "cpu" and jax.device_count() == count:
            return
        raise ConfigError(
            f"simulate_devices({count}): jax has already started with {jax.device_count()} "
            f"{jax.default_backend()} device(s); call it before the first jax computation "
            f"(or set XLA_FLAGS={COUNT_FLAG}={count} before starting Python)"
        )
    kept = re.sub(rf"\s*{COUNT_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{kept} {COUNT_FLAG}={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
