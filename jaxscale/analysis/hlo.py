"""Read a compiled train step: its collectives, their wire bytes, and its memory.

:func:`collectives` parses the post-optimisation HLO text
(``compiled.as_text()``) into one :class:`Collective` per collective
instruction: all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute, their async ``-start`` forms (the ``-done`` is not
counted) and those nested in fusions or async computations. Each carries its
sizes, its device groups and the mesh axes that form them, the ``while``
loops around it (``lax.scan`` over layers, the microbatch scan) and so how many
times it runs per step, and its wire bytes per device per step by the rule of
FORMULAS.md: all-reduce 2·(n−1)/n·size, all-gather (n−1)/n·result size,
reduce-scatter (n−1)/n·operand size, all-to-all (n−1)/n·size,
collective-permute its size; times the runs.

XLA:CPU lowers a reduce-scatter as an all-reduce followed by a dynamic-slice
of each device's 1/n. An all-reduce operand whose every use is such a slice
(through bitcasts, copies, tuple elements and fusion parameters) is counted
in :attr:`Collective.sliced_bytes`; :attr:`Collective.reading` then says
``reduce-scatter (all-reduce+slice on this backend)`` and
:attr:`Collective.rs_wire_bytes` gives the reduce-scatter reading next to
the as-compiled :attr:`Collective.wire_bytes`.

Device ids in the HLO are positions in the step's device assignment, which
for a jitted step over a mesh is ``mesh.devices.flat``; groups are matched
against the groups each subset of the mesh's (non-trivial) axes forms.

:func:`summarize` sums by kind and by mesh axes, :func:`memory` reads
``compiled.memory_analysis()`` and :func:`step_report` puts them next to the
analytic figures of FORMULAS.md for a trainer's layout, as JSON-ready data.
The layer scan's collectives, with their sizes::

    found = collectives(compile_step(trainer).as_text(), trainer.mesh)
    for c in in_loop(found, trips=trainer.config.model.layers):
        print(c.phase, c.reading, c.axes, c.shapes, c.operand_bytes, c.runs, c.wire_bytes)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import warnings
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SLICED = "reduce-scatter (all-reduce+slice on this backend)"
DATA_AXES = ("data", "fsdp")

# Ops an all-reduce's result may pass through on its way to the dynamic-slice.
_TRANSPARENT = {"bitcast", "copy", "reshape", "transpose", "all-reduce-done"}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLS = re.compile(
    r"\b(calls|to_apply|body|branch_computations|true_computation|false_computation|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


# -- HLO text ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    operand_types: tuple[str, ...]  # as printed inline, "" where only the name is
    args: str
    attrs: str


@dataclasses.dataclass
class _Computation:
    name: str
    instrs: dict[str, _Instr] = dataclasses.field(default_factory=dict)

    def params(self) -> dict[int, str]:
        return {int(i.args): i.name for i in self.instrs.values() if i.opcode == "parameter"}

    def users(self) -> dict[str, list[tuple[_Instr, int]]]:
        out: dict[str, list[tuple[_Instr, int]]] = defaultdict(list)
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


def _tuple_items(type_: str) -> list[str]:
    """The top-level elements of a tuple type; ``[type_]`` for an array."""
    return _split_top(type_[1:-1]) if type_.startswith("(") else [type_]


def _shapes(type_: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The (dtype, dims) of every array in a (possibly nested tuple) type."""
    return tuple(
        (dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
        for dt, dims in _ARRAY.findall(type_)
        if dt != "token"
    )


def _bytes(type_: str) -> int:
    total = 0
    for dtype, dims in _shapes(type_):
        bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
        total += math.prod(dims) * bits // 8
    return total


def _parse_instr(line: str) -> _Instr | None:
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
        ref = re.search(r"%([\w.\-]+)\s*$", part)
        if ref:
            names.append(ref.group(1))
            types.append(part[: ref.start()].strip())
    return _Instr(m.group(1), type_, op.group(1), tuple(names), tuple(types), args, rest[close + 1 :])


def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    """The computations of an HLO module by name, and the entry's name."""
    comps: dict[str, _Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            head = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if head and not line.startswith(("HloModule", " ")):
                current = comps.setdefault(head.group(2), _Computation(head.group(2)))
                entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif (instr := _parse_instr(line)) is not None:
            current.instrs[instr.name] = instr
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callees(instr: _Instr) -> list[tuple[str, str]]:
    """(role, computation) for every computation an instruction calls."""
    return [
        (role, name.strip(" %")) for role, ref in _CALLS.findall(instr.attrs) for name in ref.strip("{}").split(",")
    ]


def _trip_count(instr: _Instr, comps: dict[str, _Computation]) -> int | None:
    """A while loop's trip count: ``known_trip_count``, else its condition's ``i < N`` (from 0)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", instr.attrs)
    if cond is None or cond.group(1) not in comps:
        return None
    scope = [comps[cond.group(1)]]
    scope += [comps[c] for i in scope[0].instrs.values() for _, c in _callees(i) if c in comps]
    instrs = [i for c in scope for i in c.instrs.values()]
    limits = {int(i.args) for i in instrs if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", i.type)}
    directions = {d for i in instrs if i.opcode == "compare" for d in re.findall(r"direction=(\w+)", i.attrs)}
    if len(limits) != 1 or len(directions) != 1 or not directions <= {"LT", "LE", "NE"}:
        return None
    return limits.pop() + (1 if directions == {"LE"} else 0)


# -- collectives -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` loop around a collective: the while instruction, its body, its trip count."""

    name: str
    body: str
    trips: int | None


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled step; bytes are per device."""

    name: str
    kind: str  # one of KINDS
    is_async: bool  # an ``-start`` form
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result array
    result_bytes: int
    operand_bytes: int
    groups: tuple[tuple[int, ...], ...]  # device groups (source-target pairs for a permute)
    n: int  # devices per group
    axes: tuple[str, ...] | None  # mesh axes the groups run over; None if no subset of axes forms them
    computation: str
    loops: tuple[Loop, ...]  # enclosing while loops, outermost first
    runs: int  # executions per step: the product of the loops' trip counts
    op_name: str  # the jax op(s) it came from (metadata)
    sliced_bytes: int = 0  # all-reduce operand bytes whose only use is each device's 1/n slice

    @property
    def size(self) -> int:
        """The bytes the wire formula applies to: the result for an all-gather, else the operand."""
        return self.result_bytes if self.kind == "all-gather" else self.operand_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, as compiled."""
        if self.kind == "collective-permute":
            return float(self.size * self.runs)
        factor = 2 if self.kind == "all-reduce" else 1
        return factor * (self.n - 1) / self.n * self.size * self.runs

    @property
    def rs_wire_bytes(self) -> float:
        """Wire bytes with the all-reduce+slice part read as the reduce-scatter GPU/TPU would emit."""
        if self.kind != "all-reduce":
            return self.wire_bytes
        return (self.n - 1) / self.n * (2 * self.size - self.sliced_bytes) * self.runs

    @property
    def reading(self) -> str:
        """The kind, or :data:`SLICED` for an all-reduce that is only ever sliced to 1/n."""
        return SLICED if self.kind == "all-reduce" and self.sliced_bytes == self.size > 0 else self.kind

    @property
    def phase(self) -> str:
        """``forward`` (under jax's ``jvp``), ``backward`` (``transpose``), ``mixed`` (a combined op) or
        ``update``: neither pass (the optimizer, or resharding the outputs, which carries no op name).

        A combined op's name is ``prefix/(a:b:c)``; each part is read with the prefix.
        """
        prefix, _, parts = self.op_name.partition("/(")
        names = [prefix + "/" + p for p in parts.removesuffix(")").split(":")] if parts else [prefix]
        phases = {"backward" if "transpose(" in n else "forward" if "jvp(" in n else "update" for n in names}
        return phases.pop() if len(phases) == 1 else "mixed"


def _groups(attrs: str, mesh_size: int) -> tuple[tuple[int, ...], ...]:
    """Parse ``replica_groups`` in any of XLA's printed forms into explicit device groups."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([\d,]+)", m.group(1) + "}"))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else tuple(range(len(dims)))
        return tuple(map(tuple, np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape).tolist()))
    m = re.search(r"replica_groups=\{(\{.*?\})?\}", attrs)
    if m and m.group(1):
        return tuple(_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m or "replica_groups" not in attrs:
        return (tuple(range(mesh_size)),)  # empty groups: every device
    raise ValueError(f"unrecognised replica_groups in {attrs[:200]!r}")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...]:
    """Groups of the ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` form (sub-axes ``'a':(1)2`` too)."""
    names, sizes = zip(*((n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", axes)), strict=True)
    ids = np.arange(math.prod(sizes))
    if device_ids:
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids.strip())
        if iota:
            dims = _ints(iota.group(1))
            ids = ids.reshape(dims).transpose(_ints(iota.group(2)) if iota.group(2) else range(len(dims)))
        else:
            ids = np.array(_ints(device_ids.replace("[", "").replace("]", "")))
    ids = ids.reshape(sizes)
    # Split every grouped axis into (before, sub-axis, after) and keep the grouped sub-axes last.
    split_sizes: list[int] = []
    grouped_dims: list[int] = []
    refs = [re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", r.strip()) for r in grouped.split(",") if r.strip()]
    for axis, size in zip(names, sizes, strict=True):
        subs = sorted((int(r.group(2) or 1), int(r.group(3) or size)) for r in refs if r.group(1) == axis)
        covered = 1
        for pre, sub in subs:
            if pre > covered:
                split_sizes.append(pre // covered)
            grouped_dims.append(len(split_sizes))
            split_sizes.append(sub)
            covered = pre * sub
        if covered < size:
            split_sizes.append(size // covered)
    ids = ids.reshape(split_sizes)
    rest = [d for d in range(len(split_sizes)) if d not in grouped_dims]
    group_size = math.prod(split_sizes[d] for d in grouped_dims)
    return tuple(map(tuple, ids.transpose(rest + grouped_dims).reshape(-1, group_size).tolist()))


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def mesh_axes(groups: tuple[tuple[int, ...], ...], mesh: Mesh, exact: bool = True) -> tuple[str, ...] | None:
    """The fewest mesh axes whose device groups equal ``groups`` (or, not ``exact``, contain each group).

    Device ids are positions in ``mesh.devices.flat``; axes of size 1 are never named. Groups that
    only part of an axis forms name it as XLA does, ``'fsdp:(pre)size'``: the ``size`` devices of the
    axis, split as ``[pre, size, rest]``, that differ in the middle coordinate.
    """
    # Every axis split into its prime factors, major to minor: (axis, factor's pre-size, factor).
    dims = []
    for name, size in mesh.shape.items():
        pre = 1
        for p in _prime_factors(size):
            dims.append((name, pre, p))
            pre *= p
    ids = np.arange(mesh.size).reshape([p for _, _, p in dims] or [1])
    wanted = {frozenset(g) for g in groups}
    for r in range(len(dims) + 1):
        for subset in itertools.combinations(range(len(dims)), r):
            size = math.prod(dims[i][2] for i in subset)
            if exact and size != len(groups[0]):
                continue
            rest = [i for i in range(ids.ndim) if i not in subset]
            formed = {frozenset(g) for g in ids.transpose(rest + list(subset)).reshape(-1, size).tolist()}
            if (wanted == formed) if exact else all(any(w <= f for f in formed) for w in wanted):
                return _axes_name([dims[i] for i in subset], mesh)
    return None


def _axes_name(dims: list[tuple[str, int, int]], mesh: Mesh) -> tuple[str, ...]:
    """Merge consecutive prime factors of one axis and name them (``'fsdp'`` or ``'fsdp:(1)2'``)."""
    runs: list[list[Any]] = []
    for name, pre, p in dims:
        if runs and runs[-1][0] == name and runs[-1][1] * runs[-1][2] == pre:
            runs[-1][2] *= p
        else:
            runs.append([name, pre, p])
    return tuple(name if size == mesh.shape[name] else f"{name}:({pre}){size}" for name, pre, size in runs)


def _sliced_bytes(comps: dict[str, _Computation], comp: _Computation, instr: _Instr, n: int) -> int:
    """Bytes of an all-reduce's operands whose every use is a dynamic-slice of 1/n of them."""
    users = comp.users()

    def only_slices(c: _Computation, name: str, c_users: dict, slices: list[int]) -> bool:
        if not c_users.get(name):
            return False
        for user, k in c_users[name]:
            if user.opcode in _TRANSPARENT:
                ok = only_slices(c, user.name, c_users, slices)
            elif user.opcode == "fusion":
                callee = comps[_callees(user)[0][1]]
                ok = only_slices(callee, callee.params()[k], callee.users(), slices)
            elif user.opcode == "dynamic-slice" and k == 0:
                slices.append(_bytes(user.type))
                ok = True
            else:
                ok = False
            if not ok:
                return False
        return True

    items = _tuple_items(instr.type)
    total = 0
    for index, item in enumerate(items):
        starts = [instr.name]
        if instr.type.startswith("("):
            starts = [
                u.name
                for u, _ in users[instr.name]
                if u.opcode == "get-tuple-element" and re.search(rf"\bindex={index}\b", u.attrs)
            ]
        slices: list[int] = []
        size = _bytes(item)
        if starts and all(only_slices(comp, s, users, slices) for s in starts) and all(b * n == size for b in slices):
            total += size
    return total


def _contexts(comps: dict[str, _Computation], entry: str) -> dict[str, tuple[int, tuple[Loop, ...]]]:
    """For each computation reached from the entry: runs per step and its enclosing loops."""
    out: dict[str, tuple[int, tuple[Loop, ...]]] = {}

    def visit(name: str, runs: int, loops: tuple[Loop, ...]) -> None:
        before = out.get(name, (0, loops))
        out[name] = (before[0] + runs, before[1])
        for instr in comps[name].instrs.values():
            for role, callee in _callees(instr):
                if callee not in comps:
                    continue
                if role == "body":
                    trips = _trip_count(instr, comps)
                    if trips is None:
                        warnings.warn(f"while {instr.name}: trip count unknown, counted once", stacklevel=2)
                    visit(callee, runs * (trips or 1), (*loops, Loop(instr.name, callee, trips)))
                else:
                    visit(callee, runs, loops)

    visit(entry, 1, ())
    return out


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Every collective of a compiled (post-optimisation) HLO module, in text order."""
    comps, entry = _parse(hlo_text)
    contexts = _contexts(comps, entry)
    axes_of: dict[tuple[Any, bool], tuple[str, ...] | None] = {}
    out = []
    for comp in comps.values():
        if comp.name not in contexts:
            continue
        runs, loops = contexts[comp.name]
        for instr in comp.instrs.values():
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            is_async = instr.opcode.endswith("-start")
            op_types = [t or comp.instrs[o].type for o, t in zip(instr.operands, instr.operand_types, strict=True)]
            operand_bytes = sum(_bytes(t) for t in op_types)
            result_type = instr.type
            if is_async and kind in ("all-gather", "collective-permute") and instr.type.startswith("("):
                result_type = _tuple_items(instr.type)[1]  # (operands, results[, contexts])
            groups = _groups(instr.attrs, mesh.size)
            n = 2 if kind == "collective-permute" else len(groups[0])
            exact = kind != "collective-permute"
            if (groups, exact) not in axes_of:
                axes_of[groups, exact] = mesh_axes(groups, mesh, exact)
            sliced = _sliced_bytes(comps, comp, instr, n) if kind == "all-reduce" and n > 1 else 0
            op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
            out.append(
                Collective(
                    name=instr.name,
                    kind=kind,
                    is_async=is_async,
                    shapes=_shapes(result_type),
                    result_bytes=_bytes(result_type),
                    operand_bytes=operand_bytes,
                    groups=groups,
                    n=n,
                    axes=axes_of[groups, exact],
                    computation=comp.name,
                    loops=loops,
                    runs=runs,
                    op_name=op_name.group(1) if op_name else "",
                    sliced_bytes=sliced,
                )
            )
    return out


def in_loop(found: list[Collective], trips: int | None = None) -> list[Collective]:
    """The collectives inside a while loop; with ``trips``, only where the innermost loop runs that often.

    ``in_loop(collectives(text, mesh), trips=config.model.layers)`` is the layer scan's
    (forward and backward) when the layer count differs from the microbatch count.
    """
    return [c for c in found if c.loops and (trips is None or c.loops[-1].trips == trips)]


def summarize(found: list[Collective]) -> dict[str, Any]:
    """Count, runs per step and wire bytes per device per step, in total, by kind and by mesh axes.

    Kinds are keyed by :attr:`Collective.reading`; ``rs_wire_bytes`` is the reduce-scatter reading.
    """

    def row() -> dict[str, float]:
        return {"count": 0, "runs": 0, "wire_bytes": 0.0, "rs_wire_bytes": 0.0}

    total, by_kind, by_axes = row(), defaultdict(row), defaultdict(row)
    for c in found:
        axes = "?" if c.axes is None else ",".join(c.axes) or "-"
        for r in (total, by_kind[c.reading], by_axes[axes]):
            r["count"] += 1
            r["runs"] += c.runs
            r["wire_bytes"] += c.wire_bytes
            r["rs_wire_bytes"] += c.rs_wire_bytes
    return {"total": total, "by_kind": dict(by_kind), "by_axes": dict(by_axes)}


# -- memory and the step report ----------------------------------------------------


def memory(compiled: Any) -> dict[str, int]:
    """Bytes per device from ``compiled.memory_analysis()``; total = arguments + outputs − aliased + temp + code."""
    m = compiled.memory_analysis()
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` (the largest shard's shape)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes(trainer: Any) -> dict[str, int]:
    """Bytes per device of the train state's parts, from their shardings."""
    state = trainer.abstract_state()
    return {
        "params": per_device_bytes(state.params),
        "opt_state": per_device_bytes(state.opt_state),
        "step": per_device_bytes(state.step),
        "batch": per_device_bytes(trainer.abstract_batch()),
    }


def _sharded_over(trainer: Any, kind: str) -> list[set[str]]:
    """For each parameter, the mesh axes (of size > 1) that split it in ``kind``'s layout."""
    return [
        {a for part in sharding.spec if part for a in ((part,) if isinstance(part, str) else part)}
        - {a for a, size in trainer.mesh.shape.items() if size == 1}
        for sharding in jax.tree.leaves(trainer.param_shardings(kind))
    ]


def formulas(trainer: Any) -> dict[str, Any]:
    """FORMULAS.md's figures for this layout, in bytes per device (jaxscale's fp32 convention).

    The ZeRO stage is read from the layout: 3 if the data-parallel axes split the parameters,
    2 if the gradients, 1 if the optimizer state. TP divides the tensor-sharded parameters Ψ_t by t
    (the rest, norms, stays whole); pipeline and expert splits are not modelled.
    """
    config, mesh = trainer.config, trainer.mesh
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_params)]
    psi = sum(sizes)
    pbytes = np.dtype(config.model.param_dtype).itemsize
    nd = mesh.shape["data"] * mesh.shape["fsdp"]
    t = mesh.shape["tensor"]
    psi_t = sum(n for n, axes in zip(sizes, _sharded_over(trainer, "params"), strict=True) if "tensor" in axes)
    local = psi - psi_t + psi_t / t
    ways = {
        kind: max(math.prod(mesh.shape[a] for a in axes & set(DATA_AXES)) for axes in _sharded_over(trainer, kind))
        for kind in ("params", "gradients", "optimizer")
    }
    stage = 3 if ways["params"] > 1 else 2 if ways["gradients"] > 1 else 1 if ways["optimizer"] > 1 else 0
    out: dict[str, Any] = {
        "convention": "fp32 master params 4Ψ + Adam moments 8Ψ + fp32 gradients 4Ψ (transient), each / its dp ways",
        "psi": psi,
        "psi_tensor_sharded": psi_t,
        "n_d": nd,
        "zero_stage": stage,
        "params_bytes": pbytes * local / ways["params"],
        "grads_bytes": pbytes * local / ways["gradients"],
        "adam_bytes": 2 * pbytes * local / ways["optimizer"],
        "dp_comm_bytes": (3 if stage == 3 else 2) * (nd - 1) / nd * local * pbytes,
    }
    if t > 1:
        m = config.train.microbatches
        b = config.train.global_batch // (nd * m)
        s = config.train.seq_len // mesh.shape["context"]
        bsh = b * s * config.model.embed * np.dtype(config.model.dtype).itemsize
        out["tp_comm_bytes"] = 4 * config.model.layers * m * 2 * (t - 1) / t * bsh  # 2 all-reduces fwd, 2 bwd
    return out


def compile_step(trainer: Any) -> Any:
    """The trainer's compiled step, from abstract state and batch (nothing is materialised)."""
    return trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()


def step_report(trainer: Any, compiled: Any = None) -> dict[str, Any]:
    """Compile the step (unless given) and report memory, collectives and the formulas; JSON-serialisable."""
    compiled = compile_step(trainer) if compiled is None else compiled
    report = {
        "rules": trainer.rules.name,
        "mesh": dict(trainer.mesh.shape),
        "backend": jax.default_backend(),
        "memory": memory(compiled),
        "state": state_bytes(trainer),
        "collectives": summarize(collectives(compiled.as_text(), trainer.mesh)),
        "formulas": formulas(trainer),
    }
    return json.loads(json.dumps(report))


# -- the inspect command -----------------------------------------------------------


def _spec_text(spec: Any) -> str:
    parts = [
        "None" if p is None else p if isinstance(p, str) else "(" + ",".join(p) + ")" for p in spec
    ]
    return "P(" + ", ".join(parts) + ")"


def param_rows(trainer: Any) -> list[dict[str, Any]]:
    """Every parameter: path, shape, logical axes, PartitionSpec (parameter and optimizer layouts), bytes per device."""
    state = trainer.abstract_state()
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    optimizer = jax.tree.leaves(trainer.param_shardings("optimizer"))
    axes = jax.tree.leaves(trainer.axes, is_leaf=lambda x: isinstance(x, tuple) and all(
        isinstance(a, str) or a is None for a in x))
    rows = []
    for (path, leaf), opt, logical in zip(leaves, optimizer, axes, strict=True):
        rows.append({
            "path": jax.tree_util.keystr(path, simple=True, separator="."),
            "shape": list(leaf.shape),
            "axes": list(logical),
            "spec": _spec_text(leaf.sharding.spec),
            "optimizer_spec": _spec_text(opt.spec),
            "bytes_per_device": math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize,
        })
    return rows


def grouped(found: list[Collective]) -> list[dict[str, Any]]:
    """Collectives grouped by (reading, mesh axes, phase): instructions, runs per step, wire bytes per device."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in found:
        axes = "?" if c.axes is None else ",".join(c.axes) or "-"
        row = rows.setdefault((c.reading, axes, c.phase), {
            "kind": c.reading, "axes": axes, "phase": c.phase, "count": 0, "runs": 0, "wire_bytes": 0.0,
            "rs_wire_bytes": 0.0,
        })
        row["count"] += 1
        row["runs"] += c.runs
        row["wire_bytes"] += c.wire_bytes
        row["rs_wire_bytes"] += c.rs_wire_bytes
    return sorted(rows.values(), key=lambda r: -r["wire_bytes"])


def reference(trainer: Any) -> dict[str, Any]:
    """FORMULAS.md's figures for this layout: state in both conventions, activations (Korthikanti), traffic."""
    from jaxscale import analytic

    config, mesh = trainer.config, trainer.mesh.shape
    m, t = config.model, config.train
    base = formulas(trainer)
    local = base["psi"] - base["psi_tensor_sharded"] + base["psi_tensor_sharded"] / mesh["tensor"]
    local /= mesh["stage"]
    stage, nd = base["zero_stage"], base["n_d"]
    out: dict[str, Any] = {
        "zero_stage": stage,
        "state_jaxscale": analytic.state_formula(local, nd, stage, np.dtype(m.param_dtype).itemsize),
        "state_playbook": {  # bf16 parameters and gradients, fp32 master copy + Adam (12Ψ)
            "params": 2 * local / (nd if stage >= 3 else 1),
            "gradients": 2 * local / (nd if stage >= 2 else 1),
            "optimizer": 12 * local / (nd if stage >= 1 else 1),
        },
        "dp_comm_bytes": base["dp_comm_bytes"],
    }
    rules = trainer.rules.table()

    def ways(name: str) -> int:
        return math.prod(mesh[a] for a in rules.get(name, ()))

    tensor, context, stages = mesh["tensor"], ways("length"), ways("layers")
    sp = "tensor" in rules.get("norm_length", ()) and tensor > 1
    rows = t.global_batch / t.microbatches / ways("batch")
    s = t.seq_len // context
    tokens = rows * s
    layers = m.layers / stages
    if m.remat == "full":
        per_layer = 2 * tokens * m.embed / (tensor if sp else 1)
    else:
        per_layer = analytic.korthikanti(m, tokens, s, tensor, sp)
    out["activations_korthikanti_bf16"] = per_layer * layers
    cbytes = np.dtype(m.dtype).itemsize
    if "tp_comm_bytes" in base:
        out["tp_comm_bytes"] = base["tp_comm_bytes"]
    if context > 1:
        kv = 2 * (context - 1) * rows * s * m.kv_heads * m.head_dim * cbytes
        out["cp_comm_bytes"] = 3 * kv * m.layers * t.microbatches  # forward, and twice that backward
    if stages > 1:
        pipeline = getattr(config, "pipeline", None)
        micro = (pipeline.microbatches or stages) if pipeline is not None else stages
        out["pp_comm_bytes"] = 2 * rows * s * m.embed * cbytes * t.microbatches  # 2·m·(b/m)·s·h per boundary
        out["pp_bubble"] = (stages - 1) / (micro * (pipeline.repeats if pipeline else 1) + stages - 1)
    moe = getattr(m, "moe", None)
    if moe is not None and ways("expert") > 1:
        ep = ways("expert")
        per_layer_ep = 2 * moe.top_k * rows * s * m.embed * cbytes * (ep - 1) / ep
        out["ep_comm_bytes"] = 2 * per_layer_ep * m.layers / moe.every_n_layers * t.microbatches
    return out


def inspect_report(trainer: Any, compiled: Any = None) -> dict[str, Any]:
    """:func:`step_report` plus the parameter table, grouped collectives, the analytic model and FORMULAS.md."""
    from jaxscale import analytic

    compiled = compile_step(trainer) if compiled is None else compiled
    report = step_report(trainer, compiled)
    prediction = analytic.predict_trainer(trainer)
    flows: dict[tuple[str, str], dict[str, Any]] = {}
    for f in prediction.flows:
        row = flows.setdefault((f.kind, ",".join(f.axes)), {"kind": f.kind, "axes": ",".join(f.axes),
                                                             "runs": 0.0, "wire_bytes": 0.0})
        row["runs"] += f.runs
        row["wire_bytes"] += f.wire_bytes
    report.update({
        "model": {k: getattr(trainer.config.model, k) for k in ("layers", "embed", "dtype", "param_dtype", "remat")},
        "params": param_rows(trainer),
        "collective_rows": grouped(collectives(compiled.as_text(), trainer.mesh)),
        "analytic": {
            "memory": prediction.memory,
            "collectives": sorted(flows.values(), key=lambda r: -r["wire_bytes"]),
            "comm": prediction.comm,
        },
        "reference": reference(trainer),
    })
    return json.loads(json.dumps(report))


def _mb(x: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def format_inspect(report: dict[str, Any]) -> str:
    """The report as text: parameters, memory, collectives, each next to its analytic and FORMULAS.md figure."""
    mesh = " x ".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1) or "one device"
    lines = [f"rules {report['rules']} on {mesh} ({report['backend']}); bytes per device", "", "parameters"]
    lines.append(f"  {'path':<26} {'shape':<22} {'logical axes':<36} {'PartitionSpec':<28} {'bytes':>10}")
    for p in report["params"]:
        axes = "(" + ", ".join(str(a) for a in p["axes"]) + ")"
        spec = p["spec"] + ("" if p["optimizer_spec"] == p["spec"] else f" opt {p['optimizer_spec']}")
        lines.append(f"  {p['path']:<26} {tuple(p['shape'])!s:<22} {axes:<36} {spec:<28} "
                     f"{_mb(p['bytes_per_device']):>10}")
    lines.append(f"  {'total':<115} {_mb(sum(p['bytes_per_device'] for p in report['params'])):>10}")

    mem, pred, ref = report["memory"], report["analytic"]["memory"], report["reference"]
    lines += ["", "memory (compiled: memory_analysis; analytic: jaxscale.analytic; FORMULAS.md)"]
    lines.append(f"  compiled  arguments {_mb(mem['argument'])}  outputs {_mb(mem['output'])}  aliased "
                 f"{_mb(mem['alias'])}  temporaries {_mb(mem['temp'])}  total {_mb(mem['total'])}")
    parts = "  ".join(f"{k} {_mb(v)}" for k, v in pred.items() if k != "total" and v)
    err = pred["total"] / mem["total"] - 1 if mem["total"] else 0.0
    lines.append(f"  analytic  {parts}  total {_mb(pred['total'])} ({100 * err:+.1f}%)")
    state = report["state"]
    lines.append(f"  state     compiled shardings: params {_mb(state['params'])}  optimizer {_mb(state['opt_state'])};"
                 f"  FORMULAS.md ZeRO-{ref['zero_stage']}, jaxscale fp32: "
                 + "  ".join(f"{k} {_mb(v)}" for k, v in ref["state_jaxscale"].items())
                 + ";  playbook (bf16 + fp32 master): "
                 + "  ".join(f"{k} {_mb(v)}" for k, v in ref["state_playbook"].items()))
    lines.append(f"  activations analytic {_mb(pred['activations'])}; FORMULAS.md (Korthikanti, bf16) "
                 f"{_mb(ref['activations_korthikanti_bf16'])}")

    lines += ["", "collectives of the compiled step (wire bytes per device per step; rs = reduce-scatter reading)"]
    lines.append(f"  {'kind':<51} {'mesh axes':<18} {'phase':<9} {'ops':>4} {'runs':>5} {'wire':>10} {'rs':>10}")
    for r in report["collective_rows"]:
        lines.append(f"  {r['kind']:<51} {r['axes']:<18} {r['phase']:<9} {r['count']:>4} {r['runs']:>5} "
                     f"{_mb(r['wire_bytes']):>10} {_mb(r['rs_wire_bytes']):>10}")
    by_kind = report["collectives"]["by_kind"]
    lines.append("  by kind: " + "  ".join(f"{k} {_mb(v['wire_bytes'])}" for k, v in by_kind.items()))
    total = report["collectives"]["total"]
    analytic_total = report["analytic"]["comm"]["total"]
    err = analytic_total / total["rs_wire_bytes"] - 1 if total["rs_wire_bytes"] else 0.0
    lines.append(f"  total: compiled {_mb(total['wire_bytes'])} (rs reading {_mb(total['rs_wire_bytes'])}); "
                 f"analytic {_mb(analytic_total)} ({100 * err:+.1f}% of the rs reading)")
    lines.append("  analytic by kind and axes: " + "  ".join(
        f"{r['kind']} [{r['axes']}] {_mb(r['wire_bytes'])}" for r in report["analytic"]["collectives"]))
    refs = [(k, v) for k, v in ref.items() if k.endswith("_comm_bytes")]
    lines.append("  FORMULAS.md: " + "  ".join(f"{k.removesuffix('_comm_bytes')} {_mb(v)}" for k, v in refs)
                 + (f"  pipeline bubble {ref['pp_bubble']:.2f}" if "pp_bubble" in ref else ""))
    if report["model"]["dtype"] != "float32" and report["backend"] == "cpu":
        lines += ["", f"note: XLA:CPU computes {report['model']['dtype']} matmuls in float32, so its activation "
                  "collectives and buffers are float32 where a GPU or TPU keeps them in "
                  f"{report['model']['dtype']}; compare with --set model.dtype=float32."]
    return "\n".join(lines)
