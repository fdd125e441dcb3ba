"""Read a compiled step's HLO text: its collectives, the mesh axes they run over, their wire bytes.

:func:`collectives` parses the post-optimisation HLO text
(``compiled.as_text()``) into one :class:`Collective` per collective
instruction: all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute, their async ``-start`` forms (the ``-done`` is not
counted) and those nested in fusions or async computations. Each carries its
sizes, its device groups and the mesh axes that form them, the ``while``
loops around it (``lax.scan`` over layers, the microbatch scan) and so how many
times it runs per step, and its wire bytes per device per step by the rule of
docs/formulas.md (:func:`wire_bytes`, which the analytic model counts by too):
all-reduce 2·(n−1)/n·size, all-gather (n−1)/n·result size, reduce-scatter
(n−1)/n·operand size, all-to-all (n−1)/n·size, collective-permute its size;
times the runs.

XLA:CPU lowers a reduce-scatter as an all-reduce followed by a dynamic-slice
of each device's 1/n. An all-reduce operand whose every use is such a slice
(through bitcasts, copies, tuple elements and fusion parameters) is counted
in :attr:`Collective.sliced_bytes`; :attr:`Collective.reading` then says
``reduce-scatter (all-reduce+slice on this backend)`` and
:attr:`Collective.rs_wire_bytes` gives the reduce-scatter reading next to
the as-compiled :attr:`Collective.wire_bytes`.

The dropless exchange (:mod:`jaxscale.parallel.exchange`) moves as many rows as the routing sends, known at
run time only: a ``ragged-all-to-all`` (GPU, TPU; kind :data:`RAGGED`) and XLA:CPU's chunked all-to-alls in a
loop whose trip count the text does not state. :func:`exchange_counted` counts both at equal load and says so.
The text is parsed by :mod:`jaxscale.analysis.hlo_text`.

Device ids in the HLO are positions in the step's device assignment, which
for a jitted step over a mesh is ``mesh.devices.flat``; groups are matched
against the groups each subset of the mesh's (non-trivial) axes forms.
:func:`summarize` sums by kind and by mesh axes. The layer scan's collectives,
with their sizes::

    found = collectives(compile_step(trainer).as_text(), trainer.mesh)
    for c in in_loop(found, trips=trainer.config.model.layers):
        print(c.phase, c.reading, c.axes, c.shapes, c.operand_bytes, c.runs, c.wire_bytes)

Nothing here imports jax: the mesh is read through ``mesh.shape`` and ``mesh.size``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxscale.analysis.hlo_groups import device_groups, ints, mesh_axes
from jaxscale.analysis.hlo_text import Computation, Instr, callees, nbytes, parse, shapes, trip_count, tuple_items

if TYPE_CHECKING:
    from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
RAGGED = "ragged-all-to-all"  # the dropless exchange's on GPU and TPU: its rows are the run's (exchange_counted)
SLICED = "reduce-scatter (all-reduce+slice on this backend)"

# Ops an all-reduce's result may pass through on its way to the dynamic-slice.
_TRANSPARENT = {"bitcast", "copy", "reshape", "transpose", "all-reduce-done"}


# -- collectives -------------------------------------------------------------------


def wire_bytes(kind: str, n: int, size: float, runs: float) -> float:
    """Bytes each device sends per step for a collective over ``n`` devices on ``size`` bytes, run ``runs`` times.

    all-reduce 2·(n−1)/n·size, all-gather (result), reduce-scatter (operand) and all-to-all
    (n−1)/n·size, collective-permute its size; a ragged all-to-all as an all-to-all of the device's own rows
    (its rows operand there, its output back; the rows that move are the run's: :func:`exchange_counted`).
    """
    if kind == "collective-permute":
        return float(size * runs)
    factor = 2 if kind == "all-reduce" else 1
    return factor * (n - 1) / n * size * runs


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
    kind: str  # one of KINDS, or RAGGED
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
    op_name: str  # the jax op(s) it came from (metadata; an argument's gather: its first user's, _op_name)
    sliced_bytes: int = 0  # all-reduce operand bytes whose only use is each device's 1/n slice

    @property
    def size(self) -> int:
        """The bytes the wire formula applies to: the result for an all-gather, else the operand."""
        return self.result_bytes if self.kind == "all-gather" else self.operand_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, as compiled."""
        return wire_bytes(self.kind, self.n, self.size, self.runs)

    @property
    def rs_wire_bytes(self) -> float:
        """Wire bytes with the all-reduce+slice part read as the reduce-scatter GPU/TPU would emit."""
        if self.kind != "all-reduce":
            return self.wire_bytes
        return (self.n - 1) / self.n * (2 * self.size - self.sliced_bytes) * self.runs

    @property
    def axes_text(self) -> str:
        """The mesh axes as ``a,b``; ``-`` for none, ``?`` where no subset of the mesh axes forms the groups."""
        return "?" if self.axes is None else ",".join(self.axes) or "-"

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














def _owners(c: Computation, user: Instr, groups: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a fusion slicing an all-reduce's result slices the devices of a group different parts: false where
    it reads the slice's index from a per-device table (a constant of one integer per device, indexed by the
    partition id) that gives every device of a group the same index (the slice follows other mesh axes alone,
    as a pipeline's stage sum sliced to a TP or FSDP shard)."""
    devices = sum(len(g) for g in groups)
    for name in user.operands:
        table = c.instrs.get(name)
        if (table is None or table.opcode != "constant" or "..." in table.args  # a long constant is elided
                or not re.fullmatch(rf"[su]\d+\[{devices}\]\S*", table.type)):
            continue
        index = ints(table.args.strip("{}"))
        if len(index) == devices and all(len({index[d] for d in g}) == 1 for g in groups):
            return False
    return True


def _sliced_bytes(comps: dict[str, Computation], comp: Computation, instr: Instr, n: int,
                  groups: tuple[tuple[int, ...], ...]) -> int:
    """Bytes of an all-reduce's operands whose every use is a dynamic-slice of 1/n of them, each device of a
    group its own (:func:`_owners`)."""
    users = comp.users()

    def only_slices(c: Computation, name: str, c_users: dict, slices: list[int]) -> bool:
        if not c_users.get(name):
            return False
        for user, k in c_users[name]:
            if user.opcode in _TRANSPARENT:
                ok = only_slices(c, user.name, c_users, slices)
            elif user.opcode == "fusion" and not _owners(c, user, groups):
                ok = False
            elif user.opcode == "fusion":
                callee = comps[callees(user)[0][1]]
                ok = only_slices(callee, callee.params()[k], callee.users(), slices)
            elif user.opcode == "dynamic-slice" and k == 0:
                slices.append(nbytes(user.type))
                ok = True
            else:
                ok = False
            if not ok:
                return False
        return True

    items = tuple_items(instr.type)
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
        size = nbytes(item)
        if starts and all(only_slices(comp, s, users, slices) for s in starts) and all(b * n == size for b in slices):
            total += size
    return total


@dataclasses.dataclass(frozen=True)
class Taken:
    """How often a pipeline tick's conditionals take their branch: ``runs`` of the ``trips`` trips of the loop of
    ticks (a stage's busy slots, :func:`busy_slots`). Without it a branch counts as run at every trip."""

    trips: int
    runs: int


def busy_slots(table: Any) -> Taken:
    """The busy slots of a pipeline's :class:`~jaxscale.parallel.schedules.Table` as :class:`Taken`: every stage
    runs v·m forward slots of the T ticks, as many backward slots and, split (ZB-H1), weight slots."""
    return Taken(table.ticks, table.m * table.v)


BRANCH = ("branch_computations", "true_computation", "false_computation")


def contexts(comps: dict[str, Computation], entry: str,
              taken: Taken | None = None) -> dict[str, tuple[int, tuple[Loop, ...], int]]:
    """For each computation reached from the entry: runs per step, its enclosing loops and how many conditional
    branches enclose it. With ``taken``, the branches of a conditional inside the first loop of ``taken.trips``
    trips (the ticks) run ``taken.runs`` of them; a conditional inside such a branch counts as the branch around it."""
    out: dict[str, tuple[int, tuple[Loop, ...], int]] = {}

    def visit(name: str, runs: int, loops: tuple[Loop, ...], branches: int, ticks: str) -> None:
        before = out.get(name, (0, loops, branches))
        out[name] = (before[0] + runs, before[1], before[2])
        for instr in comps[name].instrs.values():
            for role, callee in callees(instr):
                if callee not in comps:
                    continue
                if role == "body":
                    trips = trip_count(instr, comps)
                    if trips is None:
                        warnings.warn(f"while {instr.name}: trip count unknown, counted once", stacklevel=2)
                    inner = "in" if ticks == "out" and taken is not None and trips == taken.trips else ticks
                    visit(callee, runs * (trips or 1), (*loops, Loop(instr.name, callee, trips)), branches, inner)
                elif role in BRANCH and ticks == "in":  # taken on the busy slots only
                    visit(callee, runs // taken.trips * taken.runs, loops, branches + 1, "branch")
                elif role in BRANCH:
                    visit(callee, runs, loops, branches + 1, ticks)
                else:
                    visit(callee, runs, loops, branches, ticks)

    visit(entry, 1, (), 0, "out")
    return out


def _op_name(instr: Instr, users: Callable[[], dict[str, list[tuple[Instr, int]]]]) -> str:
    """The jax op a collective came from. jax 0.12 names the gather of a step argument (a ZeRO-3 weight) after
    the argument (``state.params['lm_head']``), where jax 0.10.2 names it after the op using it: such a name is
    read from its nearest user (up to four uses away) that names a jax op, so that
    :attr:`Collective.phase` reads it as that op's pass on both. ``users``: the computation's users map, made at
    most once per computation (:func:`collectives`)."""
    found = re.search(r'op_name="([^"]*)"', instr.attrs)
    name = found.group(1) if found else ""
    if not name or name.startswith("jit("):
        return name
    uses = users()
    frontier = [instr.name]
    for _ in range(4):
        nxt = []
        for user, _k in (pair for n in frontier for pair in uses.get(n, [])):
            used = re.search(r'op_name="(jit\([^"]*)"', user.attrs)
            if used:
                return used.group(1)
            nxt.append(user.name)
        frontier = nxt
    return name


def collectives(hlo_text: str, mesh: Mesh, taken: Taken | None = None) -> list[Collective]:
    """Every collective of a compiled (post-optimisation) HLO module, in text order; with ``taken`` those in a
    pipeline tick's conditionals run on its busy slots (:class:`Taken`), else at every tick."""
    comps, entry = parse(hlo_text)
    where = contexts(comps, entry, taken)
    axes_of: dict[tuple[Any, bool], tuple[str, ...] | None] = {}
    out = []
    for comp in comps.values():
        if comp.name not in where:
            continue
        runs, loops, _ = where[comp.name]
        users = functools.cache(comp.users)  # only where a collective carries an argument's name (_op_name)
        for instr in comp.instrs.values():
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS and kind != RAGGED:
                continue
            is_async = instr.opcode.endswith("-start")
            op_types = [t or comp.instrs[o].type for o, t in zip(instr.operands, instr.operand_types, strict=True)]
            operand_bytes = sum(nbytes(t) for t in op_types)
            if kind == RAGGED:  # the device's own rows: the smaller of its rows operand and its output
                operand_bytes = min(nbytes(op_types[0]), nbytes(instr.type))
            result_type = instr.type
            if is_async and kind in ("all-gather", "collective-permute") and instr.type.startswith("("):
                result_type = tuple_items(instr.type)[1]  # (operands, results[, contexts])
            groups = device_groups(instr.attrs, mesh.size)
            n = 2 if kind == "collective-permute" else len(groups[0])
            exact = kind != "collective-permute"
            if (groups, exact) not in axes_of:
                axes_of[groups, exact] = mesh_axes(groups, mesh, exact)
            sliced = _sliced_bytes(comps, comp, instr, n, groups) if kind == "all-reduce" and n > 1 else 0
            out.append(
                Collective(
                    name=instr.name,
                    kind=kind,
                    is_async=is_async,
                    shapes=shapes(result_type),
                    result_bytes=nbytes(result_type),
                    operand_bytes=operand_bytes,
                    groups=groups,
                    n=n,
                    axes=axes_of[groups, exact],
                    computation=comp.name,
                    loops=loops,
                    runs=runs,
                    op_name=_op_name(instr, users),
                    sliced_bytes=sliced,
                )
            )
    return out


def _exchange_trips(c: Collective, comps: dict[str, Computation]) -> int | None:
    """The trips at equal load of the dropless exchange's chunk loop around all-to-all ``c``: ``ceil(R / (ep·C))``,
    ``R`` the rows per destination its buffer [ep, R, h] holds (every choice of the device), ``C`` the rows per
    trip; None where ``c`` is not in such a loop."""
    if c.kind != "all-to-all" or not c.loops or c.loops[-1].trips is not None or not c.shapes:
        return None
    dims = c.shapes[0][1]
    ep, chunk, width = c.n, dims[-2], dims[-1]
    loop = next((i for comp in comps.values() for i in comp.instrs.values() if i.name == c.loops[-1].name), None)
    rows = [d[1] for _, d in shapes(loop.type if loop else "") if len(d) == 3 and (d[0], d[2]) == (ep, width)
            and d[1] % chunk == 0]
    return math.ceil(max(rows) / (ep * chunk)) if rows else None


def exchange_counted(hlo_text: str, found: list[Collective]) -> tuple[list[Collective], str]:
    """``found`` with the dropless exchange (:mod:`jaxscale.parallel.exchange`) counted at equal load, and one line
    saying how; the line is empty where the step has no exchange.

    The rows it moves are the routing's at run time: XLA:CPU's chunked all-to-alls run in a loop whose trip count
    is the largest count any device sends a shard, a ``ragged-all-to-all`` (GPU, TPU) moves the exchanged counts'
    rows. Both are counted as ``k·b·s·h·bytes·(ep−1)/ep`` per exchange (the formula at equal load): the loop at
    :func:`_exchange_trips`, the ragged one as an all-to-all of all its rows; the run moves that times its routing
    imbalance (max/mean rows to a shard), at most ``ep`` times.
    """
    comps, _ = parse(hlo_text)
    out, counted, most = [], 0, 0
    for c in found:
        trips = _exchange_trips(c, comps)
        if trips is not None:
            c = dataclasses.replace(c, runs=c.runs * trips)
        if trips is not None or c.kind == RAGGED:
            counted, most = counted + 1, max(most, c.n)
        out.append(c)
    if not counted:
        return out, ""
    return out, (f"the dropless exchange's {counted} collectives counted at equal load, k·b·s·h·bytes·(ep−1)/ep each "
                 f"(the formula's; their rows are the routing's at run time: that times its imbalance, max/mean rows "
                 f"to a shard, at most {most}x)")


def in_loop(found: list[Collective], trips: int | None = None) -> list[Collective]:
    """The collectives inside a while loop; with ``trips``, only where the innermost loop runs that often.

    ``in_loop(collectives(text, mesh), trips=config.model.layers)`` is the layer scan's
    (forward and backward) when the layer count differs from the microbatch count.
    """
    return [c for c in found if c.loops and (trips is None or c.loops[-1].trips == trips)]


def _zero() -> dict[str, float]:
    return {"count": 0, "runs": 0, "wire_bytes": 0.0, "rs_wire_bytes": 0.0}


def _add(row: dict[str, Any], c: Collective) -> None:
    row["count"] += 1
    row["runs"] += c.runs
    row["wire_bytes"] += c.wire_bytes
    row["rs_wire_bytes"] += c.rs_wire_bytes


def summarize(found: list[Collective]) -> dict[str, Any]:
    """Count, runs per step and wire bytes per device per step, in total, by kind and by mesh axes.

    Kinds are keyed by :attr:`Collective.reading`, mesh axes by :attr:`Collective.axes_text`;
    ``rs_wire_bytes`` is the reduce-scatter reading.
    """
    total, by_kind, by_axes = _zero(), defaultdict(_zero), defaultdict(_zero)
    for c in found:
        for row in (total, by_kind[c.reading], by_axes[c.axes_text]):
            _add(row, c)
    return {"total": total, "by_kind": dict(by_kind), "by_axes": dict(by_axes)}


def grouped(found: list[Collective]) -> list[dict[str, Any]]:
    """Collectives grouped by (reading, mesh axes, phase): instructions, runs per step, wire bytes per device."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in found:
        key = (c.reading, c.axes_text, c.phase)
        if key not in rows:
            rows[key] = {"kind": c.reading, "axes": c.axes_text, "phase": c.phase, **_zero()}
        _add(rows[key], c)
    return sorted(rows.values(), key=lambda r: -r["wire_bytes"])








# -- bytes written ----------------------------------------------------------------



