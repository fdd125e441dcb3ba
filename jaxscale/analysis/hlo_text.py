"""Parse a compiled step's HLO text: its computations, their instructions, shapes and bytes, loop trip counts.

:func:`parse` reads the post-optimisation text (``compiled.as_text()``) into :class:`Computation` objects of
:class:`Instr`; :func:`callees` names the computations an instruction calls (fusions, loop bodies, branches);
:func:`trip_count` reads a ``while`` loop's trip count where the text states it; :func:`shapes` and
:func:`nbytes` read a type. :mod:`jaxscale.analysis.hlo` finds the collectives in them. No jax.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLS = re.compile(
    r"\b(calls|to_apply|body|branch_computations|true_computation|false_computation|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    operand_types: tuple[str, ...]  # as printed inline, "" where only the name is
    args: str
    attrs: str


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = dataclasses.field(default_factory=dict)

    def params(self) -> dict[int, str]:
        return {int(i.args): i.name for i in self.instrs.values() if i.opcode == "parameter"}

    def users(self) -> dict[str, list[tuple[Instr, int]]]:
        out: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
        for instr in self.instrs.values():
            for k, op in enumerate(instr.operands):
                out[op].append((instr, k))
        return out


def _close(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced brackets in {s!r}")


def _split_top(s: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:j].strip())
            start = j + 1
    if s[start:].strip():
        parts.append(s[start:].strip())
    return parts


def tuple_items(type_: str) -> list[str]:
    """The top-level elements of a tuple type; ``[type_]`` for an array."""
    return _split_top(type_[1:-1]) if type_.startswith("(") else [type_]


def shapes(type_: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The (dtype, dims) of every array in a (possibly nested tuple) type."""
    return tuple(
        (dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
        for dt, dims in _ARRAY.findall(type_)
        if dt != "token"
    )


def nbytes(type_: str) -> int:
    total = 0
    for dtype, dims in shapes(type_):
        bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
        total += math.prod(dims) * bits // 8
    return total


def _parse_instr(line: str) -> Instr | None:
    line = re.sub(r"/\*.*?\*/", "", line)
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if m is None:
        return None
    rest = line[m.end() :]
    end = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    type_, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _close(rest, op.end() - 1)
    args = rest[op.end() : close]
    names, types = [], []
    for part in _split_top(args):
        # "f32[4]{0} %x" (compiled), or a bare "x" (lowered: dialect="hlo")
        ref = re.search(r"%([\w.\-]+)\s*$", part) or re.fullmatch(r"([A-Za-z_][\w.\-]*)", part)
        if ref:
            names.append(ref.group(1))
            types.append(part[: ref.start()].strip())
    return Instr(m.group(1), type_, op.group(1), tuple(names), tuple(types), args, rest[close + 1 :])


def parse(hlo_text: str) -> tuple[dict[str, Computation], str]:
    """The computations of an HLO module by name, and the entry's name."""
    comps: dict[str, Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            head = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if head and not line.startswith(("HloModule", " ")):
                current = comps.setdefault(head.group(2), Computation(head.group(2)))
                entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif (instr := _parse_instr(line)) is not None:
            current.instrs[instr.name] = instr
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def callees(instr: Instr) -> list[tuple[str, str]]:
    """(role, computation) for every computation an instruction calls."""
    return [
        (role, name.strip(" %")) for role, ref in _CALLS.findall(instr.attrs) for name in ref.strip("{}").split(",")
    ]


def trip_count(instr: Instr, comps: dict[str, Computation]) -> int | None:
    """A while loop's trip count: ``known_trip_count``, else its condition's ``i < N`` (from 0)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", instr.attrs)
    if cond is None or cond.group(1) not in comps:
        return None
    scope = [comps[cond.group(1)]]
    scope += [comps[c] for i in scope[0].instrs.values() for _, c in callees(i) if c in comps]
    instrs = [i for c in scope for i in c.instrs.values()]
    limits = {int(i.args) for i in instrs if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", i.type)}
    directions = {d for i in instrs if i.opcode == "compare" for d in re.findall(r"direction=(\w+)", i.attrs)}
    if len(limits) != 1 or len(directions) != 1 or not directions <= {"LT", "LE", "NE"}:
        return None
    return limits.pop() + (1 if directions == {"LE"} else 0)
