"""A cluster: its devices, their memory and measured speeds, and the two networks (within a node, across nodes).

Read from a cluster file of ``configs/clusters/`` (written by hand from published figures or by
``jaxscale plan --calibrate``, :mod:`jaxscale.analysis.calibrate`) with ``--set KEY=VALUE`` overrides; every
table checked before the planner reads it (one line naming the file and key). No jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxscale.analysis.communication import EP_IMBALANCE
from jaxscale.analysis.target import checked_target
from jaxscale.config.read import ConfigError, parse_override, resolve_named

TABLES = ("matmul_efficiency", "attention_efficiency")
INTS = ("devices_per_node", "nodes")
Table = list[list[float]]


KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


LEVELS = ("intra", "inter")


@dataclasses.dataclass
class Cluster:
    """Devices, their memory and measured speeds, and the two networks (within a node, across nodes)."""

    device: str
    memory_bytes: float
    peak_flops: float
    intra_bandwidth: float
    inter_bandwidth: float
    devices_per_node: int = 8
    nodes: int = 1
    usable_memory: float = 0.9
    compute_efficiency: float = 0.5  # the matmul and attention efficiency where no table is given
    memory_bandwidth: float = 2.0e12  # bytes/s of device memory (HBM)
    latency_intra: float = 3.0e-6  # seconds per step of a collective within a node
    latency_inter: float = 8.0e-6  # ... across nodes
    overlap_cost: float = 0.0  # fraction of hidden communication time that still slows compute (GPU: SMs)
    host_bandwidth: float = 0.0  # bytes/s per device to host memory, one way; 0: offload not planned
    matmul_efficiency: Table | None = None  # [[side of a cube (M·N·K)^(1/3), fraction of peak], ...]
    attention_efficiency: Table | None = None  # [[sequence block, fraction of peak], ...]
    collectives: dict[str, dict[str, list[float]]] | None = None  # level -> kind -> [latency/step, bytes/s]
    # max/mean rows a device sends an expert shard in EP's dropless exchange (the routing's; moe_load_max measures
    # it at run time): the planner's assumption, not the devices'
    ep_imbalance: float = EP_IMBALANCE
    source: str = ""  # how the figures were obtained
    compile_target: str = ""  # what plan --verify compiles for (jaxscale.analysis.target): h100, v5e, ...

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def budget(self) -> float:
        """Bytes per device a layout may use."""
        return self.memory_bytes * self.usable_memory

    def matmul_eff(self, smallest: float) -> float:
        return interpolate(self.matmul_efficiency, smallest, self.compute_efficiency)

    def attention_eff(self, block: float) -> float:
        return interpolate(self.attention_efficiency, block, self.compute_efficiency)


def interpolate(table: Table | None, x: float, default: float) -> float:
    """The table's value at ``x``, linear in log2(x) between rows, clamped at the ends."""
    if not table:
        return default
    rows = sorted(table)
    if x <= rows[0][0]:
        return rows[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(rows):
        if x <= x1:
            w = math.log2(x / x0) / math.log2(x1 / x0)
            return y0 + w * (y1 - y0)
    return rows[-1][1]


def _check_table(name: str, key: str, value: Any) -> Table:
    ok = isinstance(value, list) and value and all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool) for v in r)
        and r[0] > 0 and 0 < r[1] <= 1 for r in value)
    if not ok:
        raise ConfigError(f"cluster {name}: '{key}' must be a list of [size, fraction of peak (0-1]] pairs")
    return [[float(a), float(b)] for a, b in value]


def _check_collectives(name: str, value: Any) -> dict[str, dict[str, list[float]]]:
    if not isinstance(value, dict) or not set(value) <= set(LEVELS):
        raise ConfigError(f"cluster {name}: 'collectives' maps {' / '.join(LEVELS)} to collective kinds")
    out: dict[str, dict[str, list[float]]] = {}
    for level, kinds in value.items():
        if not isinstance(kinds, dict) or not set(kinds) <= set(KINDS):
            raise ConfigError(f"cluster {name}: collectives.{level} maps kinds ({', '.join(KINDS)}) to "
                              "[latency per step (s), bandwidth (bytes/s)]")
        for kind, pair in kinds.items():
            if not (isinstance(pair, list) and len(pair) == 2 and pair[0] >= 0 and pair[1] > 0):
                raise ConfigError(f"cluster {name}: collectives.{level}.{kind} must be [latency >= 0, bandwidth > 0]")
        out[level] = {k: [float(a), float(b)] for k, (a, b) in kinds.items()}
    return out


def load_cluster(name_or_path: str, overrides: Sequence[str] = ()) -> Cluster:
    """A preset from ``configs/clusters/`` (or a YAML path), with ``KEY=VALUE`` overrides; checked."""
    path = resolve_named(name_or_path, "clusters")
    name = Path(path).stem
    data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        keys, value = parse_override(item)
        data[".".join(keys)] = value
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"cluster {name}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
        if key in ("device", "source"):
            data[key] = str(value)
        elif key == "compile_target":
            data[key] = checked_target(name, value)
        elif key in TABLES:
            data[key] = _check_table(name, key, value)
        elif key == "collectives":
            data[key] = _check_collectives(name, value)
        else:
            try:
                number = float(value)  # YAML 1.1 reads 80.0e9 as a string
            except (TypeError, ValueError):
                number = -1.0
            if isinstance(value, bool) or not (number > 0 or (key == "overlap_cost" and number == 0)):
                raise ConfigError(f"cluster {name}: '{key}' must be a positive number, got {value!r}")
            data[key] = number
    missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in data]
    if missing:
        raise ConfigError(f"cluster {name}: missing '{missing[0]}'")
    cluster = Cluster(**data)
    for key in INTS:
        if getattr(cluster, key) != int(getattr(cluster, key)):
            raise ConfigError(f"cluster {name}: '{key}' must be an integer")
        setattr(cluster, key, int(getattr(cluster, key)))
    if cluster.usable_memory > 1 or cluster.compute_efficiency > 1:
        raise ConfigError(f"cluster {name}: usable_memory and compute_efficiency are fractions (<= 1)")
    if cluster.ep_imbalance < 1:
        raise ConfigError(f"cluster {name}: 'ep_imbalance' is the busiest shard's rows over the mean (>= 1), "
                          f"got {cluster.ep_imbalance}")
    return cluster
