"""Compile-only accelerators: a GPU or TPU topology to compile a step for, on any machine (``--target``).

With the CUDA plugin installed (``pip install 'jaxscale[gpu-compile]'``) and ``JAX_PLATFORMS=cpu`` set
before jax starts (the plugin then registers without looking for a GPU), XLA:GPU compiles for a
*target config* (a ``GpuTargetConfigProto`` in text form: the device's SMs, memory, compute capability
and library versions) and a topology (slices x hosts x devices per host), skipping autotuning. With
libtpu installed (``'jaxscale[tpu-compile]'``) the TPU compiler does the same for a named topology
(``v5e:2x4``). The devices it gives are real ``jax.Device`` objects of no client: ``Trainer.build(config,
target.devices)`` lays a step out on them and ``compile()`` returns the program a cluster of them runs
(:mod:`jaxscale.analysis.program` reads it).

Where the target config comes from, so that a plugin release does not break it: a spec file given by
path (any ``GpuTargetConfigProto`` text: ``--target-spec``), else the spec XLA embeds in the plugin for
that device name (XLA ships one per supported GPU, ``xla/backends/gpu/target_config/specs``), found as
the whole text block that names it (``device_description_str: "NVIDIA H100 80GB HBM3"``), not by an
offset or a symbol. The plugin parses it either way: a release that renames or drops a device fails
with one line listing the names it embeds, and a spec file still works.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from jaxscale.config.read import ConfigError

# Our names for the targets -> the device's name as the driver (and XLA's specs) spell it.
GPUS = {
    "a100": "NVIDIA A100-SXM4-80GB",
    "h100": "NVIDIA H100 80GB HBM3",
    "h100-pcie": "NVIDIA H100 PCIe",
    "h200": "NVIDIA H200 141GB HBM3e",
    "b200": "NVIDIA B200",
    "b300": "NVIDIA B300",
    "gb200": "NVIDIA GB200",
}
# TPU generations -> HBM per chip (the compile-only devices report none): Cloud TPU's published figures.
TPU_HBM = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
# TPU generations -> the dimensions of their torus (a topology names a side per dimension).
TPU_DIMS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
EXTRAS = {"gpu": "gpu-compile", "tpu": "tpu-compile"}
SPEC_SUFFIXES = (".txtpb", ".pbtxt", ".textproto")  # a GpuTargetConfigProto file's names


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile-only topology: its devices, their kind and memory, and the XLA preset written for them."""

    name: str
    platform: str  # "gpu" or "tpu"
    device_kind: str
    devices: tuple[Any, ...]
    hbm_bytes: int

    @property
    def preset(self) -> str:
        return self.platform


def platform_of(name: str) -> str:
    """``gpu`` or ``tpu`` for a target name (``h100``, ``v5e:2x4``) or a spec file; one line otherwise."""
    if name.split(":")[0] in TPU_HBM:
        return "tpu"
    if name in GPUS or name in GPUS.values() or Path(name).suffix in SPEC_SUFFIXES:
        return "gpu"
    raise ConfigError(f"unknown compile target {name!r}: one of {', '.join(GPUS)}, a device name XLA embeds "
                      f"(e.g. {GPUS['h100']!r}), a GpuTargetConfigProto file (.txtpb), or a TPU topology "
                      f"of {', '.join(TPU_HBM)} (e.g. v5e:2x4, v5p:2x2x2)")


def available(platform: str) -> str | None:
    """Why compiling for ``platform`` cannot work here (its compiler is not installed), None where it can."""
    module = {"gpu": "jax_plugins.xla_cuda12", "tpu": "libtpu"}[platform]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if found:
        return None
    return (f"compiling for {platform.upper()} needs its compiler: pip install 'jaxscale[{EXTRAS[platform]}]' "
            "(Python 3.12, jax 0.12)")


def prepare(platform: str) -> None:
    """The environment a compile-only target needs, before jax starts: the CPU as jax's backend (the
    plugins then register without looking for their hardware). One line when the compiler is missing."""
    if (why := available(platform)) is not None:
        raise ConfigError(why)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if platform == "tpu":  # compile-only: no chip to guard, so other compiling processes may load libtpu too
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def embedded_spec(device_name: str) -> str:
    """The target config XLA embeds in the CUDA plugin for ``device_name``: the NUL-delimited text block
    holding ``device_description_str: "<device_name>"``."""
    import jax_plugins.xla_cuda12 as plugin

    library = Path(plugin.__file__).parent / "xla_cuda_plugin.so"
    data = library.read_bytes()
    at = data.find(f'device_description_str: "{device_name}"\n'.encode())
    if at < 0:
        names = sorted({m.decode() for m in re.findall(rb'device_description_str: "([^"\n]+)"\n', data)})
        raise ConfigError(f"the installed CUDA plugin embeds no target spec for {device_name!r}: it has "
                          f"{', '.join(names)}; or give a GpuTargetConfigProto file (--target-spec)")
    start, end = data.rfind(b"\x00", 0, at) + 1, data.find(b"\x00", at)
    return data[start:end].decode()


