"""Ulysses and USP context parallelism: all-to-alls trade the sequence for the heads around attention.

With the rules table mapping ``length`` to context axes every module but attention sees ``s/c`` tokens
per device. The rules' ``ulysses`` entry names the trailing mesh axes of ``length`` (``u`` devices) over
which attention's inputs are exchanged instead of passed round a ring: one all-to-all per tensor turns
queries, keys and values split on the sequence (``s/c`` tokens, every local head) into ones split on the
heads (``s·u/c`` tokens, ``1/u`` of the heads), attention runs, and one all-to-all turns the output back.

* **Ulysses** (``ulysses`` = all of ``length``'s axes): each device holds whole sequences for its heads, so
  any kernel runs unchanged inside: the one ``model.attention`` names (``dot``, ``blockwise`` with packed
  documents, ``cudnn`` on GPU: the fused kernel the ring cannot use). The data stays in its natural order.
* **USP** (``ulysses`` a part of ``length``'s axes): the rest of them (``r = c/u`` devices, listed first in
  ``length``) form a ring that runs ring attention's kernel on the head-split blocks, zig-zag ordered over the
  ring (:func:`jaxscale.parallel.ring_schedule.sequence_order` with ``r``): e.g. all-to-all inside a node,
  the ring across nodes.

**What it communicates, per layer, per device**: forward, four all-to-alls (q, k, v in, the output back),
each of which keeps ``1/u`` of the tensor and sends the rest: ``(u−1)/u · b·(s/c)·(a·d_h + 2·g'·d_h + a·d_v)
·bytes`` with ``a`` the local query heads and ``g'`` the local kv heads after replication (below); backward,
the same four in reverse (their transposes). Nothing scales with the sequence's split ``c`` but the
``s/c`` itself, so per device the bytes fall as ``1/c`` while the ring's stay ``2·(c−1)/c`` of a K/V
sequence; and the all-to-alls are not overlapped with attention (they are on its critical path), where the
ring overlaps each hop with a tile of compute. Under USP the ring part moves the ring's bytes with
``r`` devices on the head-split blocks (``1/u`` of the heads). Packed documents add an all-gather of the
positions over the all-to-all axes (``int32``, ``b·s/r`` per device).

Inside a pipeline stage, whose loop is manual over the context axes already, the all-to-alls are written
there directly (:func:`manual`) and USP's ring part runs the ring's gathered form
(:func:`jaxscale.parallel.ring_attention.manual`).

**Grouped-query attention**: the local query heads must divide by ``u``; the local kv heads ``g`` are
split with them when ``u`` divides ``g``, else (``g < u``, ``u`` a multiple of ``g``) each is **replicated**
``u/g`` times before the exchange, so that every device receives the one kv head its queries use: the keys'
and values' bytes grow by ``u/g`` (gradients of the copies are summed back by autodiff). With TP the heads
are split over ``tensor`` first; the all-to-all splits each device's share further (heads over tensor x
ulysses). Multi-head latent attention has as many kv heads as queries, the values their own width.

**What it saves**: activation memory outside attention is that of ``s/c`` tokens, as with the ring; inside,
each device holds ``s·u/c`` tokens of ``1/u`` of the heads: the same q/k/v/out bytes, and the kernel's
own memory (the whole ``s x s`` scores of ``dot``; a tile at a time for ``blockwise`` and ``cudnn``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxscale.config.read import Config, ConfigError
from jaxscale.layout.rules import Layout
from jaxscale.layout.sharding import Axes, active, spec
from jaxscale.parallel import logit_max

Kernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]  # q, k, v, positions -> out


def to_heads(x: jax.Array, over: tuple[str, ...]) -> jax.Array:
    """[b, s/c, h, d] split on the sequence -> [b, s·u/c, h/u, d] split on the heads (one all-to-all)."""
    return lax.all_to_all(x, over, split_axis=2, concat_axis=1, tiled=True)


def to_sequence(x: jax.Array, over: tuple[str, ...]) -> jax.Array:
    """The inverse of :func:`to_heads`."""
    return lax.all_to_all(x, over, split_axis=1, concat_axis=2, tiled=True)


def replicated(kv: jax.Array, ways: int) -> jax.Array:
    """Keys or values [b, s, g, d] with each kv head repeated ``ways / g`` times when ``g < ways`` (so an
    all-to-all over ``ways`` devices hands each the head its queries use), else as they are."""
    g = kv.shape[2]
    return jnp.repeat(kv, ways // g, axis=2) if g < ways else kv


def _local(over: tuple[str, ...], ways: int, kernel: Kernel, q, k, v, positions, head_max: bool = False):
    """One device's part: exchange, attend on the gathered sequence for this device's heads, exchange back.
    ``head_max``: the kernel returns its heads' largest logits too, returned beside the output (for its heads
    after the exchange: the device's share of its heads over ``over``)."""
    q, k, v = (to_heads(x, over) for x in (q, replicated(k, ways), replicated(v, ways)))
    if positions is not None:
        positions = lax.all_gather(positions, over, axis=1, tiled=True)
    if head_max:
        out, most = kernel(q, k, v, positions)
        return to_sequence(out, over), most
    return to_sequence(kernel(q, k, v, positions), over)


