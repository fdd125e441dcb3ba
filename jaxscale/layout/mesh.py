"""The device mesh: axes ``data, stage, fsdp, context, ulysses, expert, tensor``.

Axes run from the outermost (slowest link: across hosts or slices) to the
innermost (fastest link: within a node), so tensor parallelism, which talks
every layer, lands on neighbouring devices. Sizes of 1 are kept, so a rules
table may name any axis whatever the experiment's parallelism. With a ``dcn``
section the mesh is hybrid: each axis is ``ici size x dcn size`` with the dcn
factor across slices/hosts (``mesh_utils.create_hybrid_device_mesh``).

Axes are ``AxisType.Auto`` by default (``mesh.axis_types: auto``): the model
states shardings through the rules table and XLA's partitioner propagates the
rest (GSPMD style), which is what lets a layout change without a code change.
With ``mesh.axis_types: explicit`` every axis is ``AxisType.Explicit``: an
array's sharding is part of its type, jax's sharding rules give each operation's
output layout, and a model states the layouts they cannot decide
(``out_sharding=``, ``jax.sharding.reshard``); :func:`lay_out` is the one way
jaxscale's own code pins a layout in either mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxscale.config.mesh_size import mesh_shape
from jaxscale.config.read import MESH_AXES, MeshConfig


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the mesh the config asks for over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(config, len(devices))
    kind = AxisType.Explicit if config.axis_types == "explicit" else AxisType.Auto
    axis_types = (kind,) * len(MESH_AXES)
    if config.dcn is not None:
        dcn = [getattr(config.dcn, a) for a in MESH_AXES]
        ici = [shape[a] // d for a, d in zip(MESH_AXES, dcn, strict=True)]
        return Mesh(_hybrid_grid(ici, dcn, devices), MESH_AXES, axis_types=axis_types)
    sizes = tuple(shape[a] for a in MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES, axis_types=axis_types)


def _hybrid_grid(ici: list[int], dcn: list[int], devices: list[jax.Device]) -> np.ndarray:
    """Devices laid out so each axis is (dcn x ici), the dcn factor outermost.

    Granules (the groups joined by the slow network) are TPU slices where devices
    have a ``slice_index``, else processes; a single process simulating several
    hosts splits its devices into equal consecutive granules.
    """
    if all(hasattr(d, "slice_index") for d in devices):
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    if jax.process_count() > 1:
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    n = len(ici)
    grid = np.array(devices).reshape(*dcn, *ici)
    interleaved = [axis for i in range(n) for axis in (i, n + i)]
    return grid.transpose(interleaved).reshape([d * i for d, i in zip(dcn, ici, strict=True)])

