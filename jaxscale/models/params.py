"""The parameter initialisers: every parameter is created with the logical names of its dimensions.

The names (``out_sharding`` metadata, :mod:`jaxscale.models.axes`) are what the
rules table lays out; the model never names a device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.layout import Axes


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, std: float, dtype) -> nnx.Param:
    """A parameter drawn from a normal of deviation ``std`` truncated at two deviations, named ``axes``."""
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes)


def ones(shape: tuple[int, ...], axes: Axes, dtype) -> nnx.Param:
    """A parameter of ones (a norm's scale), named ``axes``."""
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=axes)


def logical_axes(state: nnx.State) -> dict[str, Any]:
    """The logical names of every variable of ``state``, as a pure dict shaped like the state's values."""
    names = jax.tree.map(
        lambda v: v.get_metadata()["out_sharding"], state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.to_pure_dict(names)
