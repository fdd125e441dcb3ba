"""One collective of the analytic step (:class:`Flow`) and the rule that drops those over no devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxscale.analysis.hlo import wire_bytes
from jaxscale.layout.rules import Layout


@dataclasses.dataclass(frozen=True)
class Flow:
    """One collective of the step: what it moves, over which mesh axes, how often, bytes per device per run."""

    what: str
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axes: tuple[str, ...]
    size: float  # the bytes the wire rule applies to (all-gather: result; others: operand)
    runs: float
    n: int
    phase: str  # forward, backward, update
    overlap: bool  # may hide behind compute

    @property
    def wire_bytes(self) -> float:
        return wire_bytes(self.kind, self.n, self.size, self.runs)


def flow(what: str, kind: str, axes: Sequence[str], size: float, runs: float, layout: Layout, phase: str,
          overlap: bool) -> list[Flow]:
    axes = tuple(axes)
    n = layout.size(axes)
    if n <= 1 or size <= 0 or runs <= 0:
        return []
    return [Flow(what, kind, axes, size, runs, n, phase, overlap)]
