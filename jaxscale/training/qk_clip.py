"""QK-clip (``train.qk_clip: tau``; Kimi K2's MuonClip, here with either optimizer): after each update, every
attention head whose largest pre-softmax logit of the step ``S`` (over the whole batch, every microbatch) exceeds
``tau`` has its query and key weights scaled so that the same inputs would give ``tau`` at most: its logits
times ``gamma = tau / S`` (1 for the other heads), per head and layer (the model's ``qk_logits`` metric
[layers, heads], from every attention kernel: :mod:`jaxscale.parallel.logit_max`).

- **Grouped-query attention** (``kv_heads < heads``): a key head is shared by several query heads, so the
  whole ``gamma`` goes to the query head's weights and the keys are left (every head's logits scaled by its own
  ``gamma`` exactly, heads under ``tau`` untouched); **one key per head** (``kv_heads == heads``): the query and
  the key weights are each scaled by ``sqrt(gamma)``, as Kimi K2.
- **Multi-head latent attention** (DeepSeek): as Kimi K2 does, the heads' own parts only: the query's and
  key's non-rotary columns (``wq_b`` or ``wq``, ``wkv_b``'s key columns) by ``sqrt(gamma)``, the query's rotary
  columns by ``gamma``; the rotary key, shared by every head (``wkv_a``'s last columns), is left. The MTP
  depths' attention is not clipped.

The scaling is applied to the weights the optimizer updates (the master where there is one; the compute copy
is its cast), where the optimizer state lives, once per step. RoPE is linear and the query and key come
straight from their projections (no norm between: ``model.qk_norm`` is refused), so the scores scale by exactly
``gamma``. Reported per layer as ``max_logit`` [layers] (the largest over the heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.config.read import ModelConfig
from jaxscale.layout import collectives, sharding
from jaxscale.parallel.logit_max import QK_LOGITS


def factors(logits: jax.Array, tau: float) -> jax.Array:
    """``tau / S`` where the largest logit ``S`` exceeds ``tau``, else 1, per layer and head of ``S`` [layers,
    heads] (a head whose logits are all negative is left, not flipped)."""
    logits = logits.astype(jnp.float32)
    return jnp.where(logits > tau, tau / logits, 1.0)


def _scaled(w: jax.Array, gamma: jax.Array, columns: slice = slice(None)) -> jax.Array:
    """``w [layers, in, heads, d]`` with its ``columns`` of head ``h`` in layer ``l`` times ``gamma[l, h]``."""
    chosen = jnp.zeros(w.shape[-1], bool).at[columns].set(True)
    f = jnp.where(chosen, gamma[:, None, :, None], 1.0)  # [layers, 1, heads, d]
    return (w.astype(jnp.float32) * f).astype(w.dtype)


def _gqa(attn: dict, gamma: jax.Array) -> dict:
    """A Llama attention's weights (``wq`` [layers, embed, heads, d], ``wk`` [.., kv_heads, d]) clipped."""
    if attn["wk"].shape[-2] < attn["wq"].shape[-2]:  # shared keys: the whole factor on the query heads
        return {**attn, "wq": _scaled(attn["wq"], gamma)}
    root = jnp.sqrt(gamma)
    return {**attn, "wq": _scaled(attn["wq"], root), "wk": _scaled(attn["wk"], root)}


def _mla(nope: int) -> Callable[[dict, jax.Array], dict]:
    """A DeepSeek MLA's weights clipped (the module docstring), ``nope`` the non-rotary query/key columns."""

    def clip(attn: dict, gamma: jax.Array) -> dict:
        root, query = jnp.sqrt(gamma), "wq_b" if "wq_b" in attn else "wq"
        wq = _scaled(_scaled(attn[query], root, slice(None, nope)), gamma, slice(nope, None))
        return {**attn, query: wq, "wkv_b": _scaled(attn["wkv_b"], root, slice(None, nope))}

    return clip


def _stack(blocks: dict, gamma: jax.Array, clip: Callable[[dict, jax.Array], dict]) -> dict:
    """A stack of blocks (``attn`` in each, or a group's ``blocks`` 0..n-1 each with its own) clipped by
    ``gamma`` [layers of the stack, heads] in the model's layer order (a group's blocks consecutive)."""
    if "attn" in blocks:
        return {**blocks, "attn": clip(blocks["attn"], gamma)}
    inner = blocks["blocks"]
    per = gamma.reshape(-1, len(inner), gamma.shape[-1])
    return {**blocks, "blocks": {i: {**b, "attn": clip(b["attn"], per[:, n])} for n, (i, b) in
                                 enumerate(sorted(inner.items()))}}


def clip(weights: dict, logits: jax.Array, tau: float, model: ModelConfig) -> dict:
    """The built-in models' weights (the parameters' tree) after QK-clip at ``tau`` with the step's largest
    logits [layers, heads] (the module docstring)."""
    gamma = factors(logits, tau)
    if sharding.active() is not None:  # the factors whole on every device: they scale every layout's weights
        gamma = collectives.lay_out(gamma, NamedSharding(sharding.active()[0], PartitionSpec()))
    if model.deepseek is None:
        return {**weights, "blocks": _stack(weights["blocks"], gamma, _gqa)}
    per_block = _mla(model.deepseek.qk_nope_head_dim)
    out, first = dict(weights), 0
    for name in ("dense", "blocks"):  # the dense stack's layers first, then the MoE stack's (the model's order)
        if weights.get(name):
            n = jax.tree.leaves(weights[name])[0].shape[0]
            out[name] = _stack(weights[name], gamma[first:first + n], per_block)
            first += n
    return out


def layer_max(logits: jax.Array) -> jax.Array:
    """The ``max_logit`` metric: each layer's largest logit over its heads [layers]."""
    return logits.max(axis=-1)


def _has(metrics: Any) -> bool:
    return isinstance(metrics, dict) and QK_LOGITS in metrics


def start(shapes: Any) -> Any:
    """The microbatches' metrics' accumulator from their shapes: zeros, the largest logits at -inf."""
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return {**zeros, QK_LOGITS: jnp.full_like(zeros[QK_LOGITS], -jnp.inf)} if _has(zeros) else zeros


def accumulate(total: Any, aux: Any) -> Any:
    """Microbatches' metrics summed, but the largest logits kept (their maximum)."""
    out = jax.tree.map(jnp.add, total, aux)
    return {**out, QK_LOGITS: jnp.maximum(total[QK_LOGITS], aux[QK_LOGITS])} if _has(out) else out


def mean(total: Any, m: int) -> Any:
    """:func:`accumulate`'s sums over ``m`` microbatches as means (the largest logits as they are)."""
    out = jax.tree.map(lambda a: a / m, total)
    return {**out, QK_LOGITS: total[QK_LOGITS]} if _has(out) else out
