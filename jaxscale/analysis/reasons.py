"""Why a plan's layouts rank as they do, in lines a reader can check against the table.

One line each for the winner and the runner-up (what dominates the step, why it beats the next); for the best
pipeline and, for an MoE model, the best layout on the other side of expert parallelism, what it pays against the
winner (the parts of the step that differ most); the assumptions the figures rest on where they decide the ranking:
the dropless exchange's routing imbalance and, for a model with ``dot`` attention, what its scores cost.
:mod:`jaxscale.analysis.plan` ranks the :class:`Candidate`\\ s these lines read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxscale.analysis.ring_imbalance import busiest
from jaxscale.analysis.strategy import Strategy, placement
from jaxscale.config.read import ModelConfig
from jaxscale.layout.stage_plan import assumed
from jaxscale.parallel.schedules import formula_bubble


@dataclasses.dataclass
class Candidate:
    """A layout that fits, with its prediction; ``same`` names the layouts it stands for (identical figures)."""

    layout: Strategy
    memory: dict[str, float]
    comm: dict[str, Any]
    time: dict[str, float]
    same: list[str] = dataclasses.field(default_factory=list)


PARTS = {"matmul": "matmuls", "attention": "attention", "memory_bound": "memory-bound ops", "recompute": "recompute",
         "optimizer": "optimizer update", "bubble": "pipeline bubble",
         "contention": "compute slowed by overlapped comm"}


def parts(t: dict[str, float]) -> dict[str, float]:
    """The step's seconds by what they are spent on: compute parts, bubble, exposed communication by kind."""
    out = {name: t.get(key, 0.0) for key, name in PARTS.items()}
    out.update({f"exposed {k.split('.', 1)[1]} comm": v for k, v in t.items() if k.startswith("exposed.")})
    return out


def unit_for(seconds: float) -> tuple[str, float]:
    """The unit a time column prints in (s, ms or us) and its scale."""
    if seconds >= 1:
        return "s", 1.0
    return ("ms", 1e3) if seconds >= 1e-3 else ("us", 1e6)


def fmt_time(x: float) -> str:
    unit, scale = unit_for(x)
    return f"{x * scale:.3g} {unit}"


def reasons(ranked: Sequence[Candidate], note: str = "", model: ModelConfig | None = None) -> list[str]:
    """One line each for the winner and the runner-up: what dominates its step, and why it beats the next; for
    the best pipeline outside the two, what it pays against the winner (:func:`versus`); ``note`` on the best
    pipeline (:func:`jaxscale.analysis.plan.gather_note`); ``model``: whose stage plan says whether its idle
    slots are skipped (:func:`jaxscale.layout.stage_plan.assumed`; none: a dense model)."""
    lines = []
    for i, c in enumerate(ranked[:2]):
        total = c.time["total"]
        top = ", ".join(f"{name} {100 * v / total:.0f}%"
                        for name, v in sorted(parts(c.time).items(), key=lambda kv: -kv[1])[:3] if v > 0)
        line = f"#{i + 1} {c.layout.describe()} ({c.layout.remat}): {fmt_time(total)}: {top}"
        if i + 1 < len(ranked):
            nxt = ranked[i + 1]
            gap = nxt.time["total"] - total
            mine, theirs = parts(c.time), parts(nxt.time)
            diffs = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in set(mine) | set(theirs)}
            why = max(diffs, key=lambda k: diffs[k])
            if gap > 1e-3 * total and diffs[why] > 0:
                line += (f"; beats #{i + 2} by {100 * gap / total:.1f}% ({fmt_time(gap)}): "
                         f"{fmt_time(diffs[why])} less {why}")
            elif c.memory["total"] < nxt.memory["total"] - 1e6:
                line += (f"; ties #{i + 2} on time (within 0.1%), needs less memory "
                         f"({c.memory['total'] / 1e9:.2f} vs {nxt.memory['total'] / 1e9:.2f} GB)")
            else:
                line += f"; ties #{i + 2} on time and memory, the simpler layout"
        lines.append(line + _bubble_note(c, model))
    piped = next(((i, c) for i, c in enumerate(ranked) if c.layout.stage > 1), None)
    if piped and piped[0] >= 2:  # why the best pipeline lost to the winner
        lines.append(versus("best pipeline", ranked, piped[0]) + _bubble_note(piped[1], model)
                     + (f"; {note}" if note else ""))
    elif piped and note:
        lines.append(f"#{piped[0] + 1} {note}")
    return lines


