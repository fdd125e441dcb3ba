"""The built-in models' factory: the default ``model=`` of :meth:`jaxscale.training.trainer.Trainer.build`."""

from __future__ import annotations

from flax import nnx

from jaxscale.config.read import Config
from jaxscale.models.deepseek import DeepSeek
from jaxscale.models.llama import Llama


def build(config: Config, rngs: nnx.Rngs) -> nnx.Module:
    """The decoder of ``config.model``: DeepSeek-V3-style with ``model.deepseek``, else Llama-style (with
    ``model.moe``, Mixtral-style)."""
    return DeepSeek(config, rngs) if config.model.deepseek is not None else Llama(config, rngs)
