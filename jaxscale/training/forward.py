"""The public forward: a trained state's (or parameters') logits under the trainer's layout.

:meth:`jaxscale.training.trainer.Trainer.logits` calls :func:`logits`: any model of the contract (the built-in Llama,
Mixtral and DeepSeek-V3 ones or a user's), any layout. The model is merged from the parameters, the fp8
amax histories (``TrainState.fp8``: the scales an fp8 step uses) and the MoE routing biases
(``TrainState.balance``: they choose the experts), and called as ``model(tokens, positions)``, traced in the
trainer's scope (the rules shard its activations as in a train step), jitted once per trainer.

**Pipeline layouts** run the plain forward, not the pipeline's loop: the layer stack, kept in the
pipeline's storage (padded slots, each stage's chunks together: :mod:`jaxscale.config.stage_layers`), is read in
the canonical order, and the partitioner all-gathers it over ``stage`` before the layer scan (measured on
``pp``, stage 2 x data 4: one all-gather per stacked weight, ahead of the loop): every device then holds
all the layers of its shard of the other axes, for the forward only. A model that fits only split over
stages cannot be looked at this way.
**Ring attention** (a ``length`` split over ``context``): the tokens are put in the ring's zig-zag order
(:func:`jaxscale.models.attention.sequence_order`) and the logits back in the tokens' order.

The logits are float32 ``[batch, length, vocab]`` (computed in ``model.dtype``, then cast), laid out by
the rules' ``batch`` and ``length`` (and ``vocab`` where the rules split it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.config.read import ConfigError
from jaxscale.layout import offload
from jaxscale.layout.sharding import check_divisible
from jaxscale.models.attention import sequence_order

BATCH_AXES = ("batch", "length")


def unpack(trainer: Any, state_or_params: Any) -> tuple[Any, Any, Any]:
    """Parameters, fp8 state and routing biases of a ``TrainState`` (its ``params``: the compute copy, as
    evaluation reads them), or of bare parameters (a fresh start's fp8 state and biases)."""
    if hasattr(state_or_params, "params") and hasattr(state_or_params, "balance"):
        return state_or_params.params, state_or_params.fp8, state_or_params.balance
    if not isinstance(state_or_params, dict):
        raise ConfigError(
            f"Trainer.logits: expected a TrainState or the parameters (a dict), got {type(state_or_params).__name__}"
        )
    return state_or_params, trainer.fresh_fp8(), trainer.fresh_balance()


def merged(trainer: Any, params: Any, fp8_state: Any, bias: Any) -> nnx.Module:
    """The trainer's model holding ``params``, ``fp8_state`` and the routing biases ``bias``, its layer stack in
    the model's own order (read from the pipeline's storage)."""
    canonical = trainer.storage.canonical_params
    if trainer.config.precision.offload_params:  # the stack's layers stay in host memory for the layer scan
        params = offload.fetch_outside(params, trainer.axes)
    return nnx.merge(trainer.graphdef, canonical(params), canonical(fp8_state), canonical(bias))


def model_logits(trainer: Any, params: Any, tokens: jax.Array, positions: jax.Array, fp8_state: Any,
                 bias: Any) -> jax.Array:
    """The model's float32 logits of ``tokens`` at ``positions``; traced in the trainer's scope (its ``_jit``)."""
    model = merged(trainer, params, fp8_state, bias)
    out = model(tokens, positions)
    if out.shape[:2] != tokens.shape or out.ndim != 3:
        raise ConfigError(
            f"model {type(model).__name__} returned {out.shape} for tokens {tokens.shape}: the contract is logits "
            "[batch, length, vocab] (docs/models.md)"
        )
    return out.astype(jnp.float32)


def _positions(tokens: np.ndarray | jax.Array, positions: Any) -> np.ndarray | jax.Array:
    """``positions`` checked against the tokens' shape, or 0, 1, ... along each row."""
    if positions is None:
        return np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    if tuple(np.shape(positions)) != tuple(tokens.shape):
        raise ConfigError(f"Trainer.logits: positions {tuple(np.shape(positions))} do not match tokens {tokens.shape}")
    return positions


def logits(trainer: Any, state_or_params: Any, tokens: Any, positions: Any = None) -> jax.Array:
    """float32 logits ``[batch, length, vocab]`` of ``tokens`` ``[batch, length]`` (int) at ``positions``
    (default: 0, 1, ... in each row), under the trainer's layout (the module docstring)."""
    if np.ndim(tokens) != 2:
        raise ConfigError(f"Trainer.logits: tokens must be [batch, length], got shape {tuple(np.shape(tokens))}")
    shape = tuple(np.shape(tokens))
    check_divisible("Trainer.logits tokens", shape, BATCH_AXES, trainer.rules.spec(BATCH_AXES), trainer.mesh)
    positions = _positions(tokens, positions)
    params, fp8_state, bias = unpack(trainer, state_or_params)
    order = sequence_order(trainer.config.model, shape[1], trainer.mesh, trainer.rules)
    tokens, positions = jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
    if order is not None:  # the ring's zig-zag chunks
        tokens, positions = tokens[:, order], positions[:, order]
    tokens, positions = (jax.device_put(x, trainer.batch_sharding) for x in (tokens, positions))
    out = trainer.jit_logits(params, tokens, positions, fp8_state, bias)
    return out if order is None else out[:, np.argsort(order)]
