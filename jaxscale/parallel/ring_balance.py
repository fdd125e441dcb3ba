"""Balancing the ring per document: each packed row's documents put in an order that evens the tiles the
ring's devices compute (``data.ring_balance``; numpy, the data path's).

The zig-zag layout (:mod:`jaxscale.parallel.ring_schedule`) balances one causal sequence: device ``i`` holds
chunks ``i`` and ``2c−1−i``. With packed documents the ring skips the tiles across documents, and what is left
is each document's own causal triangle: a query tile computes the key tiles from its document's first tile on,
so a device's work is the sum over its query tiles of their distance into their document. Where the long
documents of a row fall decides which devices carry them; nothing in the zig-zag evens that.

**The scheme** (:func:`arrangement`, per row): whole documents (each from its position 0) are reordered within
the row by a short local search, swaps of two documents kept where the largest device's tiles (then the sum of
their squares) fall, the tiles counted exactly in O(tiles) (:func:`device_work`); deterministic per row. A piece
that begins the row inside a document (its positions do not start at 0) stays first: its document's start is
named by ``natural index − position``, which only its own place keeps. Each token keeps its position, its
target (the token after it in the stream) and whether that is trained: a document's tokens see only its own,
so the loss and every gradient are the row's as packed. Why this and not another: re-cutting the chunks per
batch (a document-aware chunk-to-device map) would make the kernel's tile ids data, threaded through every
model; this changes only the data's order. Head-tail placement (longest documents outermost, mirrored) was
measured first and made the largest device's share worse (the outermost chunks of both ends fold onto the
same device, so the longest documents' triangles piled up there).
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxscale.parallel.ring_schedule import SKIP, block_ids, tile_kind


def documents(positions: np.ndarray) -> list[np.ndarray]:
    """The natural indices of each document piece of a row's ``positions`` [s] (a new one where a position is 0)."""
    starts = np.flatnonzero(positions == 0)
    cuts = np.concatenate([[0], starts[starts > 0], [len(positions)]])
    return [np.arange(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def device_work(lengths: list[int], lead: int, cp: int, block: int) -> np.ndarray:
    """[cp]: the causal tiles each device of a zig-zag ring computes for one row that holds, in order, a piece of
    ``lead`` tokens begun before the row, then documents of these ``lengths`` (:func:`executed_tiles` of one
    row, in O(tiles): a query tile's key tiles are those from its first token's document's first tile on)."""
    seq_len = lead + sum(lengths)
    starts = np.repeat(np.cumsum([0, lead, *lengths])[1:-1], lengths) if lengths else np.zeros(0, np.int64)
    starts = np.concatenate([np.full(lead, -1), starts]).reshape(-1, block)  # tokens' document starts (lead: -1)
    first_key = np.searchsorted(starts.max(1), starts.min(1))  # the first key tile sharing a document
    rows = np.arange(len(starts)) - first_key + 1  # key tiles each query tile computes
    return rows[block_ids(cp, seq_len, block, True)].sum(1)


def arrangement(positions: np.ndarray, cp: int, block: int, tries: int = 200, seed: int = 0) -> np.ndarray:
    """A permutation of a row's natural indices [s] that lowers its largest device's tiles (:func:`device_work`):
    swaps of two whole documents, kept where the largest device's work (then the sum of squares) falls; a
    leading piece begun before the row stays first. Deterministic for a row (``seed``)."""
    pieces = documents(positions)
    lead = pieces.pop(0) if pieces and positions[0] != 0 else np.zeros(0, np.int64)
    rng, order = np.random.default_rng(seed), list(range(len(pieces)))

    def cost(order: list[int]) -> tuple[int, int]:
        work = device_work([len(pieces[i]) for i in order], len(lead), cp, block)
        return int(work.max()), int((work.astype(np.int64) ** 2).sum())

    best = cost(order)
    for _ in range(tries if len(order) > 1 else 0):
        i, j = rng.choice(len(order), 2, replace=False)
        order[i], order[j] = order[j], order[i]
        trial = cost(order)
        if trial < best:
            best = trial
        else:
            order[i], order[j] = order[j], order[i]
    return np.concatenate([lead, *(pieces[i] for i in order)]).astype(np.int32)


def arranged(positions: np.ndarray, cp: int, block: int) -> np.ndarray:
    """[rows, s]: :func:`arrangement` of each row of ``positions`` [rows, s] (natural indices, per row)."""
    return np.stack([arrangement(row, cp, block) for row in positions])


def executed_tiles(positions: np.ndarray, cp: int, block: int) -> np.ndarray:
    """[cp]: the score tiles each device of a causal zig-zag ring computes for rows whose ``positions`` [rows, s]
    are in the natural order, in the kernel's own schedule: a tile runs unless causally masked or, in every row,
    no query shares a document with a key (the skip of :func:`~jaxscale.parallel.ring_schedule.visible`)."""
    rows, seq_len = positions.shape
    starts = (np.arange(seq_len) - positions).reshape(rows, -1, block)  # each tile's tokens' document starts
    lo, hi = starts.min(2), starts.max(2)  # [rows, tiles]
    ids = block_ids(cp, seq_len, block, True)
    work = np.zeros(cp, np.int64)
    for me in range(cp):
        q = ids[me]
        for step in range(cp):
            k = ids[(me - step) % cp]
            causal = tile_kind(q[:, None], k[None, :], True) != SKIP
            shared = ((lo[:, q][:, :, None] <= hi[:, k][:, None, :]) & (lo[:, k][:, None, :] <= hi[:, q][:, :, None]))
            work[me] += int((causal & shared.any(0)).sum())
    return work
