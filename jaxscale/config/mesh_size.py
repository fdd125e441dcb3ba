"""The mesh's sizes from the config: ``-1`` filling the devices, and how many devices a mesh asks for (no jax).
"""

from __future__ import annotations

import math

from jaxscale.config.schema import (  # the schema, importable from here
    MESH_AXES,
    ConfigError,
    DcnConfig,
    MeshConfig,
)


def _describe(sizes: dict[str, int], dcn: DcnConfig | None) -> str:
    """``fsdp=4 x tensor=2``: the axes larger than 1, and the dcn factors if any."""
    text = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
    if dcn is not None:
        text += " with dcn " + (" x ".join(f"{a}={s}" for a, s in dcn.sizes().items() if s != 1) or "all 1")
    return text


def mesh_shape(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Resolve -1 and check that the mesh covers exactly ``device_count`` devices."""
    sizes = mesh.sizes()
    dcn = mesh.dcn.sizes() if mesh.dcn else dict.fromkeys(MESH_AXES, 1)
    known = math.prod(v for v in sizes.values() if v != -1) * math.prod(dcn.values())
    for axis, size in sizes.items():
        if size == -1:
            if device_count % known:
                others = _describe({a: s for a, s in sizes.items() if s != -1}, mesh.dcn)
                raise ConfigError(
                    f"mesh.{axis}=-1: {device_count} device{'s are' if device_count != 1 else ' is'} not divisible "
                    f"by the other axes ({others}: {known} devices)"
                )
            sizes[axis] = device_count // known
    total = math.prod(sizes.values()) * math.prod(dcn.values())
    if total != device_count:
        raise ConfigError(
            f"mesh: {_describe(sizes, mesh.dcn)} needs {total} device{'s' * (total != 1)}, "
            f"but {device_count} {'is' if device_count == 1 else 'are'} available"
        )
    return {axis: sizes[axis] * dcn[axis] for axis in MESH_AXES}


def requested_devices(mesh: MeshConfig) -> int | None:
    """Devices the mesh asks for, or None when an axis is -1 (fill what exists)."""
    sizes = mesh.sizes()
    if -1 in sizes.values():
        return None
    dcn = mesh.dcn.sizes() if mesh.dcn else {}
    return math.prod(sizes.values()) * math.prod(dcn.values() or [1])
