"""``jaxscale plan --calibrate FILE``: measure the devices present and write a cluster file the plan reads.

Every device runs the same work at once (a ``jax.shard_map`` over all of them), so what
is measured is what one device gets while the others run too (on simulated CPU devices
they share the host's cores). Each figure is the best of a few runs of a compiled loop of
``repeats`` iterations:

* matmuls: (d, d) x (d, d) in the compute dtype for a few d, on normally distributed data (constant
  operands let a GPU clock higher than real weights do); FLOP/s over ``peak_flops`` (the published
  peak of the device kind, :data:`jaxscale.config.flops.PEAK_FLOPS`; on a CPU, which has none, the best
  measured) is the ``matmul_efficiency`` table. The ``repeats`` matmuls are unrolled into one
  straight-line program: a loop's per-iteration overhead (on a GPU, a host round trip for the
  loop's predicate) would otherwise be timed as part of a small matmul;
* an attention block: causal fused attention forward and backward at a few sequence lengths, on
  as many sequences as make ``tokens`` tokens (a microbatch's worth), in the kernel a fused
  ``model.attention`` runs on this platform (cuDNN's on a GPU, XLA's elsewhere), its FLOPs
  counted as :mod:`jaxscale.analysis.timing` counts them. The ``attention_efficiency`` table is
  what the plan applies to fused attention (``cudnn``, ``blockwise``, ``ring``); XLA's ``dot``
  attention is costed as batched matmuls plus its scores' memory traffic;
* memory bandwidth: an elementwise update of a large array (one read, one write);
* collectives: all-reduce, all-gather, reduce-scatter, all-to-all and a ring permute over the
  devices of this process (``intra``) and, with several processes, across them (``inter``),
  at a small and a large size: the small one gives the latency per step, the difference the
  bandwidth (wire bytes as :func:`jaxscale.analysis.hlo.wire_bytes` counts them);
* the host link (on accelerators): copies to pinned host memory and back, all local devices at once
  (:mod:`jaxscale.analysis.host_measure`): ``host_bandwidth``, which lets the plan try ``offload_dots``.

The file records where its figures come from (``source``); :func:`jaxscale.analysis.cluster.load_cluster`
reads it like a hand-written preset.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh, PartitionSpec

from jaxscale.analysis import host_measure
from jaxscale.analysis.cluster import KINDS
from jaxscale.analysis.hlo import wire_bytes
from jaxscale.config.flops import PEAK_FLOPS, peak_flops

SIZES = {  # (matmul dims, attention sequence lengths, memory elements, small/large collective bytes) per device
    "cpu": ((32, 64, 128, 256), (64, 128, 256), 2**20, (2**10, 2**18)),
    "accelerator": ((256, 512, 1024, 2048, 4096, 8192), (512, 1024, 2048, 4096, 8192), 2**28, (2**12, 2**28)),
}
ATTENTION = {  # (tokens per device, heads, head_dim) of the attention block
    "cpu": (256, 4, 64),
    "accelerator": (16384, 8, 128),
}


def clock() -> Callable[[], float]:
    """Wall time on accelerators; on simulated CPU devices, which share the host's cores with each other and
    with whatever else runs there, this process's CPU time (all threads), which the others do not inflate."""
    return time.process_time if jax.devices()[0].platform == "cpu" else time.perf_counter


def _best(fn: Callable[[], Any], rounds: int = 3) -> float:
    """Seconds of the fastest of ``rounds`` calls (after one warm-up call that compiles)."""
    jax.block_until_ready(fn())
    now = clock()
    best = math.inf
    for _ in range(rounds):
        start = now()
        jax.block_until_ready(fn())
        best = min(best, now() - start)
    return best


