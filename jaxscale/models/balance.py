"""Expert balance without an auxiliary loss: a per-expert routing bias kept and updated outside the gradient.

With ``model.moe.balance`` on, every MoE layer holds a :class:`RouterBias`
``[experts]`` (stacked with the blocks: ``[moe layers, experts]``). It is added
to the router's scores for the choice of the top k only; the gates stay the
unbiased scores (:func:`jaxscale.ops.routing.route`). The bias is not a
parameter: the trainer splits it from them into ``TrainState.balance``
(replicated, checkpointed with the state, never seen by the optimizer or the
gradients) and sets its new value after each optimizer update with
:func:`updated`, from the step's whole-batch routing statistics:

* ``sign`` (DeepSeek-V3's auxiliary-loss-free balancing): each expert's bias
  moves ``bias_rate`` towards equal load, ``b_e += rate · sign(mean load − load_e)``,
  the loads being the choices routed to each expert (before any capacity drop).
* ``quantile`` (quantile balancing, as Megatron-LM and torchtitan implement it
  after the Kimi and "MoE Odyssey" write-ups): token ``t`` chooses expert ``e``
  when ``b_e`` exceeds ``cutoff_t − s_te``, ``cutoff_t`` being the token's
  ``(k+1)``-th biased score. The bias that gives every expert the balanced
  share ``k / experts`` of the tokens on this step's scores is, per expert, the
  ``k / experts`` quantile of ``cutoff_t − s_te`` over the tokens
  (:func:`jaxscale.ops.routing.quantile_bias`); it is centred
  (a shift of every bias changes no choice) and mixed with the previous bias,
  ``b = ema · b + (1 − ema) · target``.

Both compose with the auxiliary and z losses (``aux_loss_weight``,
``z_loss_weight``), which may then be small or zero. With gradient
accumulation the statistics are the microbatches' means.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.config.read import MoEConfig


class RouterBias(nnx.Variable):
    """A per-expert bias on the routing scores for top-k selection: balancing state, not a parameter."""


def router_bias(moe: MoEConfig) -> RouterBias | None:
    """A zero bias for one MoE layer, or None where ``model.moe.balance`` is off."""
    if moe.balance == "off":
        return None
    return RouterBias(jnp.zeros((moe.experts,), jnp.float32), out_sharding=(None,))


def updated(bias: Any, layers: dict[str, jax.Array], moe: MoEConfig) -> Any:
    """The biases after one step: ``bias`` (``TrainState.balance``) moved by the step's per-layer statistics
    ``layers`` (``moe_load``, ``moe_bias_target``: [moe layers, experts]).

    Each leaf of ``bias`` is a stack [n, experts] of n layers' biases, or one layer's [experts]; the rows of
    ``layers`` are those leaves' layers one after the other, in the leaves' order (a model's stacked blocks,
    then, say, DeepSeek's multi-token prediction blocks: :func:`jaxscale.ops.loss.model_objective`)."""
    leaves, tree = jax.tree.flatten(bias)
    starts = np.cumsum([0] + [b.shape[0] if b.ndim > 1 else 1 for b in leaves])

    def step(b: jax.Array, start: int) -> jax.Array:
        def rows(key: str) -> jax.Array:
            return layers[key][start : start + (b.shape[0] if b.ndim > 1 else 1)].reshape(b.shape)

        if moe.balance == "sign":
            load = rows("moe_load")
            return b + moe.bias_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        return moe.bias_ema * b + (1 - moe.bias_ema) * rows("moe_bias_target")

    return tree.unflatten([step(b, int(start)) for b, start in zip(leaves, starts[:-1], strict=True)])
