"""QK-clip's statistic (``train.qk_clip``): each query head's largest pre-softmax logit ``max q·k / sqrt(d)``
over a batch, among the pairs its mask lets attend.

The tiled kernels (``blockwise``, ``ring``: :mod:`jaxscale.parallel.ring_attention`) have it for nothing: the
online softmax's running row maxima, whose largest it is. ``dot`` (XLA's fused attention hands out no scores)
computes the scores again here (:func:`dot_head_max`): one more ``q·k`` matmul in the forward, no gradient.
Inside a ``shard_map`` each device knows its own queries' maxima: every device's ``[1, 1, heads]`` laid side by
side (:func:`head_max_spec`) and the largest taken over the devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxscale.layout.sharding import spec_axes

QK_LOGITS = "qk_logits"  # a model's metric of its layers' heads' largest logits [layers, heads]


def dot_head_max(q: jax.Array, k: jax.Array, segments: jax.Array | None) -> jax.Array:
    """The largest causal logit of each query head [heads] (fp32) of q [b, s, heads, d] over k [b, s, kv heads, d]
    (grouped: ``heads / kv_heads`` query heads per key head), with ``segments`` [b, s] (document ids) only within
    a document; scaled by ``1/sqrt(d)``."""
    b, s, heads, d = q.shape
    g = k.shape[2]
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q.reshape(b, s, g, heads // g, d), k,
                        preferred_element_type=jnp.float32) / math.sqrt(d)
    keep = jnp.tril(jnp.ones((s, s), bool))[None]
    if segments is not None:
        keep = keep & (segments[:, :, None] == segments[:, None, :])
    scores = jnp.where(keep[:, None, None], scores, -jnp.inf)
    return scores.max(axis=(0, 3, 4)).reshape(heads)


def per_device(out: jax.Array, head_max: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A device's output and its heads' largest logits as [1, 1, heads] (laid out by :func:`head_max_spec`)."""
    return out, head_max[None, None]


def head_max_spec(q_spec: PartitionSpec, heads_after: tuple[str, ...] = ()) -> PartitionSpec:
    """The layout of every device's [1, 1, heads] largest logits side by side, from the queries'
    [batch, length, heads, ...] one: [batch devices, length devices, heads], whose largest over its first two
    dimensions is the heads' largest. ``heads_after``: mesh axes that split each device's heads further inside
    (Ulysses' all-to-all: they leave the length for the heads)."""
    length = tuple(a for a in spec_axes(q_spec[1]) if a not in heads_after)
    heads = (*spec_axes(q_spec[2]), *heads_after)
    return PartitionSpec(q_spec[0], length or None, heads or None)