def versus(label: str, ranked: Sequence[Candidate], i: int) -> str:
    """``label`` #i: its step, how much slower than #1, and the parts of the step that differ most (signed, each
    over a tenth of the gap, up to four)."""
    c, best = ranked[i], ranked[0]
    gap = c.time["total"] - best.time["total"]
    mine = parts(best.time)
    diffs = sorted(((v - mine.get(k, 0.0), k) for k, v in parts(c.time).items()), key=lambda d: -abs(d[0]))
    paid = ", ".join(f"{'+' if d > 0 else '-'}{fmt_time(abs(d))} {k}" for d, k in diffs[:4] if abs(d) > 0.1 * gap)
    return (f"{label} #{i + 1} {c.layout.describe()} ({c.layout.remat}): {fmt_time(c.time['total'])}, "
            f"{100 * gap / best.time['total']:.0f}% ({fmt_time(gap)}) slower than #1: {paid}")


def expert_lines(ranked: Sequence[Candidate], m: ModelConfig, imbalance: float, devices_per_node: int) -> list[str]:
    """For an MoE model: when #1 has no expert parallelism, the best layout with it and the best with as many
    ways as a node's devices can hold experts (without TP), or when #1 has it the best without (:func:`versus`); and
    the dropless exchange's assumed routing imbalance (a cluster's ``ep_imbalance``), which its bytes scale with."""
    if m.moe is None or not ranked:
        return []
    lines = []
    if ranked[0].layout.expert == 1:
        with_ep = [i for i, c in enumerate(ranked) if c.layout.expert > 1]
        widest = math.gcd(m.moe.experts, devices_per_node)  # a node's devices each holding its own experts
        node = [i for i in with_ep if ranked[i].layout.expert == widest and ranked[i].layout.tensor == 1]
        lines += [versus("best with EP", ranked, with_ep[0])] if with_ep else []
        if node and node[0] != with_ep[0]:
            lines.append(versus(f"best with {widest}-way EP inside a node", ranked, node[0]))
    else:
        without = next((i for i, c in enumerate(ranked) if c.layout.expert == 1), None)
        if without is not None:
            lines.append(versus("best without EP", ranked, without))
    if m.moe.dispatch == "dropless" and m.moe.dropless_exchange == "rows":
        lines.append(f"EP's dropless exchange: 2·k·b·s·h·bytes·(ep−1)/ep per MoE layer each way times a routing "
                     f"imbalance (max/mean rows to a shard) assumed {imbalance:g} (cluster key ep_imbalance, "
                     "e.g. --set ep_imbalance=1.5; a run logs it as moe_load_max), once more where the backward "
                     "recomputes the layer (remat full, save_dots); its buffers sized for every row to one shard "
                     "(ep x)")
    return lines


def kernel_line(ranked: Sequence[Candidate], m: ModelConfig) -> list[str]:
    """Where the model's attention is ``dot`` (its s x s scores go through memory): if #1 splits the sequence (its
    attention becomes ring attention, a fused kernel), what the best layout without CP spends on them; else, if
    attention and memory-bound work are over a twentieth of #1's step, that share; and how to plan on a fused kernel."""
    if not ranked or m.attention != "dot":
        return []
    best, hint = ranked[0], "--attention cudnn (or auto) plans every layout on a fused kernel"
    if best.layout.cp > 1:
        flat = next((c for c in ranked if c.layout.cp == 1), None)
        spent = (f": the best without CP ({flat.layout.describe()}) spends {fmt_time(flat.time['memory_bound'])} "
                 "on memory-bound ops, most of it dot's s x s scores" if flat else "")
        return [f"#1 splits the sequence (context degree {best.layout.cp}) and so runs a fused attention kernel "
                "(the ring's, or blockwise on whole sequences under Ulysses), where layouts without CP run the "
                f"model's dot attention{spent}; {hint}"]
    spent = best.time["attention"] + best.time["memory_bound"]
    if spent <= 0.05 * best.time["total"]:
        return []
    return [f"#1 runs the model's dot attention: its s x s scores (the whole square's matmuls and its traffic through "
            f"memory) are most of the {fmt_time(spent)} of attention and memory-bound ops "
            f"({100 * spent / best.time['total']:.0f}% of the step); {hint}"]


