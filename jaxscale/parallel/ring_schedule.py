"""The ring's tile schedule: which chunks of a sequence each device of a ring holds, and which tiles of
scores it skips, masks or computes in full (causally, and across packed documents).

The sequence is cut into ``2·cp`` chunks; under ``zigzag`` device ``i`` holds chunks ``i`` and ``2cp−1−i``
(one early, one late: the causal work is even), under ``contiguous`` chunks ``2i`` and ``2i+1``. A tile is
``block`` tokens of one chunk, named by its index in the sequence's natural order; a query tile against a key
tile is skipped (all in the future), masked (the diagonal) or full. With packed documents a tile's documents
are named by where they start (:func:`document_starts`), and :func:`visible` refines the kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SKIP, DIAGONAL, FULL = 0, 1, 2
ACROSS = 2  # added to DIAGONAL or FULL: a tile whose pairs span documents, masked pair by pair
LAYOUTS = ("zigzag", "contiguous")


def chunk_layout(cp: int, layout: str = "zigzag") -> np.ndarray:
    """[cp, 2]: which of the ``2·cp`` sequence chunks each device holds, in order."""
    if layout == "zigzag":
        return np.array([[i, 2 * cp - 1 - i] for i in range(cp)])
    if layout == "contiguous":
        return np.array([[2 * i, 2 * i + 1] for i in range(cp)])
    raise ValueError(f"layout '{layout}' is not one of {', '.join(LAYOUTS)}")


def sequence_order(seq_len: int, cp: int, layout: str = "zigzag") -> np.ndarray:
    """The positions of a sequence in the order the devices of a ring of ``cp`` hold them."""
    chunk = seq_len // (2 * cp)
    return (chunk_layout(cp, layout)[:, :, None] * chunk + np.arange(chunk)).reshape(-1)


def block_ids(cp: int, seq_len: int, block: int, causal: bool, layout: str = "zigzag") -> np.ndarray:
    """[cp, local blocks]: the global index of each ``block``-token tile of each device's sequence."""
    if cp == 1 or not causal:
        return np.arange(seq_len // block).reshape(cp, -1)
    per_chunk = seq_len // (2 * cp * block)
    return (chunk_layout(cp, layout)[:, :, None] * per_chunk + np.arange(per_chunk)).reshape(cp, -1)


def tile_kind(q_id, k_id, causal: bool):
    """SKIP, DIAGONAL (causally masked) or FULL for a query tile against a key tile (numpy or jax)."""
    if not causal:
        return FULL
    xp = jnp if isinstance(q_id, jax.Array) else np
    return xp.where(q_id > k_id, FULL, xp.where(q_id == k_id, DIAGONAL, SKIP))


def tile_counts(cp: int, seq_len: int, block: int, causal: bool = True, layout: str = "zigzag") -> np.ndarray:
    """[cp, 3]: tiles each device skips, masks and computes in full, in the kernel's own schedule."""
    ids = block_ids(cp, seq_len, block, causal, layout)
    counts = np.zeros((cp, 3), np.int64)
    for me in range(cp):
        for step in range(cp):
            kinds = tile_kind(ids[me][:, None], ids[(me - step) % cp][None, :], causal)
            counts[me] += np.bincount(np.broadcast_to(kinds, (ids.shape[1],) * 2).ravel(), minlength=3)
    return counts


def document_starts(positions: jax.Array, natural: jax.Array) -> jax.Array:
    """The natural index where each token's document starts: ``natural`` (each token's index in the sequence's
    natural order) less its ``positions`` [b, s] (restarting at 0 at each document, ``data.documents``)."""
    return natural[None, :] - positions.astype(jnp.int32)


def visible(kind, q_starts: jax.Array, k_starts: jax.Array):
    """``kind`` of a tile given its queries' and keys' document starts ([b, block] each; non-decreasing over
    contiguous tokens, so a tile's documents are those between its least and greatest start): SKIP where no
    query shares a document with a key, ``kind`` where every row's tile is in one document, else
    ``kind + ACROSS`` (masked pair by pair)."""
    q_lo, q_hi, k_lo, k_hi = q_starts.min(1), q_starts.max(1), k_starts.min(1), k_starts.max(1)
    overlap = (q_lo <= k_hi) & (k_lo <= q_hi)
    one = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    return jnp.where(overlap.any() & (kind != SKIP), jnp.where(one.all(), kind, kind + ACROSS), SKIP)