def manual(
    q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None, over: tuple[str, ...], kernel: Kernel,
    head_max: bool = False,
) -> jax.Array:
    """:func:`attention` inside a ``shard_map`` manual over the all-to-all's axes ``over`` already (a pipeline
    stage's loop): each device's blocks are its own."""
    mesh = jax.sharding.get_abstract_mesh()
    return _local(over, math.prod(mesh.shape[a] for a in over), kernel, q, k, v, positions, head_max)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None, q_axes: Axes, kv_axes: Axes,
    kernel: Kernel,
    head_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q [batch, length, heads, head_dim] over k, v [batch, length, kv_heads, ...] under the active
    rules, whose ``ulysses`` axes carry the all-to-alls: a ``jax.shard_map`` manual over every mesh axis, in
    which ``kernel`` (called manual, on [b, s/r, heads/u, ...] blocks and the positions gathered to match) is
    the attention on what the all-to-alls leave each device: whole sequences under Ulysses, a ring's blocks
    under USP. ``head_max``: the kernel returns its heads' largest logits too, and so does this [heads]
    (:mod:`jaxscale.parallel.logit_max`)."""
    mesh, place = active()
    q_spec, kv_spec = spec(place, q_axes), spec(place, kv_axes)
    over = place.ulysses_axes
    in_specs = (q_spec, kv_spec, kv_spec, PartitionSpec(*q_spec[:2]))  # positions (or None)
    if not head_max:
        body = partial(_local, over, place.size(over), kernel)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=q_spec)(q, k, v, positions)
    body = partial(_local, over, place.size(over), kernel, head_max=True)
    fn = jax.shard_map(lambda *a: logit_max.per_device(*body(*a)), mesh=mesh, in_specs=in_specs,
                       out_specs=(q_spec, logit_max.head_max_spec(q_spec, over)))
    out, most = fn(q, k, v, positions)
    return out, most.max(axis=(0, 1))


def check(place: Layout, config: Config) -> None:
    """Raise the first error of the rules' ``ulysses`` axes under ``config`` (``model.attention`` resolved)."""
    over = place.ulysses_axes
    if not over:
        return
    where, model, length = f"rules '{place.name}'", config.model, place.mesh_axes(("length",))
    if length[len(length) - len(over):] != over:
        raise ConfigError(
            f"{where}: ulysses {list(over)} must be the last mesh axes of length {list(length)} (the ring's, "
            "if any, first: each ring position's tokens are split over the all-to-all's devices)"
        )
    if place.ring_size > 1 and model.attention != "ring":
        raise ConfigError(
            f"{where}: USP (all-to-all over {list(over)}, a ring over {list(place.ring_axes)}) needs "
            f"model.attention=ring, got {model.attention}"
        )
    u = place.size(over)
    heads = model.heads // place.ways(("heads",))
    kv_heads = (heads if model.deepseek is not None else model.kv_heads // place.ways(("kv_heads",)))
    if heads % u or (kv_heads % u and u % kv_heads):
        raise ConfigError(
            f"{where}: Ulysses over {list(over)} ({u} devices) splits each device's heads: its {heads} query "
            f"heads must divide by {u}, and its {kv_heads} kv heads divide by {u} or divide it (replicated)"
        )
