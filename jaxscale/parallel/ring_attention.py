"""Context parallelism (CP): ring attention over the mesh axes that shard the sequence.

Every module of the model but attention is token-wise, so with the rules
table mapping ``length`` (and ``norm_length``) to ``context`` each device holds
``s/c`` tokens everywhere. Attention needs the whole sequence: here each
device keeps its query block while the key/value blocks travel a ring of the
``c`` devices (``lax.ppermute`` to the next device), merged into the output by
an online (log-sum-exp) softmax, so no device ever holds the full key/value
sequence or any ``s x s`` score matrix. The transfer of the next block is
issued before the current one is computed, so the two can overlap.

**What moves, per layer, per device** (docs/formulas.md, "CP (ring)"): forward,
the K and V blocks ``c−1`` times: ``2·(c−1)·b·(s/c)·g·d_h·bytes`` (``g`` the
kv heads on this device; kv heads are never repeated before the transfer,
grouped-query attention maps ``a/g`` query heads to each kv head in the
einsum). Backward (a custom VJP, not autodiff through the loop): K and V
travel again ``c−1`` times, and their gradient accumulators (fp32) ``c`` times
(the last hop brings them home): ``2·(c−1)·b·(s/c)·g·d_h·bytes +
2·c·b·(s/c)·g·d_h·4``: "about twice" the forward, as docs/formulas.md says, when
K and V are fp32 (2.1x at c=8); with bf16 K and V the fp32 accumulators make
it 3.3x (they are kept fp32 for the sum over c devices).

**What is saved**: activation memory per device is that of ``s/c`` tokens
(docs/formulas.md: "Context parallelism divides s by c"), and attention itself keeps only
``q, k, v, out`` and the log-sum-exp of the local block (O(s/c)); scores
exist one ``block x block`` tile at a time (flash-style), so no
``5·a·s/h`` term either.

**Causal load balance**: the sequence is cut into ``2c`` chunks and device
``i`` holds chunks ``i`` and ``2c−1−i`` (zig-zag), so every device has one
early and one late chunk and does the same work: ``2c+1`` chunk-pair tiles
against ``4i+3`` (up to ``4c−1``) with contiguous chunks. Fully masked tiles
are skipped (``lax.switch``), the diagonal ones masked. The data path puts the
tokens, targets and positions of each sequence in this order
(:func:`~jaxscale.parallel.ring_schedule.sequence_order`), so the loss (a mean over tokens) is unchanged and
RoPE sees the true positions.

**Packed documents** (``data.documents``: the positions restart at each document): a token's document is
named by where it starts in the sequence, its index in the sequence's natural order less its position
(:func:`document_starts`; each device knows the natural index of its tokens from the tile ids). The key
side's starts travel the ring with their K and V blocks. A tile where no query shares a document with
any key is skipped as the causally masked ones are (its tokens are contiguous in the natural order and
the starts non-decreasing, so the test on the tiles' least and greatest starts is exact); a tile in one
document is computed as without documents; only a tile spanning a boundary is masked to the pairs of one
document, a ``block x block`` comparison made inside the tile.

With a ring of one device the same kernel is blockwise (flash) attention on
one device: ``model.attention: blockwise``.

Inside a ``shard_map`` that is already manual over the ring's axes (a pipeline stage's loop: the
active layout's :class:`~jaxscale.layout.rules.Stage` names them) the kernel runs directly on each
device's blocks: a ``shard_map`` of its own
nested in that partly manual loop does not lower (Shardy: "manual axes must come before free
axes" for its residuals, whose leading dimension spans the loop's free axes, e.g. fsdp). There the
keys and values are **all-gathered** over the ring's axes (``_Ring.gathered``) and the kernel visits
every device's blocks from the gathered copy in the ring's order; the backward adds each block's
gradient into a buffer of all of them, reduce-scattered at the end. The bytes are the ring's
(``c−1`` blocks in, and out for the gradients), the memory one layer's whole K and V; what it buys is no
collective-permute: a stage skips its idle slots with a conditional, and XLA:CPU runs a permute in a
branch that some stages do not take wrong (an all-gather or reduce-scatter among one stage's devices
runs right).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxscale.layout.sharding import Axes, active, spec, spec_axes, stage
from jaxscale.parallel.logit_max import head_max_spec, per_device
from jaxscale.parallel.ring_schedule import FULL, block_ids, document_starts, tile_kind, visible

_NEG = float(np.finfo(np.float32).min)

@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static plan of one attention call: ring axes and size, tile ids, masking, tile size."""

    axes: tuple[str, ...]
    cp: int
    ids: np.ndarray
    causal: bool
    block: int
    scale: float
    varying: tuple[str, ...]
    gathered: bool = False  # K and V all-gathered over the ring's axes, their gradients reduce-scattered

    def index(self) -> jax.Array:
        return lax.axis_index(self.axes) if self.cp > 1 else jnp.int32(0)

    def gather(self, x):
        """Every device's block of ``x`` (a tree; None stays None), [cp, ...] in the ring's order."""
        return jax.tree.map(lambda a: lax.all_gather(a, self.axes), x)

    def shift(self, x):
        """Send to the next device of the ring."""
        return lax.ppermute(x, self.axes, [(i, (i + 1) % self.cp) for i in range(self.cp)])

    def zeros(self, shape: tuple[int, ...], fill: float = 0.0) -> jax.Array:
        """An fp32 accumulator, typed as varying over the mesh axes the blocks vary over (check_vma)."""
        return lax.pcast(jnp.full(shape, fill, jnp.float32), self.varying, to="varying")


