"""Building blocks for research models: the public, stable names (docs/models.md).

A model written with these gets what the built-in models get from the rules table: its attention
runs the kernel ``model.attention`` names (``dot``, ``blockwise``, ``cudnn``, or ``ring``: context
parallelism when the rules split ``length``), its activations are laid out by logical name
(:func:`constrain`), its weight matmuls follow the precision policy (:func:`einsum`).

* :func:`attention`: causal attention, the kernel chosen by the config and the active rules;
  :func:`document_ids`: packed documents' ids from positions that restart at each document (natural order).
* :func:`rope`: rotary position embeddings (rotate-half layout; Llama 3.1's scaling optional).
* :class:`RMSNorm`, :func:`rms_norm`, :func:`swiglu`: with the lean backward of :mod:`jaxscale.ops.lean`.
* :class:`MoE`: the mixture-of-experts layer, expert parallelism by the rules' ``expert``;
  :func:`moe_metrics`: a stack of MoE layers' metrics as the trainer reads them (losses averaged, the loads
  per layer for the metrics and the routing bias); :func:`moe_objective`: their weighted auxiliary losses.
* :func:`constrain`: an activation's layout by the logical names of its dimensions.
* :func:`einsum`, :func:`weight_grads`: a weight matmul whose weight gradient is in the policy's dtype.
* :func:`remat_policy`: the ``model.remat`` policy for ``nnx.remat`` (``save_named`` reads ``checkpoint_name``s).
* :func:`cross_entropy`, :func:`chunked_cross_entropy`: the losses.
* The activation axis names: :data:`RESIDUAL`, :data:`HIDDEN`, :data:`Q_AXES`, :data:`KV_AXES`,
  :data:`MLP_AXES`, :data:`LOGITS`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.config.axes import HIDDEN, KV_AXES, LOGITS, MLP_AXES, Q_AXES, RESIDUAL
from jaxscale.config.read import Config, ModelConfig
from jaxscale.layout.rules import Axes
from jaxscale.layout.sharding import constrain
from jaxscale.models import attention as _attention
from jaxscale.models.attention import document_ids
from jaxscale.models.llama import remat_policy, rope
from jaxscale.models.moe import MoE
from jaxscale.models.moe import aux_objective as _aux_objective
from jaxscale.models.moe import over_layers as moe_metrics
from jaxscale.ops.lean import rms_norm, swiglu
from jaxscale.ops.loss import chunked_cross_entropy, cross_entropy
from jaxscale.parallel.logit_max import QK_LOGITS
from jaxscale.precision.policy import einsum, weight_grads

__all__ = [
    "HIDDEN", "KV_AXES", "LOGITS", "MLP_AXES", "QK_LOGITS", "Q_AXES", "RESIDUAL", "MoE", "RMSNorm", "attention",
    "chunked_cross_entropy", "constrain", "cross_entropy", "document_ids", "einsum", "moe_metrics", "moe_objective",
    "remat_policy", "rms_norm", "rope", "swiglu", "weight_grads",
]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    config: Config | ModelConfig,
    *,
    q_axes: Axes = Q_AXES,
    kv_axes: Axes = KV_AXES,
    documents: jax.Array | None = None,
    head_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of q [batch, length, heads, head_dim] over k, v [batch, length, kv_heads, head_dim];
    with ``documents``, the ``positions`` [batch, length] of packed documents (``data.documents``: restarting
    at 0 at each, in the order the trainer feeds them), a token attends only within its document.

    The kernel is ``config.model.attention`` as the trainer resolved it for its devices and rules
    (``auto`` becomes ``ring`` where the rules split ``length``: the trainer then feeds each sequence
    in ring attention's zig-zag order, and ``positions`` follow it). ``heads`` of the two may differ:
    grouped-query attention. ``head_max``: also each query head's largest pre-softmax logit over the batch
    [heads] (fp32, no gradient): a model's ``QK_LOGITS`` metric, stacked [layers, heads], is what
    ``train.qk_clip`` reads (the built-in models').
    """
    model = config.model if isinstance(config, Config) else config
    kernel = _attention.attention_with_max if head_max else _attention.attention
    return kernel(q, k, v, documents, q_axes, kv_axes, model)


def moe_objective(metrics: dict[str, jax.Array], config: Config | ModelConfig) -> jax.Array:
    """``model.moe``'s weighted load-balance and z losses of :func:`moe_metrics`' means."""
    return _aux_objective(metrics, config.model if isinstance(config, Config) else config)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last axis, statistics in fp32, the result in ``dtype``; the scale's
    logical name ``axis``. Keeps for the backward the input and one fp32 statistic per row."""

    def __init__(
        self, features: int, *, eps: float = 1e-5, dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32, axis: str | None = "embed",
    ):
        self.eps, self.dtype = eps, jnp.dtype(dtype)
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), out_sharding=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x.astype(self.dtype), self.scale[...], self.eps)
