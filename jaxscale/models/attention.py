"""The attention kernel, chosen by ``model.attention``.

* ``dot``: ``jax.nn.dot_product_attention`` (XLA); the whole ``s x s`` scores.
  With the sequence sharded (a ``cp`` rules preset) the partitioner all-gathers
  keys and values.
* ``blockwise``: flash-style attention on each device's whole sequence, one
  ``model.attention_block`` tile of scores at a time, fully masked tiles
  skipped (the ring kernel with a ring of one).
* ``ring``: context parallelism, :mod:`jaxscale.parallel.ring_attention`:
  the sequence's mesh axes (the rules' ``length``) form a ring that passes
  key/value blocks; the data path orders each sequence in zig-zag chunks
  (:func:`sequence_order`). With ``length`` unsharded it is ``blockwise``.
* ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, GPU only.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from jaxscale.config import ConfigError, ModelConfig
from jaxscale.parallel import ring_attention
from jaxscale.sharding import Axes, Rules, active


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_axes: Axes, kv_axes: Axes, config: ModelConfig) -> jax.Array:
    """Causal attention of q [batch, length, heads, head_dim] over k, v [batch, length, kv_heads, head_dim]."""
    kind = config.attention
    if kind in ("blockwise", "ring"):
        return ring_attention.attention(
            q, k, v, q_axes, kv_axes, causal=True, block=config.attention_block, ring=kind == "ring"
        )
    if kind == "cudnn":
        current = active()
        platform = current[0].devices.flat[0].platform if current else jax.devices()[0].platform
        if platform != "gpu":
            raise ConfigError(f"model.attention: 'cudnn' needs GPU devices, these are {platform}")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def ring_size(config: ModelConfig, mesh: Mesh, rules: Rules, length: str = "length") -> int:
    """Devices in the attention ring: the mesh axes of ``length`` under ``model.attention: ring``, else 1."""
    if config.attention != "ring":
        return 1
    return math.prod(mesh.shape[a] for a in rules.table().get(length, ()))


def sequence_order(config: ModelConfig, seq_len: int, mesh: Mesh, rules: Rules) -> np.ndarray | None:
    """The order the data path must give each sequence's tokens, targets and positions (None: as they come)."""
    cp = ring_size(config, mesh, rules)
    return ring_attention.sequence_order(seq_len, cp) if cp > 1 else None
