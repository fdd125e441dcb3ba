"""Muon's cost in the analytic model (``train.optimizer: muon``, :mod:`jaxscale.training.muon`): its state, its
Newton-Schulz work and its moves to and from the owner devices, per device and step, without compiling.

* **State**: one moment (the momentum, in the master's dtype) per hidden matrix where Adam keeps two; the rest
  (embedding, head, norms, routers) keep Adam's two. Laid out by the rules' ``optimizer`` section.
* **FLOPs**: each Newton-Schulz step on a matrix with sides ``a <= b`` is three matmuls: ``X X^T`` (``2 a^2 b``),
  its square (``2 a^3``) and the polynomial times ``X`` (``2 a^2 b``): ``ns_steps · (4 a^2 b + 2 a^3)`` per matrix
  (:func:`ns_flops`), run where the matrix is owned: a stack of ``L`` matrices whose owner layout splits its stack
  dimensions over ``o`` devices costs each of them ``L / o`` matrices (``L' / o`` where the owner layout pads the
  stack to ``L'`` with zero matrices; every device of an axis that gathers rather than owns does the same work).
* **Bytes**: the mesh axes ``M`` that move from a hidden matrix's dimensions onto its stack dimensions cost one
  all-to-all over ``M`` there and one back, each of the device's shard in ``ns_dtype`` (``L' / L`` of it where
  padded; the wire sends ``(|M| - 1) / |M|`` of it); an axis that splits a matrix dimension but no stack
  dimension is all-gathered once (nothing moves back). Phase ``update``, not overlapped.

The planner adds the state to ``optimizer`` (:mod:`jaxscale.analysis.memory`), the flows to the step's
(:mod:`jaxscale.analysis.communication`) and the FLOPs to the optimizer's time (:mod:`jaxscale.analysis.timing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jaxscale.analysis.flows import Flow, flow
from jaxscale.analysis.params import MuonCost, Param, dtype_bytes
from jaxscale.layout.rules import Layout, part_axes
from jaxscale.training import muon_layout


def hidden(params: Sequence[Param], muon: MuonCost) -> list[Param]:
    """Muon's hidden matrices among ``params`` (:func:`jaxscale.training.muon_layout.is_hidden_matrix`)."""
    return [p for p in params if muon_layout.is_hidden_matrix(p.axes, muon.adamw_axes)]


def optimizer_state(params: Sequence[Param], layout: Layout, muon: MuonCost | None, nbytes: int) -> float:
    """Bytes per device of the optimizer's moments: Adam's two of every parameter, or Muon's one of each hidden
    matrix and Adam's two of the rest."""
    def shard(p: Param) -> float:
        return p.size / layout.ways(p.axes, "optimizer")

    ones = {p.path for p in hidden(params, muon)} if muon is not None else set()
    return sum(shard(p) * (1 if p.path in ones else 2) for p in params) * nbytes


def ns_flops(fan_in: int, fan_out: int, steps: int) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz steps on one ``fan_in x fan_out`` matrix (module docstring)."""
    a, b = min(fan_in, fan_out), max(fan_in, fan_out)
    return steps * (4 * a * a * b + 2 * a**3)


def _owners(p: Param, layout: Layout) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], float]:
    """The hidden matrix's mesh axes that split its stack on the owner layout, those that move there from its
    matrix dimensions (all-to-all), those that are gathered (split a matrix dimension, no stack dimension), and
    the matrices of its stack on the owner layout (padded with zero matrices where that layout pads it:
    :func:`jaxscale.training.muon_layout.owner_layout`)."""
    first = muon_layout.stack_dims(p.axes)
    given = [part_axes(x) for x in layout.partition(p.axes, "optimizer")]
    parts, padded = muon_layout.owner_layout(layout, p.shape, p.axes)
    owner = [part_axes(x) for x in parts]
    stack = tuple(a for d in owner[:first] for a in d if layout.size((a,)) > 1)
    was = {a for d in given[first:] for a in d}
    moved = tuple(a for a in stack if a in was)
    gathered = tuple(a for a in sorted(was) if a not in stack and layout.size((a,)) > 1)
    return stack, moved, gathered, math.prod(padded[:first])


def flops(params: Sequence[Param], layout: Layout, muon: MuonCost) -> float:
    """Newton-Schulz FLOPs one device runs a step (module docstring)."""
    total = 0.0
    for p in hidden(params, muon):
        stack, _, _, matrices = _owners(p, layout)
        total += matrices / layout.size(stack) * ns_flops(*muon_layout.fans(p.shape, p.axes), muon.ns_steps)
    return total


def flows(params: Sequence[Param], layout: Layout, muon: MuonCost) -> list[Flow]:
    """The moves to and from the owner devices, per hidden matrix (module docstring)."""
    nbytes, out = dtype_bytes(muon.ns_dtype), []
    for p in hidden(params, muon):
        _, moved, gathered, matrices = _owners(p, layout)
        shard = p.size / layout.ways(p.axes, "optimizer") * nbytes
        padded = shard * matrices / math.prod(p.shape[:muon_layout.stack_dims(p.axes)])
        out += flow(f"Muon: {p.path} to its owners and back", "all-to-all", moved, padded, 2, layout, "update",
                    False)
        out += flow(f"Muon: {p.path} gathered", "all-gather", gathered, shard * layout.size(gathered), 1, layout,
                    "update", False)
    return out


def seconds(params: Sequence[Param], layout: Layout, muon: MuonCost,
            matmul: Callable[[float, float, float, float], float]) -> float:
    """Seconds of one device's Newton-Schulz matmuls a step, ``matmul(count, M, N, K)`` the seconds of ``count``
    (M, N, K) matmuls (:func:`jaxscale.analysis.timing.matmul_seconds` on a cluster)."""
    total = 0.0
    for p in hidden(params, muon):
        stack, _, _, matrices = _owners(p, layout)
        count = muon.ns_steps * matrices / layout.size(stack)
        a, b = sorted(muon_layout.fans(p.shape, p.axes))
        total += 2 * matmul(count, a, a, b) + matmul(count, a, a, a)
    return total
