"""The mesh: axis order, -1, and the hybrid ICI x DCN layout."""

import jax
import numpy as np
from helpers import tiny_config

from jaxscale.config.read import MESH_AXES
from jaxscale.layout.mesh import make_mesh


def test_axes_in_order_and_minus_one_fills_the_rest():
    mesh = make_mesh(tiny_config(mesh={"data": -1, "tensor": 2}).mesh)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_hybrid_mesh_keeps_each_granule_on_the_fast_axes():
    config = tiny_config("mesh.dcn.fsdp=2", mesh={"fsdp": 2, "tensor": 2})
    mesh = make_mesh(config.mesh)
    assert mesh.shape["fsdp"] == 4 and mesh.shape["tensor"] == 2
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    # fsdp indices 0-1 are one granule (devices 0-3), 2-3 the other (devices 4-7).
    assert set(ids[:2].ravel()) == {0, 1, 2, 3} and set(ids[2:].ravel()) == {4, 5, 6, 7}
