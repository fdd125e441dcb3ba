"""``jaxscale plan --calibrate``'s host link: the bytes/s a device moves to and from pinned host memory.

Every local device copies an array of ``nbytes`` to ``pinned_host`` memory and back at once (on an HGX node
the GPUs share PCIe switches, so what one device gets while the others copy is the figure the plan wants);
each direction is the best of a few rounds, and the link's figure, ``host_bandwidth`` (one way, per device), is
the slower direction's. XLA:CPU has one memory for ``device`` and ``pinned_host``: there the copy is a memcpy,
which :func:`jaxscale.analysis.calibrate.calibrate` does not write as a host link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding


def _seconds(arrays: list[jax.Array], kind: str, rounds: int) -> tuple[float, list[jax.Array]]:
    """The best of ``rounds`` copies of every array at once into memory ``kind``, and the copies."""
    to = [SingleDeviceSharding(next(iter(a.devices())), memory_kind=kind) for a in arrays]
    best, out = float("inf"), arrays
    for _ in range(rounds):
        start = time.perf_counter()
        out = jax.block_until_ready(jax.device_put(arrays, to))
        best = min(best, time.perf_counter() - start)
    return best, out


def host_bandwidth(devices: Sequence[Any], nbytes: int = 2**28, rounds: int = 3) -> dict[str, float]:
    """Bytes/s per device to (``to_host``) and from (``from_host``) pinned host memory, all ``devices`` copying at
    once, and their minimum (``host_bandwidth``)."""
    arrays = [jax.device_put(jnp.ones(nbytes // 4, jnp.float32), d) for d in devices]
    jax.block_until_ready(arrays)
    down, on_host = _seconds(arrays, "pinned_host", rounds)
    up, _ = _seconds(on_host, "device", rounds)
    rates = {"to_host": nbytes / down, "from_host": nbytes / up}
    return {**{k: float(f"{v:.3g}") for k, v in rates.items()}, "host_bandwidth": float(f"{min(rates.values()):.3g}")}