def _everywhere(mesh: Mesh, axis: str, body: Callable[[jax.Array], jax.Array], local: tuple[int, ...],
                dtype: Any, repeats: int, unroll: bool = True) -> float:
    """Seconds per iteration of ``body`` run on each device's own ``local`` array of normally distributed data;
    ``unroll`` writes the iterations out on an accelerator, where a loop's iteration costs a host round trip
    (elementwise bodies must not: XLA would fuse them; on a CPU the loop costs next to nothing and unrolling
    only lengthens compilation). On an accelerator the figure is the difference between ``2·repeats`` and
    ``repeats`` iterations, so that a call's fixed cost (dispatch, launch, the wait for the result: tens of
    microseconds) does not count against a small body."""
    n = mesh.shape[axis]
    spec = PartitionSpec(axis)
    cpu = mesh.devices.flat[0].platform == "cpu"
    unroll = unroll and not cpu

    def timed(count: int) -> float:
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        def loop(x: jax.Array) -> jax.Array:
            return jax.lax.fori_loop(0, count, lambda _, y: body(y), x, unroll=unroll)

        return _best(lambda: loop(x))

    data = jax.random.normal(jax.random.key(0), (n * local[0], *local[1:]), jnp.float32).astype(dtype)
    x = jax.device_put(data, jax.NamedSharding(mesh, spec))
    if cpu:
        return timed(repeats) / repeats
    return max(timed(2 * repeats) - timed(repeats), 1e-12) / repeats


def matmuls(mesh: Mesh, dims: tuple[int, ...], dtype: Any, repeats: int) -> dict[int, float]:
    """FLOP/s of one device's (d, d) x (d, d) matmul, by d."""
    out = {}
    for d in dims:
        w = (jax.random.normal(jax.random.key(d), (d, d), jnp.float32) / math.sqrt(d)).astype(dtype)
        seconds = _everywhere(mesh, "x", lambda x, w=w: (x @ w).astype(x.dtype), (d, d), dtype, repeats)
        out[d] = 2 * d**3 / seconds
    return out


