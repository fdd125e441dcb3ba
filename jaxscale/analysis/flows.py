"""One collective of the analytic model's step (:class:`Flow`): how a flow is made, and a step's flows summed.

A flow's wire bytes follow :func:`jaxscale.analysis.hlo.wire_bytes`, the rule the compiled step is counted by;
:mod:`jaxscale.analysis.communication` lists the step's flows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxscale.analysis.hlo import wire_bytes
from jaxscale.analysis.params import Step
from jaxscale.config.read import ModelConfig
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


def gradient_all_reduce(what: str, axes: Sequence[str], size: float, runs: float, layout: Layout) -> list[Flow]:
    """A gradient summed over ``axes``: XLA reduces over the context axes first, then over the rest.

    The partial sums over the sequence (context parallelism) and over the batch are two
    all-reduces of the whole gradient, not one over their product (seen in the compiled step).
    """
    context = [a for a in axes if a in layout.context_axes]
    rest = [a for a in axes if a not in context]
    flows = flow(what, "all-reduce", context, size, runs, layout, "backward", True)
    return flows + flow(what, "all-reduce", rest, size, runs, layout, "backward", True)


def gradient_bytes(m: ModelConfig, step: Step) -> int:
    """Bytes of a gradient element as devices sum it: the weight-gradient matmul's output dtype, the wider of
    ``model.dtype`` and ``precision.grads_reduce`` (:attr:`jaxscale.config.dtypes.Dtypes.grad_bytes`)."""
    return step.dtypes(m).grad_bytes


def summarize_flows(flows: Sequence[Flow]) -> dict[str, Any]:
    """Wire bytes per device per step: total, by kind and by mesh axes (as :func:`jaxscale.analysis.hlo.summarize`)."""
    by_kind: dict[str, float] = {}
    by_axes: dict[str, float] = {}
    for f in flows:
        by_kind[f.kind] = by_kind.get(f.kind, 0.0) + f.wire_bytes
        key = ",".join(f.axes)
        by_axes[key] = by_axes.get(key, 0.0) + f.wire_bytes
    return {"total": sum(f.wire_bytes for f in flows), "by_kind": by_kind, "by_axes": by_axes}