def _tile(x: jax.Array, i: jax.Array, block: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis)


def _put(x: jax.Array, tile: jax.Array, i: jax.Array, block: int, axis: int) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(x, tile, i * block, axis)


def _branches(tile_fn, scale: float, documents: bool) -> list:
    """The tile functions by kind: SKIP, DIAGONAL, FULL and, with ``documents``, the two masked across them;
    each takes (acc, *tiles, docs)."""

    def make(masked: bool, across: bool):
        fn = partial(tile_fn, masked=masked, scale=scale)
        return fn if across else lambda *args: fn(*args[:-1], None)

    skip = [lambda acc, *_: acc, make(True, False), make(False, False)]
    return [*skip, make(True, True), make(False, True)] if documents else skip


def _scores(q: jax.Array, k: jax.Array, docs, masked: bool, scale: float) -> jax.Array:
    """[b, kv heads, group, q, k] scores of one tile, fp32, causally masked on a diagonal tile and, with ``docs``
    (the tile's query and key document starts, [b, block] each), masked across documents."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    if masked:
        n = q.shape[1]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, _NEG)
    if docs is not None:
        same = docs[0][:, :, None] == docs[1][:, None, :]  # [b, q, k]: one tile's, never the sequence's
        s = jnp.where(same[:, None, None], s, _NEG)
    return s


def _fold_tile(acc, q, k, v, docs, *, masked: bool, scale: float):
    """Online softmax: fold one key/value tile into the running (out, max, sum) of one query tile.

    A query row all of whose keys in the tile are in other documents, met before any key of its own
    document, adds exp(0) = 1 per key while its max is still ``_NEG``; its own document's keys (its own at
    least) then scale that by exp(``_NEG`` - max) = 0, so nothing of it stays."""
    o, m, total = acc
    s = _scores(q, k, docs, masked, scale)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o * jnp.transpose(corr, (0, 3, 1, 2))[..., None] + pv, m_new, total * corr + p.sum(-1)


def _tile_docs(starts, i: jax.Array, j: jax.Array, block: int):
    """The query tile ``i``'s and key tile ``j``'s document starts (None without documents)."""
    return None if starts is None else (_tile(starts[0], i, block, 1), _tile(starts[1], j, block, 1))


def _kind(plan: _Ring, q_id, k_id, docs):
    """SKIP, DIAGONAL or FULL for a query tile against a key tile; with documents (``docs``) SKIP where none is
    shared, and ``+ ACROSS`` where the tile spans a boundary (:func:`visible`)."""
    kind = tile_kind(q_id, k_id, plan.causal)
    return kind if docs is None else visible(kind, *docs)


def _fold(q, k, v, q_ids, k_ids, state, plan: _Ring, starts=None):
    """Fold the key/value tiles ``k_ids`` into the running (out, max, sum) of the query tiles ``q_ids``;
    ``starts``: the queries' and keys' document starts, or None."""
    block = plan.block
    branches = _branches(_fold_tile, plan.scale, starts is not None)

    def per_query(state, i):
        o, m, total = state
        qi = _tile(q, i, block, 1)

        def per_key(acc, j):
            kj, vj, docs = _tile(k, j, block, 1), _tile(v, j, block, 1), _tile_docs(starts, i, j, block)
            if not plan.causal and docs is None:
                return branches[FULL](acc, qi, kj, vj, None), None
            return lax.switch(_kind(plan, q_ids[i], k_ids[j], docs), branches, acc, qi, kj, vj, docs), None

        acc = (_tile(o, i, block, 1), _tile(m, i, block, 3), _tile(total, i, block, 3))
        acc, _ = lax.scan(per_key, acc, jnp.arange(k.shape[1] // block))
        return (_put(o, acc[0], i, block, 1), _put(m, acc[1], i, block, 3), _put(total, acc[2], i, block, 3)), None

    state, _ = lax.scan(per_query, state, jnp.arange(q.shape[1] // block))
    return state


def _grad_tile(acc, q, do, lse, delta, k, v, docs, *, masked: bool, scale: float):
    """Add one tile's contribution to (dq of the query tile, dk and dv of the key/value tile)."""
    dq, dk, dv = acc
    p = jnp.exp(_scores(q, k, docs, masked, scale) - lse[..., None])
    dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _grad(q, do, lse, delta, k, v, q_ids, k_ids, dq, plan: _Ring, starts=None):
    """Gradients of one key/value block: adds to ``dq``, returns it with this block's (dk, dv)."""
    block = plan.block
    branches = _branches(_grad_tile, plan.scale, starts is not None)

    def per_key(dq, j):
        kj, vj = _tile(k, j, block, 1), _tile(v, j, block, 1)
        zeros = plan.zeros(kj.shape), plan.zeros(vj.shape)

        def per_query(carry, i):
            dq, dk, dv = carry
            tiles = (_tile(q, i, block, 1), _tile(do, i, block, 1), _tile(lse, i, block, 3), _tile(delta, i, block, 3))
            acc, docs = (_tile(dq, i, block, 1), dk, dv), _tile_docs(starts, i, j, block)
            if plan.causal or docs is not None:
                acc = lax.switch(_kind(plan, q_ids[i], k_ids[j], docs), branches, acc, *tiles, kj, vj, docs)
            else:
                acc = branches[FULL](acc, *tiles, kj, vj, None)
            return (_put(dq, acc[0], i, block, 1), acc[1], acc[2]), None

        (dq, dk, dv), _ = lax.scan(per_query, (dq, *zeros), jnp.arange(q.shape[1] // block))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(per_key, dq, jnp.arange(k.shape[1] // block))
    return dq, jnp.moveaxis(dk, 0, 1).reshape(k.shape), jnp.moveaxis(dv, 0, 1).reshape(v.shape)


def _forward(q, k, v, starts, plan: _Ring):
    """Local blocks q [b, s/c, kv heads, group, d], k [b, s/c, kv heads, d] and v [b, s/c, kv heads, d_v]
    -> (out [b, s/c, kv heads, group, d_v], log-sum-exp, each head's largest score [kv heads, group]: the online
    softmax's row maxima's); ``starts`` [b, s/c]: the tokens' document starts (travelling with K and V), or
    None."""
    me = plan.index()
    ids = jnp.asarray(plan.ids, jnp.int32)
    b, s, h, g, _ = q.shape
    state = (plan.zeros((b, s, h, g, v.shape[-1])), plan.zeros((b, h, g, s), _NEG), plan.zeros((b, h, g, s)))

    # Checkpointed, though nothing here is ever differentiated (the custom VJP is): when the layer scan around
    # this is linearized, JAX hoists constant-only values (the causal masks) out of it and, without the
    # checkpoint, would stack one per tile: O(s²) memory.
    @jax.checkpoint
    def visit(state, kv, step):
        k, v, k_starts = kv
        both = None if starts is None else (starts, k_starts)
        return _fold(q, k, v, ids[me], ids[(me - step) % plan.cp], state, plan, both)

    kv = (k, v, starts)
    if plan.gathered:
        every = plan.gather(kv)

        def gathered_step(state, step):
            return visit(state, jax.tree.map(lambda a: a[(me - step) % plan.cp], every), step), None

        state, _ = lax.scan(gathered_step, state, jnp.arange(plan.cp - 1))
        kv = jax.tree.map(lambda a: a[(me + 1) % plan.cp], every)
    elif plan.cp > 1:

        def ring_step(carry, step):
            state, kv = carry
            incoming = plan.shift(kv)  # issued before this block is computed: transfer overlaps compute
            return (visit(state, kv, step), incoming), None

        (state, kv), _ = lax.scan(ring_step, (state, kv), jnp.arange(plan.cp - 1))
    o, m, total = visit(state, kv, plan.cp - 1)
    out = o / jnp.transpose(total, (0, 3, 1, 2))[..., None]
    return out.astype(q.dtype), m + jnp.log(total), m.max(axis=(0, 3))


def _backward(plan: _Ring, residuals, cotangents):
    """The ring again: K, V (with their document starts) and their fp32 gradient accumulators travel; dq stays.
    The heads' largest scores are a statistic: their cotangent is dropped."""
    q, k, v, starts, out, lse = residuals
    do = cotangents[0]
    me = plan.index()
    ids = jnp.asarray(plan.ids, jnp.int32)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", do.astype(jnp.float32), out.astype(jnp.float32))
    dq = plan.zeros(q.shape)
    dkv = (plan.zeros(k.shape), plan.zeros(v.shape))

    def visit(dq, dkv, kv, step):
        k, v, k_starts = kv
        both = None if starts is None else (starts, k_starts)
        dq, dk, dv = _grad(q, do, lse, delta, k, v, ids[me], ids[(me - step) % plan.cp], dq, plan, both)
        return dq, (dkv[0] + dk, dkv[1] + dv)

    kv = (k, v, starts)
    if plan.gathered:
        return _gathered_backward(plan, q, do, lse, delta, kv, dq)
    if plan.cp > 1:

        def ring_step(carry, step):
            dq, kv, dkv = carry
            incoming = plan.shift(kv)
            dq, dkv = visit(dq, dkv, kv, step)
            return (dq, incoming, plan.shift(dkv)), None

        (dq, kv, dkv), _ = lax.scan(ring_step, (dq, kv, dkv), jnp.arange(plan.cp - 1))
    dq, dkv = visit(dq, dkv, kv, plan.cp - 1)
    if plan.cp > 1:
        dkv = plan.shift(dkv)  # the last hop brings each block's gradient home
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


def _gathered_backward(plan: _Ring, q, do, lse, delta, kv, dq):
    """The backward on K and V all-gathered: each device adds its gradient of every device's block into a
    buffer of all of them, reduce-scattered at the end (each block's gradient summed onto its device)."""
    me, ids, every = plan.index(), jnp.asarray(plan.ids, jnp.int32), plan.gather(kv)
    starts = kv[2]

    def step(carry, step):
        dq, dks = carry
        src = (me - step) % plan.cp
        k, v, k_starts = jax.tree.map(lambda a: a[src], every)
        both = None if starts is None else (starts, k_starts)
        dq, dk, dv = _grad(q, do, lse, delta, k, v, ids[me], ids[src], dq, plan, both)
        return (dq, (dks[0].at[src].add(dk), dks[1].at[src].add(dv))), None

    dks = (plan.zeros((plan.cp, *kv[0].shape)), plan.zeros((plan.cp, *kv[1].shape)))
    (dq, dks), _ = lax.scan(step, (dq, dks), jnp.arange(plan.cp))
    dk, dv = (lax.psum_scatter(d, plan.axes) for d in dks)
    return dq.astype(q.dtype), dk.astype(kv[0].dtype), dv.astype(kv[1].dtype), None


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: _Ring, q, k, v, starts):
    out, _, head_max = _forward(q, k, v, starts, plan)
    return out, head_max


def _attend_fwd(plan: _Ring, q, k, v, starts):
    out, lse, head_max = _forward(q, k, v, starts, plan)
    return (out, head_max), (q, k, v, starts, out, lse)


_attend.defvjp(_attend_fwd, _backward)


def _local(plan: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None
           ) -> tuple[jax.Array, jax.Array]:
    """[b, s, heads, d] queries against [b, s, kv heads, d] keys and [b, s, kv heads, d_v] values, on this
    device's blocks: [b, s, heads, d_v] and each head's largest pre-softmax logit on them [heads] (fp32);
    ``positions`` [b, s] of packed documents (attention kept within each), or None."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    starts = None
    if positions is not None:  # this device's tokens' natural indices, from its tiles' global ids
        ids = jnp.asarray(plan.ids, jnp.int32)[plan.index()]
        starts = document_starts(positions, (ids[:, None] * plan.block + jnp.arange(plan.block)).reshape(-1))
    out, head_max = _attend(plan, q.reshape(b, s, kv_heads, heads // kv_heads, d), k, v, starts)
    return out.reshape(b, s, heads, v.shape[-1]), head_max.reshape(heads)


def _plan(
    seq_len: int, cp: int, axes: tuple[str, ...], varying: tuple[str, ...], head_dim: int, causal: bool, block: int,
    layout: str,
) -> _Ring:
    """The tile is ``block`` tokens, or a whole chunk when that is shorter.

    The sizes are checked at build (:meth:`jaxscale.layout.rules.Layout.validate`, in config terms); here,
    for a direct call, in array terms.
    """
    chunks = 2 * cp if causal and cp > 1 else cp
    chunk = seq_len // chunks
    tile = min(block, chunk)
    if seq_len % chunks or chunk % tile:
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into {chunks} chunks of {tile}-token tiles")
    ids = block_ids(cp, seq_len, tile, causal, layout)
    return _Ring(axes, cp, ids, causal, tile, 1.0 / math.sqrt(head_dim), varying)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_axes: Axes,
    kv_axes: Axes,
    *,
    positions: jax.Array | None = None,
    causal: bool = True,
    block: int = 512,
    ring: bool = True,
    layout: str = "zigzag",
    head_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q [batch, length, heads, head_dim] over k [batch, length, kv_heads, head_dim] and v
    [batch, length, kv_heads, v_head_dim] (the values' width may differ: multi-head latent attention); with
    ``positions`` [batch, length] of packed documents (restarting at 0 at each) within each document. With
    ``head_max`` also each query head's largest pre-softmax logit [heads] (fp32; the online softmax's running
    row maxima, their largest over the batch and the sequence: QK-clip's statistic), no gradient.

    Under :func:`jaxscale.layout.sharding.use_rules` this is a ``jax.shard_map``
    manual over every mesh axis, with specs from the rules (``q_axes`` and
    ``kv_axes`` name the dimensions): the batch and heads stay where the rules
    put them, and with ``ring`` the sequence's mesh axes form the ring (their
    sequence must be in :func:`~jaxscale.parallel.ring_schedule.sequence_order` when causal). Without ``ring``,
    or outside ``use_rules``, it is blockwise attention over the whole sequence.
    """
    current, inside = active(), stage()
    if inside is not None:
        return manual(q, k, v, positions, inside.ring, causal=causal, block=block, ring=ring, layout=layout,
                      head_max=head_max)
    if current is None:
        out = _local(_plan(q.shape[1], 1, (), (), q.shape[-1], causal, block, layout), q, k, v, positions)
        return out if head_max else out[0]
    mesh, place = current
    q_spec, kv_spec = spec(place, q_axes), spec(place, kv_axes)
    axes = spec_axes(q_spec[1]) if ring else ()
    if not ring:
        q_spec, kv_spec = (PartitionSpec(s[0], None, *s[2:]) for s in (q_spec, kv_spec))
    cp = place.size(axes)
    varying = tuple(a for part in q_spec for a in spec_axes(part))
    plan = _plan(q.shape[1], cp, axes if cp > 1 else (), varying, q.shape[-1], causal, block, layout)
    in_specs = (q_spec, kv_spec, kv_spec, PartitionSpec(*q_spec[:2]))  # positions (or None)
    if not head_max:
        fn = jax.shard_map(lambda *a: _local(plan, *a)[0], mesh=mesh, in_specs=in_specs, out_specs=q_spec)
        return fn(q, k, v, positions)
    fn = jax.shard_map(lambda *a: per_device(*_local(plan, *a)), mesh=mesh, in_specs=in_specs,
                       out_specs=(q_spec, head_max_spec(q_spec)))
    out, most = fn(q, k, v, positions)
    return out, most.max(axis=(0, 1))



def manual(
    q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None, axes: tuple[str, ...], *, causal: bool,
    block: int, ring: bool = True, layout: str = "zigzag", gathered: bool = True, head_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`attention` inside a ``shard_map`` manual over the ring's ``axes``: each device's blocks
    are its own already (the sequence in :func:`~jaxscale.parallel.ring_schedule.sequence_order` when causal).
    With ``gathered`` (a pipeline stage's loop) the keys and values are all-gathered over the ring, else they
    travel it by ``ppermute`` (USP's ring part: :mod:`jaxscale.parallel.ulysses`). ``head_max``: also the
    largest logit of each local head [heads] over this device's queries (the caller takes the largest over the
    devices)."""
    if axes and not ring:
        raise ValueError(f"the sequence is split over the manual mesh axes {axes}: only ring attention sees all of it")
    mesh = jax.sharding.get_abstract_mesh()
    if not set(axes) <= set(mesh.manual_axes):
        raise ValueError(f"ring attention over {axes}: not manual axes of the enclosing shard_map {mesh.manual_axes}")
    cp = math.prod(mesh.shape[a] for a in axes)
    seq_len = q.shape[1] * cp
    varying = tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in (q, k, v)))))
    plan = _plan(seq_len, cp, axes if cp > 1 else (), varying, q.shape[-1], causal, block, layout)
    out = _local(dataclasses.replace(plan, gathered=gathered and cp > 1), q, k, v, positions)
    return out if head_max else out[0]