def context_line(ranked: Sequence[Candidate]) -> list[str]:
    """Where #1 splits the sequence: why its context parallelism (ring, Ulysses or USP) beats the best of each
    other kind: their exposed communication (the ring's hops hide behind attention's tiles, the all-to-alls sit
    on its critical path) and step time."""
    if not ranked or ranked[0].layout.cp == 1:
        return []
    best = ranked[0].layout
    lines = []
    for kind in ("ring", "Ulysses", "USP"):
        other = next((c for c in ranked if c.layout.cp_kind == kind), None)
        if kind == best.cp_kind or other is None:
            continue
        t, o = ranked[0].time, other.time
        lines.append(f"#1 runs {best.cp_kind} (context degree {best.cp}): {fmt_time(t['exposed'])} of communication "
                     f"exposed and {fmt_time(t['attention'])} of attention against {fmt_time(o['exposed'])} and "
                     f"{fmt_time(o['attention'])} for the best with {kind} ({other.layout.describe()}, "
                     f"{fmt_time(o['total'])} a step): the ring's K/V hops hide behind attention's tiles, the "
                     "all-to-alls of queries, keys, values and output sit on attention's critical path")
    return lines


def balance_line(ranked: Sequence[Candidate]) -> list[str]:
    """With packed documents: the ring's busiest device's attention work over the mean with ``data.ring_balance``
    (planned) and without (:mod:`jaxscale.analysis.ring_imbalance`), for #1's ring or, where #1 runs Ulysses
    alone, the best layout with a ring."""
    if not ranked or not ranked[0].layout.documents or ranked[0].layout.cp == 1:
        return []
    ring = next((c for c in ranked if c.layout.context > 1), None)
    if ring is None:
        return []
    layout, who = ring.layout, "#1" if ring is ranked[0] else f"the best with a ring ({ring.layout.describe()})"
    before, after = (busiest(layout.documents, layout.context, b) for b in (False, True))
    return [f"{who}: its ring of {layout.context} over rows packed with {layout.documents} documents has its "
            f"busiest device compute {after:.2f}x the mean attention tiles with data.ring_balance (planned), "
            f"{before:.2f}x without (benchmarks/ring_balance.py); Ulysses' devices attend whole sequences, equal work"]


# The logical axes of a block's parameters, for what a pipeline stage leaves to the partitioner.
BLOCK_AXES = (("layers", "embed", "heads", "head_dim"), ("layers", "embed", "mlp"))


def _bubble_note(c: Candidate, model: ModelConfig | None = None) -> str:
    """For a pipelined layout whose bubble is its largest cost beyond compute: the bubble, counted and by formula;
    ``model``: whose stage plan says whether idle slots are skipped (none: a dense model)."""
    lay, t = c.layout, c.time
    if lay.stage == 1 or t["bubble"] < max(t["exposed"], t["contention"]):
        return ""
    p, m, v = lay.stage, lay.pipeline_microbatches, lay.repeats
    place = placement(lay)
    free = assumed(place, model or ModelConfig(), BLOCK_AXES).free
    slots = f"idle slots computed masked: {', '.join(free)} inside a stage" if free else "idle slots skipped"
    return (f"; the {lay.schedule} bubble dominates: {100 * t['bubble'] / t['total']:.0f}% of the step "
            f"({100 * formula_bubble(p, m, v, lay.schedule):.0f}% by the schedule's formula, {slots})")
