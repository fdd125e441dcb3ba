"""Which mesh axes a collective runs over: its device groups read from the HLO attributes and matched to the mesh.

Device ids in the HLO are positions in the step's device assignment, for a jitted step over a mesh
``mesh.devices.flat``. A collective's groups are given as explicit lists (``replica_groups={{0,1},{2,3}}``),
as an iota form (``[2,4]<=[4,2]T(1,0)``) or for a permute as source-target pairs; :func:`mesh_axes` names the
mesh axes (or parts of an axis) whose devices form exactly those groups. No jax: the mesh is read through
``mesh.shape`` and ``mesh.size``.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh


def device_groups(attrs: str, mesh_size: int) -> tuple[tuple[int, ...], ...]:
    """Parse ``replica_groups`` in any of XLA's printed forms into explicit device groups."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([\d,]+)", m.group(1) + "}"))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape, dims = ints(m.group(1)), ints(m.group(2))
        perm = ints(m.group(3)) if m.group(3) else tuple(range(len(dims)))
        return tuple(map(tuple, np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape).tolist()))
    m = re.search(r"replica_groups=\{(\{.*?\})?\}", attrs)
    if m and m.group(1):
        return tuple(ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m or "replica_groups" not in attrs:
        return (tuple(range(mesh_size)),)  # empty groups: every device
    raise ValueError(f"unrecognised replica_groups in {attrs[:200]!r}")


def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...]:
    """Groups of the ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` form (sub-axes ``'a':(1)2`` too)."""
    names, sizes = zip(*((n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", axes)), strict=True)
    ids = np.arange(math.prod(sizes))
    if device_ids:
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids.strip())
        if iota:
            dims = ints(iota.group(1))
            ids = ids.reshape(dims).transpose(ints(iota.group(2)) if iota.group(2) else range(len(dims)))
        else:
            ids = np.array(ints(device_ids.replace("[", "").replace("]", "")))
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