def attention(mesh: Mesh, lengths: tuple[int, ...], dtype: Any, repeats: int, tokens: int, heads: int,
              head_dim: int, implementation: str | None) -> dict[int, float]:
    """Model FLOP/s of causal attention forward + backward on ``tokens`` tokens per device, by sequence length."""
    out = {}
    for s in lengths:
        def step(x: jax.Array) -> jax.Array:
            def loss(q: jax.Array) -> jax.Array:
                o = jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation=implementation)
                return o.astype(jnp.float32).sum()

            return (x - 1e-3 * jax.grad(loss)(x)).astype(x.dtype)

        batch = max(1, tokens // s)
        seconds = _everywhere(mesh, "x", step, (batch, s, heads, head_dim), dtype, repeats)
        out[s] = 7 * batch * s * s * heads * head_dim / seconds  # forward 2·s²·a·d (causal half), backward 2.5x
    return out


def bandwidth(mesh: Mesh, elems: int, repeats: int) -> float:
    """Bytes/s of one device's memory: an elementwise update reads and writes each element once."""
    seconds = _everywhere(mesh, "x", lambda x: x * 0.999 + 1e-3, (elems,), jnp.float32, repeats, unroll=False)
    return 2 * 4 * elems / seconds


def _collective(kind: str, axis: str, n: int) -> Callable[[jax.Array], jax.Array]:
    """A shape-keeping body that runs one collective of ``kind`` over ``axis`` on its operand."""
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axis) * (1.0 / n)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x[: x.shape[0] // n], axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jnp.tile(jax.lax.psum_scatter(x, axis, tiled=True), n) * (1.0 / n)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, axis, perm)


def collectives(mesh: Mesh, axis: str, sizes: tuple[int, int], repeats: int) -> dict[str, list[float]]:
    """[latency per step (s), bandwidth (wire bytes/s)] of each collective kind over ``axis``."""
    n = mesh.shape[axis]
    out = {}
    for kind in KINDS:
        times = []
        for size in sizes:
            elems = max(n, size // 4 // n * n)
            times.append(_everywhere(mesh, axis, _collective(kind, axis, n), (elems,), jnp.float32, repeats))
        small, large = (wire_bytes(kind, n, max(n, s // 4 // n * n) * 4, 1) for s in sizes)
        steps = 1 if kind == "collective-permute" else math.ceil(math.log2(n)) * (2 if kind == "all-reduce" else 1)
        rate = (large - small) / max(times[1] - times[0], 1e-9)
        out[kind] = [float(f"{max(times[0] - small / rate, 0.0) / steps:.3g}"), float(f"{rate:.3g}")]
    return out


def _table(rates: dict[int, float], peak: float) -> list[list[float]]:
    """[[size, fraction of peak], ...], never falling with size: a larger matmul (or sequence) can always run
    as pieces of a smaller one, so a dip is noise of the measurement (clocks, power), not a property."""
    out, best = [], 0.0
    for k, v in sorted(rates.items()):
        best = max(best, min(1.0, v / peak))
        out.append([int(k), float(f"{best:.3g}")])
    return out


def _device_memory(device: Any, count: int) -> float:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / count)  # the host's, shared


def calibrate(repeats: int = 0) -> dict[str, Any]:
    """Measure the devices of this job; the cluster file's contents (see the module docstring)."""
    devices = jax.devices()
    local = jax.local_devices()
    first = devices[0]
    cpu = first.platform == "cpu"
    platform = "cpu" if cpu else "accelerator"
    dims, lengths, elems, sizes = SIZES[platform]
    repeats = repeats or (4 if cpu else 20)
    dtype = jnp.float32 if cpu else jnp.bfloat16
    flat = Mesh(np.array(devices), ("x",))
    mm = matmuls(flat, dims, dtype, repeats)
    fused = "cudnn" if first.platform == "gpu" else None  # model.attention=cudnn on a GPU; XLA's kernel elsewhere
    att = attention(flat, lengths, dtype, repeats, *ATTENTION[platform], fused)
    peak = max(mm.values()) if cpu else peak_flops(first)
    if not cpu and peak == PEAK_FLOPS["cpu"]:
        peak = max(mm.values())  # a device kind without a published peak: the best measured
    hosts = jax.process_count()
    per_host = len(devices) // hosts
    grid = Mesh(np.array(devices).reshape(hosts, per_host), ("inter", "intra"))
    measured = {"intra": collectives(grid, "intra", sizes, repeats)} if per_host > 1 else {}
    if hosts > 1:
        measured["inter"] = collectives(grid, "inter", sizes, repeats)
    ring = measured.get("intra") or measured.get("inter") or {"all-reduce": [1e-6, 1e9]}
    across = measured.get("inter", ring)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "device": f"{first.device_kind} ({first.platform})",
        "memory_bytes": _device_memory(first, len(local)),
        "usable_memory": 0.9,
        "peak_flops": float(f"{peak:.4g}"),
        "memory_bandwidth": float(f"{bandwidth(flat, elems, repeats):.3g}"),
        "devices_per_node": per_host,
        "nodes": hosts,
        "intra_bandwidth": ring["all-reduce"][1],
        "inter_bandwidth": across["all-reduce"][1],
        "latency_intra": ring["all-reduce"][0] or 1e-9,
        "latency_inter": across["all-reduce"][0] or 1e-9,
        "overlap_cost": 0.2 if first.platform == "gpu" else 0.0,  # NCCL's SMs (configs/clusters/h100.yaml)
        "matmul_efficiency": _table(mm, peak),
        "attention_efficiency": _table(att, peak),
        "collectives": measured,
        # the host link (offload; XLA:CPU's pinned_host is its one memory: no link to write)
        **({} if cpu else {"host_bandwidth": host_measure.host_bandwidth(local)["host_bandwidth"]}),
        "source": f"measured by jaxscale plan --calibrate on {len(devices)} x {first.device_kind}, {when}"
        + (" (simulated CPU devices sharing the host's cores; peak = the best measured matmul)" if cpu else ""),
    }


def write(data: dict[str, Any], path: str | Path) -> Path:
    """The cluster file, with a header saying how it was made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# {data['source']}.\n# Efficiencies are fractions of peak_flops by the side of a square matmul "
              "(a cube of as many FLOPs) / attention sequence length;\n"
              "# collectives: level -> kind -> [latency per step (s), wire bytes/s].\n")
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path
