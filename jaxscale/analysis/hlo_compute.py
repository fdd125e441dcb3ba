"""What a compiled step computes, read from its HLO text: its matmuls with their FLOPs and runs, dots inside
and outside loops, and the bytes a named scope writes.

No jax: the text is parsed by :mod:`jaxscale.analysis.hlo_text`; loops and their trips are those
:func:`jaxscale.analysis.hlo.busy_slots` and the collectives' reading use.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxscale.analysis.hlo import BRANCH, Loop, Taken, contexts
from jaxscale.analysis.hlo_text import callees, nbytes, parse, shapes


def dots(hlo_text: str, opcodes: tuple[str, ...] = ("dot",)) -> dict[str, int]:
    """The matmul instructions (``dot``, or other ``opcodes``; fusions' counted where they are called) of a
    compiled step: how many sit in a conditional's branch (run only where the branch is taken) and how many
    outside one."""
    comps, entry = parse(hlo_text)
    out = {"in_conditional": 0, "outside": 0}
    seen: set[tuple[str, bool]] = set()

    def visit(name: str, branch: bool) -> None:
        if (name, branch) in seen or name not in comps:
            return
        seen.add((name, branch))
        for instr in comps[name].instrs.values():
            if instr.opcode in opcodes:
                out["in_conditional" if branch else "outside"] += 1
            for role, callee in callees(instr):
                visit(callee, branch or role in BRANCH)

    visit(entry, False)
    return out


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One ``dot`` instruction of a compiled step (in a fusion: counted where the fusion is called)."""

    name: str
    flops: int  # per run: 2 x output elements x contracted elements
    runs: int  # per step, as :func:`collectives` counts them (``taken``: a tick's branches on busy slots)
    loops: tuple[Loop, ...]  # enclosing while loops, outermost first
    branches: int  # conditional branches around it


def matmuls(hlo_text: str, taken: Taken | None = None) -> list[Matmul]:
    """Every matmul of a compiled step with its FLOPs and runs per step: the work it executes, where a pipeline
    tick's conditionals run on the busy slots given by ``taken`` (else at every tick)."""
    comps, entry = parse(hlo_text)
    out = []
    for name, (runs, loops, branches) in contexts(comps, entry, taken).items():
        comp = comps[name]
        for instr in comp.instrs.values():
            if instr.opcode != "dot":
                continue
            lhs = instr.operand_types[0] or comp.instrs[instr.operands[0]].type
            dims = shapes(lhs)[0][1]
            contracted = math.prod(dims[int(d)] for d in re.search(r"lhs_contracting_dims=\{([\d,]*)\}",
                                                                      instr.attrs).group(1).split(",") if d)
            flops = 2 * math.prod(shapes(instr.type)[0][1]) * contracted
            out.append(Matmul(instr.name, flops, runs, loops, branches))
    return out


_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}  # write no buffer of their own


def scoped_bytes(hlo_text: str, scope: str) -> int:
    """Bytes per step that the instructions traced under ``jax.named_scope(scope)`` write: each top-level
    instruction whose ``op_name`` holds ``scope`` as a path component, its result's bytes times its runs
    per step (the trip counts of the loops around it). A fusion counts as one instruction."""
    comps, entry = parse(hlo_text)
    fused = {c for comp in comps.values() for i in comp.instrs.values() if i.opcode == "fusion"
             for _, c in callees(i)}
    total = 0
    for name, (runs, *_) in contexts(comps, entry).items():
        if name in fused:
            continue
        for instr in comps[name].instrs.values():
            op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
            if instr.opcode not in _FREE and op_name and scope in op_name.group(1).split("/"):
                total += nbytes(instr.type) * runs
    return total
