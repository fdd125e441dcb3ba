"""The ring's busiest device with packed documents, for the planner (no jax).

With packed documents the ring attention kernel skips the tiles where no query shares a document with a key;
the zig-zag balances each sequence's causal work, not its documents, so the skipped tiles fall unevenly and every
ring step waits for the device with the most tiles left. ``data.ring_balance`` rearranges each row's documents to
even them (:mod:`jaxscale.parallel.ring_balance`). :data:`BUSIEST` holds the largest device's executed tiles over
the mean, mean over 32 one-row batches, counted in the kernel's own schedule by ``benchmarks/ring_balance.py``
(16384 tokens, 128-token tiles; ``short``: geometric lengths of mean 300 tokens, ``mixed``: log-normal, median
1500, sigma 1.2; ``--cp 2 16`` and the default ``4 8``). The planner stretches the ring's attention by it; the
mean work it keeps at the causal half (the skipped tiles it does not subtract: a bound from above for both).
Ulysses attends whole sequences on every device (its heads), so its devices do equal work: no stretch.
"""

from __future__ import annotations

CORPORA = ("short", "mixed")
# (corpus, ring) -> (busiest over mean before, after data.ring_balance)
BUSIEST: dict[tuple[str, int], tuple[float, float]] = {
    ("short", 2): (1.069, 1.016),
    ("short", 4): (1.225, 1.048),
    ("short", 8): (1.386, 1.165),
    ("short", 16): (1.758, 1.444),
    ("mixed", 2): (1.194, 1.023),
    ("mixed", 4): (1.410, 1.171),
    ("mixed", 8): (1.609, 1.277),
    ("mixed", 16): (1.695, 1.405),
}


def busiest(documents: str, ring: int, balanced: bool) -> float:
    """The ring's largest device's attention work over the mean for rows packed with ``documents`` (``""``:
    none, 1), balanced or not: the measured ring at or below ``ring`` (16's beyond it, 1 for a ring of one)."""
    if not documents or ring <= 1:
        return 1.0
    measured = max(r for corpus, r in BUSIEST if corpus == documents and r <= ring)
    return BUSIEST[documents, measured][1 if balanced else 0]
