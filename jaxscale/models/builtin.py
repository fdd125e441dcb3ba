"""The built-in models' factory: the default ``model=`` of :meth:`jaxscale.train.Trainer.build`."""

from __future__ import annotations

from flax import nnx

from jaxscale.config import Config
from jaxscale.models.llama import Llama


def build(config: Config, rngs: nnx.Rngs) -> nnx.Module:
    """The Llama-style decoder of ``config.model`` (with ``model.moe``, Mixtral-style)."""
    return Llama(config, rngs)
