"""Decoding the built-in Llama-style model with a key/value cache: the prompt once, then a token at a time.

The cache keeps, for every layer, the keys and values of every position so far, ``[units, layers per unit,
batch, max_len, kv_heads, head_dim]`` (a unit: a block, or a :class:`~jaxscale.models.llama.Group` of
``model.moe.every_n_layers`` blocks), in the compute dtype; slot ``p`` holds position ``p``. A step
(:func:`step`) runs ``t`` new tokens at positions ``index .. index + t - 1`` of every row: each block's
attention projects and rotates them as the full forward does (:meth:`~jaxscale.models.llama.Attention.project`),
writes their keys and values into slots ``index ..``, and attends over the cache's slots at or before each
query's position, the query heads of a group sharing their key/value head (grouped-query attention), in
float32; the rest (MLP or mixture of experts, norms, head) is the model's own code. The prefill is the
step of the whole prompt at index 0, the decode steps those of one token. (A mixture of experts with
capacity dispatch sizes its capacity by a step's own tokens: the full forward of the whole sequence may drop
tokens the decode keeps; dropless dispatch routes alike.)
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.config import stage_layers
from jaxscale.config.read import ModelConfig
from jaxscale.models.llama import Block, Group, Llama
from jaxscale.precision import fp8


class Cache(NamedTuple):
    """Keys and values of every layer and position so far: ``[units, per unit, batch, max_len, kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


def empty(c: ModelConfig, batch: int, max_len: int) -> Cache:
    """A cache of ``max_len`` positions for ``batch`` rows of model ``c``, zeros."""
    units = c.layers // stage_layers.unit(c)
    shape = (units, stage_layers.unit(c), batch, max_len, c.kv_heads, c.head_dim)
    return Cache(jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal attention of q ``[b, t, heads, d]`` at ``positions`` ``[b, t]`` over the cache's k and v
    ``[b, max_len, kv_heads, d]``: slot ``s`` seen by a query at position ``p`` when ``s <= p``."""
    b, t, heads, d = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, t, kv, heads // kv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k.astype(jnp.float32)) / math.sqrt(d)
    seen = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]  # [b, t, max_len]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
    return out.reshape(b, t, heads, d).astype(q.dtype)


def _block(
    block: Block, x: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block on the new tokens ``x``, its cache ``k``, ``v`` [b, max_len, kv_heads, d] written at ``index``."""
    q, k_new, v_new = block.attn.project(block.attn_norm(x), positions)
    k = jax.lax.dynamic_update_slice(k, k_new.astype(k.dtype), (0, index, 0, 0))
    v = jax.lax.dynamic_update_slice(v, v_new.astype(v.dtype), (0, index, 0, 0))
    x = x + block.attn.output(attend(q, k, v, positions))
    y = block.mlp(block.mlp_norm(x))
    return x + (y[0] if block.moe_layer else y), k, v


def step(
    model: Llama, tokens: jax.Array, positions: jax.Array, cache: Cache, index: jax.Array
) -> tuple[jax.Array, Cache]:
    """Logits ``[b, t, vocab]`` (the model's dtype) of the new ``tokens`` ``[b, t]`` at ``positions``
    (``index .. index + t - 1`` in every row) and the cache with their keys and values."""

    def body(
        x: jax.Array, unit: Block | Group, copies: fp8.Copies, k: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, Cache]:
        blocks = list(unit.blocks) if isinstance(unit, Group) else [unit]
        ks, vs = [], []
        with fp8.using(unit, copies) if model.fp8_plain is not None else contextlib.nullcontext():
            for i, block in enumerate(blocks):
                x, k_i, v_i = _block(block, x, positions, k[i], v[i], index)
                ks.append(k_i)
                vs.append(v_i)
        return x, Cache(jnp.stack(ks), jnp.stack(vs))

    scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0),
                    transform_metadata={nnx.PARTITION_NAME: "layers"})
    # The fp8 weights made once and precision.nvfp4.bf16_last's units plain, as the forward does.
    x, cache = fp8.scan_stack(scan, model.embed(tokens), model.blocks, model.fp8_plain, cache.k, cache.v)
    return model.logits(model.final_norm(x)), cache
