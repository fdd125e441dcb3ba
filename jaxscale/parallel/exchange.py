"""Dropless expert parallelism that moves only the routed rows: counts first, then the rows, then back.

Inside expert parallelism's ``shard_map`` (:func:`jaxscale.parallel.expert.experts`),
each device holds ``b`` sequences' tokens and ``E / ep`` experts. With
``dispatch: dropless`` and ``dropless_exchange: rows`` a device

1. sorts its ``n = b·s·k`` choices by expert (so by destination shard, then by
   the expert there), and counts them per destination and expert;
2. **exchanges the counts** (an all-to-all of ``ep · E/ep`` integers): each
   device learns how many rows each source sends it, for each of its experts;
3. **moves exactly the routed rows** to the shards holding their experts, in
   chunks of ``R`` rows per destination: chunk ``i`` of every destination's
   rows goes in one all-to-all of ``[ep, R, h]``, and the loop runs
   ``ceil(m / R)`` times, ``m`` being the largest count any device sends any
   destination (a ``pmax`` of the counts: every device runs the same trips);
4. runs the arriving rows through its experts with grouped matmuls
   (``lax.ragged_dot``), grouped by the exchanged counts;
5. sends the outputs back by the mirror exchange (the same all-to-all, as the
   exchange is its own transpose, which is also its backward: a ``custom_vjp``)
   and sums each token's choices weighted by its gates.

Wire bytes per exchange per device: ``ceil(m/R)·R·h·bytes·(ep−1)``; with ``R``
at most ``1/32`` of the mean count ``n/ep`` (:func:`chunk_rows`) that is, to
within ``1/32`` of the mean, ``k·b·s·h·bytes·(ep−1)/ep`` times the routing
imbalance ``m / (n/ep)``: the forward's two exchanges are docs/formulas.md's
``2·k·b·s·h·bytes·(ep−1)/ep`` times the imbalance, and so is the backward.

On GPU and TPU (:data:`RAGGED_PLATFORMS`) each exchange is one
``lax.ragged_all_to_all`` instead (:func:`ragged_rows`): every (destination,
expert) slice of the sorted rows lands on its shard at the place the receiver
computed from the exchanged counts (an all-to-all of those offsets back), so
the rows arrive grouped by expert, then by source; exactly the routed rows
move, ``k·b·s·h·bytes·(ep−1)/ep`` times the imbalance, with no rounding to
chunks. Its backward is jax's transpose of the collective (the mirror
exchange). XLA:CPU cannot compile it ("HLO opcode ragged-all-to-all is not
supported"), so on CPU the chunked all-to-all runs, at the cost of up to
``32 · imbalance`` collectives per exchange. Both size their receive buffers
for the worst case (every choice to one shard): ``ep · n`` rows of ``h``,
``k`` times the all-gather path's ``[ep·b, s, h]``. The ragged exchange's
bytes depend on the routing at run time: the compiled HLO cannot count them
(:mod:`jaxscale.analysis.hlo` sees the chunked path's loop only).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxscale.ops import routing as kernels
from jaxscale.precision import fp8

CHUNKS_PER_MEAN = 32  # a chunk is at most 1/32 of a destination's mean rows: the rounding's bound
RAGGED_PLATFORMS = ("gpu", "tpu")  # where XLA compiles lax.ragged_all_to_all (XLA:CPU does not)


def ragged_compiles(mesh: Mesh | jax.sharding.AbstractMesh) -> bool:
    """Whether the devices of ``mesh`` (jax's default backend for an abstract mesh) run :func:`ragged_rows`."""
    platform = mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else jax.default_backend()
    return platform in RAGGED_PLATFORMS


def chunk_rows(rows: int, shards: int) -> int:
    """Rows per destination per chunk for ``rows`` choices over ``shards`` destinations."""
    return max(1, math.ceil(rows / (shards * CHUNKS_PER_MEAN)))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def swap(buf: jax.Array, trips: jax.Array, axes: tuple[str, ...], chunk: int) -> jax.Array:
    """``buf`` [ep, rows, h]: block ``j`` to shard ``j``, received at index ``source``; the first
    ``trips · chunk`` rows of each block move, in ``trips`` all-to-alls of ``chunk`` rows (the rest: zeros)."""

    def body(i: jax.Array, out: jax.Array) -> jax.Array:
        got = lax.all_to_all(lax.dynamic_slice_in_dim(buf, i * chunk, chunk, axis=1), axes, 0, 0, tiled=True)
        return lax.dynamic_update_slice_in_dim(out, got, i * chunk, axis=1)

    return lax.fori_loop(0, trips, body, jnp.zeros_like(buf))


def _swap_fwd(buf: jax.Array, trips: jax.Array, axes: tuple[str, ...], chunk: int) -> tuple[jax.Array, jax.Array]:
    return swap(buf, trips, axes, chunk), trips


def _swap_bwd(axes: tuple[str, ...], chunk: int, trips: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    return swap(g, trips, axes, chunk), None  # a permutation of blocks, masked alike: its own transpose


swap.defvjp(_swap_fwd, _swap_bwd)


def _rows(x: jax.Array, routing: kernels.Routing, experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The ``n = b·s·k`` rows of tokens ``x`` [b, s, h] times their choices: each row's expert, the order that
    sorts the rows by expert (stably), the rows per expert [experts], and the rows themselves [n, h]."""
    b, s, h = x.shape
    n = b * s * routing.index.shape[-1]
    expert = routing.index.reshape(n)
    sizes = jnp.zeros((experts,), jnp.int32).at[expert].add(1)
    tokens = jnp.broadcast_to(x[:, :, None, :], (*routing.index.shape, h)).reshape(n, h)
    return expert, jnp.argsort(expert, stable=True), sizes, tokens


def _gated(y: jax.Array, x: jax.Array, routing: kernels.Routing) -> jax.Array:
    """The rows' results ``y`` [n, h] back in token order summed per token with their gates: [b, s, h]."""
    return jnp.einsum("bskd,bsk->bsd", y.reshape(*routing.index.shape, -1), routing.gate.astype(x.dtype))


def dropless_rows(
    x: jax.Array,
    routing: kernels.Routing,
    weights: tuple[jax.Array | fp8.Operand, ...],
    axes: tuple[str, ...],
    shards: int,
    every: tuple[str, ...],
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """Tokens ``x`` [b, s, h] through their chosen experts, held ``len(w) = E/shards`` per shard of ``axes``;
    gated and summed. ``every``: all the mesh axes (the trip count is the same on every device); ``f8``: the
    grouped matmuls' fp8 histories, with fp8 weights (:func:`jaxscale.models.routing.grouped_swiglu`)."""
    local = weights[0].shape[0]
    expert, order, sizes, tokens = _rows(x, routing, shards * local)  # sorted by destination shard, then expert
    (n, h), sizes = tokens.shape, sizes.reshape(shards, local)
    counts = sizes.sum(1)
    dest = expert[order] // local
    pos = jnp.arange(n) - (jnp.cumsum(counts) - counts)[dest]  # place among the rows to its destination
    chunk = chunk_rows(n, shards)
    rows = math.ceil(n / chunk) * chunk
    send = jnp.zeros((shards, rows, h), x.dtype).at[dest, pos].set(tokens[order])
    arriving = lax.all_to_all(sizes, axes, 0, 0, tiled=True)  # [sources, local experts]
    most = jnp.max(counts)  # the max over the axes it varies on (on the others it is the same everywhere)
    varying = tuple(a for a in every if a in jax.typeof(most).manual_axis_type.varying)
    trips = ((lax.pmax(most, varying) if varying else most) + chunk - 1) // chunk
    received = swap(send, trips, axes, chunk)
    # Each source's rows arrive sorted by local expert: row r of source j is expert e where the
    # running counts of source j first exceed r; rows past the source's count are padding.
    ends = jnp.cumsum(arriving, axis=1)  # [sources, local]
    r = jnp.arange(rows)
    which = jnp.sum(r[None, :, None] >= ends[:, None, :], axis=-1)  # [sources, rows]; == local: padding
    out = kernels.grouped_swiglu(received.reshape(shards * rows, h), which.reshape(-1), *weights, f8=f8)
    back = swap(out.reshape(shards, rows, h), trips, axes, chunk)
    return _gated(jnp.zeros((n, h), x.dtype).at[order].set(back[dest, pos]), x, routing)


def varying_like(a: jax.Array, like: jax.Array) -> jax.Array:
    """``a`` marked as varying over every mesh axis ``like`` varies over. A ``ragged_all_to_all`` result has
    its ``output`` buffer's type: a buffer invariant over an axis the rows differ on (data, fsdp) would
    have autodiff sum the rows' cotangents over it."""
    more = tuple(jax.typeof(like).manual_axis_type.varying - jax.typeof(a).manual_axis_type.varying)
    return lax.pcast(a, more, to="varying") if more else a


def ragged_rows(
    x: jax.Array,
    routing: kernels.Routing,
    weights: tuple[jax.Array | fp8.Operand, ...],
    axes: tuple[str, ...],
    shards: int,
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """:func:`dropless_rows` by one ``lax.ragged_all_to_all`` each way (GPU, TPU): the same tokens, experts,
    fp8 histories and result. Slice ``(d, e)`` of a device's sorted rows (those for expert ``e`` of shard
    ``d``) lands on ``d`` after the rows of its experts before ``e``, and of ``e``'s sources before this device."""
    local = weights[0].shape[0]
    _, order, sizes, tokens = _rows(x, routing, shards * local)  # slice (d, e) of the sorted rows at d·local + e
    (n, h), tokens = tokens.shape, tokens[order]
    starts = jnp.cumsum(sizes) - sizes  # where each slice begins among the sorted rows

    def swap(a: jax.Array) -> jax.Array:  # [shards, local] ints: row d to shard d, received at row source
        return lax.all_to_all(a.reshape(shards, local), axes, 0, 0, tiled=True)

    arriving = swap(sizes)  # [sources, local experts]
    per_expert = arriving.sum(0)
    at = (jnp.cumsum(per_expert) - per_expert)[None, :] + jnp.cumsum(arriving, 0) - arriving  # [sources, local]
    buffer = varying_like(jnp.zeros((shards * n, h), x.dtype), tokens)
    received = lax.ragged_all_to_all(tokens, buffer, starts, sizes, swap(at).reshape(-1), arriving.reshape(-1),
                                     axis_name=axes)
    which = jnp.searchsorted(jnp.cumsum(per_expert), jnp.arange(shards * n), side="right")  # == local: padding
    out = kernels.grouped_swiglu(received, which, *weights, f8=f8)
    home = varying_like(jnp.zeros((n, h), x.dtype), out)
    back = lax.ragged_all_to_all(out, home, at.reshape(-1), arriving.reshape(-1), swap(starts).reshape(-1), sizes,
                                 axis_name=axes)
    return _gated(jnp.zeros((n, h), x.dtype).at[order].set(back), x, routing)
