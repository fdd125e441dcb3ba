"""The parameter initialisers: every parameter is created with the logical names of its dimensions.

The names (``out_sharding`` metadata, :mod:`jaxscale.config.axes`) are what the
rules table lays out; the model never names a device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.layout.rules import Axes


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, std: float, dtype) -> nnx.Param:
    """A parameter drawn from a normal of deviation ``std`` truncated at two deviations, named ``axes``."""
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes)


def ones(shape: tuple[int, ...], axes: Axes, dtype) -> nnx.Param:
    """A parameter of ones (a norm's scale), named ``axes``."""
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=axes)