def _spec_memory(spec: str) -> int:
    found = re.search(r"device_memory_size:\s*(\d+)", spec)
    if found is None:
        raise ConfigError("the GPU target spec states no device_memory_size")
    return int(found.group(1))


def _gpu(name: str, devices: int, hosts: int, spec_file: str | None) -> Target:
    from jax.experimental import topologies

    if spec_file is not None or Path(name).suffix in SPEC_SUFFIXES:
        path = Path(spec_file or name)
        if not path.is_file():
            raise ConfigError(f"target spec {path}: no such file")
        spec = path.read_text()
    else:
        spec = embedded_spec(GPUS.get(name, name))
    if devices % hosts:
        raise ConfigError(f"--devices {devices} do not divide over --hosts {hosts}")
    topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=spec,
                                        topology=f"1x{hosts}x{devices // hosts}")
    kind = topo.devices[0].device_kind
    return Target(name, "gpu", kind, tuple(topo.devices), _spec_memory(spec))


def _tpu(name: str) -> Target:
    from jax.experimental import topologies

    generation = name.split(":")[0]
    if ":" not in name:
        raise ConfigError(f"a TPU target names its topology: {generation}:2x4, {generation}:4x4, ...")
    topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
    return Target(name, "tpu", topo.devices[0].device_kind, tuple(topo.devices), TPU_HBM[generation])


def compile_only(name: str, devices: int = 8, hosts: int = 1, spec_file: str | None = None) -> Target:
    """Compile-only devices of a target: ``h100`` (and the other names of :data:`GPUS`), an embedded
    device name, or a spec file, as ``devices`` GPUs over ``hosts`` hosts; or a TPU topology (``v5e:2x4``,
    ``v5p:4x4x4``), whose name fixes its chips. Call :func:`prepare` before jax starts."""
    platform = platform_of(spec_file or name)
    if (why := available(platform)) is not None:
        raise ConfigError(why)
    if devices < 1 or hosts < 1:
        raise ConfigError(f"--devices and --hosts must be at least 1, got {devices} and {hosts}")
    return _gpu(name, devices, hosts, spec_file) if platform == "gpu" else _tpu(name)


def tpu_topology(generation: str, chips: int) -> str:
    """The topology of ``chips`` chips of a TPU generation (one slice), its sides as equal as powers of two
    allow, ascending, unit sides last: ``v5e:2x4`` for 8, ``v5e:4x4`` for 16, ``v5p:4x4x4`` for 64."""
    if generation not in TPU_DIMS:
        raise ConfigError(f"unknown TPU generation {generation!r}: one of {', '.join(TPU_DIMS)}")
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(f"a {generation} slice has a power of two of chips, not {chips}")
    sides = [1] * TPU_DIMS[generation]
    for doubling in range(chips.bit_length() - 1):
        sides[doubling % len(sides)] *= 2
    ordered = sorted(s for s in sides if s > 1) + [1] * sides.count(1)
    return f"{generation}:{'x'.join(map(str, ordered))}"


def checked_target(cluster: str, value: Any) -> str:
    """A cluster file's ``compile_target``: a GPU of :data:`GPUS` or a TPU generation (its topology follows from
    the cluster's devices: :func:`for_cluster`)."""
    if isinstance(value, str) and (value in GPUS or value in TPU_DIMS):
        return value
    raise ConfigError(f"cluster {cluster}: 'compile_target' must be one of {', '.join([*GPUS, *TPU_DIMS])}, "
                      f"got {value!r}")


def for_cluster(compile_target: str, devices: int, nodes: int) -> tuple[str, int, int]:
    """A cluster file's ``compile_target`` for its devices, as :func:`compile_only` takes it (name, devices,
    hosts): a GPU over the cluster's nodes as hosts, a TPU generation as the topology of its chips."""
    if compile_target not in TPU_DIMS:
        return compile_target, devices, nodes
    if nodes > 1:
        raise ConfigError(f"compile target {compile_target}: one slice only; the cluster has {nodes}")
    return tpu_topology(compile_target, devices), devices, 1
