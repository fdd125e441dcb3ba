"""Rules tables: logical axis names -> mesh axes, as data.

A rules file (``configs/rules/<name>.yaml``) has up to three sections::

    rules:        # parameters and activations (required)
      batch: [data, fsdp]
      embed: fsdp
      mlp: tensor
      layers: null
    optimizer:    # optional: overrides for the optimizer state (ZeRO-1)
      embed: data
    gradients:    # optional: overrides for the gradient accumulator (ZeRO-2)
      embed: data

Each logical name maps to one mesh axis, a list of them, or null
(replicated). ``optimizer`` and ``gradients`` override single names of
``rules``; everything they do not mention is laid out as the parameters. A
model may only use names that ``rules`` mentions: an unknown name is an error,
never a silent replication.

Activations are constrained by logical name through :func:`constrain`, which
reads the rules and mesh set by :func:`use_rules` (a no-op outside it, so the
model also runs unsharded).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.config import MESH_AXES, ConfigError, _read_yaml, resolve_named

Axes = tuple[str | None, ...]
KINDS = ("params", "optimizer", "gradients")


def _mesh_axes(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: expected a mesh axis, a list of them, or null; got {value!r}")
    for n in names:
        if n not in MESH_AXES:
            raise ConfigError(f"{where}: '{n}' is not a mesh axis ({', '.join(MESH_AXES)})")
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class Rules:
    """A parsed rules table; ``name`` is for messages and logs."""

    name: str
    params: Mapping[str, tuple[str, ...]]
    optimizer: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    gradients: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> Rules:
        unknown = set(data) - {"rules", "optimizer", "gradients", "description"}
        if unknown:
            raise ConfigError(f"rules '{name}': unknown section '{sorted(unknown)[0]}'")
        if not isinstance(data.get("rules"), dict):
            raise ConfigError(f"rules '{name}': a 'rules' mapping is required")
        sections = {}
        for section in ("rules", "optimizer", "gradients"):
            table = data.get(section) or {}
            if not isinstance(table, dict):
                raise ConfigError(f"rules '{name}' {section}: expected a mapping of logical axes, got {table!r}")
            sections[section] = {
                str(k): _mesh_axes(v, f"rules '{name}' {section}.{k}") for k, v in table.items()
            }
        for section in ("optimizer", "gradients"):
            for k in sections[section]:
                if k not in sections["rules"]:
                    raise ConfigError(f"rules '{name}' {section}.{k}: not in the 'rules' section")
        return cls(name, sections["rules"], sections["optimizer"], sections["gradients"])

    @classmethod
    def load(cls, name_or_path: str) -> Rules:
        path = resolve_named(name_or_path, "rules")
        return cls.from_dict(Path(path).stem, _read_yaml(path))

    def table(self, kind: str = "params") -> Mapping[str, tuple[str, ...]]:
        if kind == "params":
            return self.params
        return {**self.params, **getattr(self, kind)}

    def spec(self, axes: Axes, kind: str = "params") -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions have these logical names."""
        table = self.table(kind)
        used: dict[str, str] = {}
        parts: list[Any] = []
        for name in axes:
            if name is None:
                parts.append(None)
                continue
            if name not in table:
                raise ConfigError(f"logical axis '{name}' is not in rules table '{self.name}'")
            mesh_axes = table[name]
            for m in mesh_axes:
                if m in used:
                    raise ConfigError(
                        f"rules '{self.name}': mesh axis '{m}' shards both '{used[m]}' and '{name}' of {axes}"
                    )
                used[m] = name
            parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return PartitionSpec(*parts)


def is_axes(x: Any) -> bool:
    """True for a tuple of logical axis names (a leaf of a tree of axes)."""
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def param_name(path: Any) -> str:
    """The dotted name of a parameter's tree path: ``blocks.attn.wq``."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def named_params(params: Any, axes: Any) -> list[tuple[str, Any, Axes]]:
    """Every parameter leaf with its dotted name and its logical axes, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [
        (param_name(path), leaf, tuple(a))
        for (path, leaf), a in zip(flat, jax.tree.leaves(axes, is_leaf=is_axes), strict=True)
    ]


def spec_axes(part: str | tuple[str, ...] | PartitionSpec | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple), or of a whole PartitionSpec."""
    if isinstance(part, PartitionSpec):
        return tuple(a for entry in part for a in spec_axes(entry))
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def shard_count(spec: PartitionSpec, mesh: Mesh) -> list[int]:
    """How many ways each dimension is split."""
    return [math.prod(mesh.shape[n] for n in spec_axes(part)) for part in spec]


def gather_shards(w: jax.Array, spec: PartitionSpec, keep: tuple[str, ...] = ()) -> jax.Array:
    """Inside a manual ``shard_map``: all-gather ``w`` over every mesh axis of ``spec`` not in ``keep``.

    The FSDP gather of a weight whose other shards (tensor, expert) stay local.
    """
    for dim, part in enumerate(spec):
        others = tuple(n for n in spec_axes(part) if n not in keep)
        if others:
            w = jax.lax.all_gather(w, others, axis=dim, tiled=True)
    return w


def check_divisible(name: str, shape: tuple[int, ...], axes: Axes, spec: PartitionSpec, mesh: Mesh) -> None:
    """Raise if a dimension is not divisible by the mesh axes it is sharded over."""
    for dim, (size, logical, ways, part) in enumerate(zip(shape, axes, shard_count(spec, mesh), spec, strict=True)):
        if size % ways:
            raise ConfigError(
                f"{name}: dimension {dim} ('{logical}', size {size}) is not divisible by "
                f"mesh axes {part} of size {ways}"
            )


def named_sharding(mesh: Mesh, rules: Rules, axes: Axes, kind: str = "params") -> NamedSharding:
    return NamedSharding(mesh, rules.spec(axes, kind))


_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxscale_rules", default=None
)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within this block, :func:`constrain` shards activations by ``rules`` on ``mesh``."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) set by :func:`use_rules`, if any."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
    """Constrain an activation's sharding by the logical names of its dimensions."""
    current = _ACTIVE.get()
    if current is None:
        return x
    mesh, rules = current
    if x.ndim != len(axes):
        raise ValueError(f"constrain: array of rank {x.ndim} given {len(axes)} axis names {axes}")
    spec = rules.spec(axes)
    check_divisible(f"activation {axes}", x.shape, axes, spec, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
