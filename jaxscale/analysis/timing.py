"""The analytic model's time: a cluster's devices and networks, and the seconds of a step on them.

Time (:func:`step_time`): model FLOPs (6Ψ + causal attention, :mod:`jaxscale.flops`),
plus recomputation, at the cluster's stated efficiency, stretched by the pipeline bubble
(p−1)/(v·m+p−1); plus the communication that cannot hide: TP/SP, EP and ZeRO-1/2's
parameter gather are exposed, gradient reduction, ZeRO-3 gathers and the CP ring overlap
with compute up to the compute time. Each collective runs at the bandwidth of the slowest
link its group crosses (within a node or across nodes: the mesh puts ``tensor``
innermost).
:func:`load_cluster` reads a cluster file (``configs/clusters/``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from jaxscale.analysis.communication import Flow
from jaxscale.analysis.params import Step
from jaxscale.config import MESH_AXES, ConfigError, ModelConfig, parse_override, resolve_named
from jaxscale.flops import flops_per_token
from jaxscale.layout import Layout


@dataclasses.dataclass
class Cluster:
    """Devices, their memory and speed, and the two networks (within a node, across nodes); per device."""

    device: str
    memory_bytes: float
    peak_flops: float
    intra_bandwidth: float
    inter_bandwidth: float
    devices_per_node: int = 8
    nodes: int = 1
    usable_memory: float = 0.9
    compute_efficiency: float = 0.5

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def budget(self) -> float:
        """Bytes per device a layout may use."""
        return self.memory_bytes * self.usable_memory



def load_cluster(name_or_path: str, overrides: Sequence[str] = ()) -> Cluster:
    """A preset from ``configs/clusters/`` (or a YAML path), with ``KEY=VALUE`` overrides; checked."""
    path = resolve_named(name_or_path, "clusters")
    data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        keys, value = parse_override(item)
        data[".".join(keys)] = value
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"cluster {Path(path).stem}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
        if key == "device":
            continue
        try:
            number = float(value)  # YAML 1.1 reads 80.0e9 as a string
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or not number > 0:
            raise ConfigError(f"cluster {Path(path).stem}: '{key}' must be a positive number, got {value!r}")
        data[key] = number
    missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in data]
    if missing:
        raise ConfigError(f"cluster {Path(path).stem}: missing '{missing[0]}'")
    cluster = Cluster(**data)
    for key in ("devices_per_node", "nodes"):
        if getattr(cluster, key) != int(getattr(cluster, key)):
            raise ConfigError(f"cluster {Path(path).stem}: '{key}' must be an integer")
        setattr(cluster, key, int(getattr(cluster, key)))
    if cluster.usable_memory > 1 or cluster.compute_efficiency > 1:
        raise ConfigError(f"cluster {Path(path).stem}: usable_memory and compute_efficiency are fractions (<= 1)")
    return cluster



def crosses_nodes(axes: Sequence[str], mesh: Mapping[str, int], devices_per_node: int) -> bool:
    """Whether a group over ``axes`` spans nodes: devices are numbered along the mesh, ``tensor`` fastest."""
    stride_of = {}
    stride = 1
    for axis in reversed(MESH_AXES):
        stride_of[axis] = stride
        stride *= mesh[axis]
    return any(stride_of[a] * mesh[a] > devices_per_node for a in axes if mesh[a] > 1)



def step_time(
    m: ModelConfig, flows: Sequence[Flow], layout: Layout, step: Step, cluster: Cluster
) -> dict[str, float]:
    """Predicted seconds per step: compute, pipeline bubble, exposed communication; and the MFU."""
    devices = math.prod(layout.mesh.values())
    tokens = step.global_batch * step.seq_len
    model_flops = flops_per_token(m, step.seq_len) * tokens
    extra = {"none": 0.0, "save_dots": 0.05, "save_named": 0.15, "full": 1 / 3}[m.remat]
    p = layout.ways(("layers",))
    if p > 1 and step.pipeline_remat:  # the backward recomputes each stage's forward
        extra += 1 / 3
    compute = model_flops * (1 + extra) / devices / (cluster.peak_flops * cluster.compute_efficiency)
    bubble = 0.0
    if p > 1:
        bubble = compute * (p - 1) / (step.repeats * step.pipeline_microbatches)
    hidden = exposed = 0.0
    for f in flows:
        inter = crosses_nodes(f.axes, layout.mesh, cluster.devices_per_node)
        seconds = f.wire_bytes / (cluster.inter_bandwidth if inter else cluster.intra_bandwidth)
        if f.overlap:
            hidden += seconds
        else:
            exposed += seconds
    exposed += max(0.0, hidden - compute)
    total = compute + bubble + exposed
    return {
        "compute": compute,
        "bubble": bubble,
        "communication": hidden + exposed - max(0.0, hidden - compute),
        "exposed": exposed,
        "total": total,
        "mfu": model_flops / devices / cluster.peak_flops / total,
        "tokens_per_sec": tokens / total,
    }
