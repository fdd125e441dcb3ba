"""An exact weighted interleave: which source gives row ``g`` of a mixture, and which of its rows, as a pure
function of ``g`` (:class:`jaxscale.data.batches.MixtureBatches`).

The weights are read as the decimals they are written as (``0.6`` is 3/5: Python's shortest ``repr`` of the
float) and normalised to exact fractions ``w_i = p_i / P``, ``P`` their least common denominator. One period of
``P`` rows is laid out earliest deadline first: source ``i``'s ``k``-th row may be row ``n`` (counting from 1)
when ``(k - 1) / w_i < n < k / w_i + 1``, and each row goes to the source, among those whose next row may come,
whose next deadline ``k / w_i`` is the earliest (ties: the first listed). Every window can be met (the chairman
assignment theorem, Tijdeman 1980, gives a sequence within ``1 - 1/(2m - 2)`` of the weights for ``m`` sources),
and earliest deadline first meets unit rows' windows wherever they can be met; so after every ``n`` rows each
source's count ``c_i(n)`` keeps ``|c_i(n) - n·w_i| < 1``: within one row of its weight at every prefix, and
exactly ``p_i`` after ``P`` rows, where the period repeats. A period longer than :data:`MAX_PERIOD` rows
(weights written with many digits) is refused by :func:`jaxscale.config.read.validate_mixture`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

MAX_PERIOD = 2**17  # rows: one period's table is built with the loader (under a second)


def shares(weights: list[float]) -> tuple[list[int], int]:
    """The integer shares ``p_i`` of one period and the period ``P = sum p_i`` of positive ``weights``."""
    exact = [Fraction(repr(float(w))) for w in weights]
    total = sum(exact)
    fractions = [w / total for w in exact]
    period = math.lcm(*(f.denominator for f in fractions))
    return [int(f * period) for f in fractions], period


class Interleave:
    """One period of the interleave of ``weights``: each row's source and its rank among that source's rows."""

    def __init__(self, weights: list[float]):
        self.counts, self.period = shares(weights)
        p, period = self.counts, self.period
        scale = [math.lcm(*p) // q for q in p]  # (c + 1) · scale_i orders the deadlines (c + 1) / p_i exactly
        self.source = np.empty(period, np.int32)
        self.rank = np.empty(period, np.int64)
        taken = [0] * len(p)
        for n in range(1, period + 1):
            i = min((i for i in range(len(p)) if taken[i] * period < n * p[i]),
                    key=lambda i: ((taken[i] + 1) * scale[i], i))
            self.source[n - 1], self.rank[n - 1] = i, taken[i]
            taken[i] += 1

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source of each of the mixture's ``rows`` (indices from 0) and that row's index in its source."""
        cycle, at = np.divmod(np.asarray(rows, np.int64), self.period)
        source = self.source[at]
        return source, cycle * np.asarray(self.counts, np.int64)[source] + self.rank[at]
