"""A rules table on a mesh: every question about where a logical axis lives, answered in one place (no jax).

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
model may only use names that ``rules`` mentions: an unknown name is an error
(:meth:`Rules.partition`), never a silent replication.

A :class:`Layout` is such a table on mesh axis sizes (a plain mapping, so the
analytic model asks it for any device count). It answers what the parallel
modules need: the mesh axes of size > 1 that split a name, how many ways, the
sequence-parallel, context, expert and tensor axes, the pipeline stages, the
batch shards; and :meth:`Layout.validate` raises every layout error of an
experiment once, when the trainer is built. :mod:`jaxscale.layout.sharding` turns a
layout into jax shardings; nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxscale.config import refusals
from jaxscale.config.axes import LOGICAL_AXES, WHOLE_AXES
from jaxscale.config.read import MESH_AXES, Config, ConfigError, PipelineConfig, read_yaml, resolve_named
from jaxscale.layout import stage_plan
from jaxscale.layout.stage_plan import STAGE, TOKENS, Blocks

Axes = tuple[str | None, ...]  # logical names of an array's dimensions (None: never sharded)
Part = str | tuple[str, ...] | None  # one entry of a PartitionSpec: no mesh axis, one, or several
Table = Mapping[str, tuple[str, ...]]  # logical name -> mesh axes
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


def is_axes(x: Any) -> bool:
    """True for a tuple of logical axis names (a leaf of a tree of axes)."""
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def part_axes(part: Part) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


@dataclasses.dataclass(frozen=True)
class Rules:
    """A parsed rules table; ``name`` is for messages and logs."""

    name: str
    params: Table
    optimizer: Table = dataclasses.field(default_factory=dict)
    gradients: Table = dataclasses.field(default_factory=dict)
    muon: Table = dataclasses.field(default_factory=dict)  # Muon's owner layout (jaxscale/training/muon_layout.py)

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> Rules:
        unknown = set(data) - {"rules", "optimizer", "gradients", "muon", "description"}
        if unknown:
            raise ConfigError(f"rules '{name}': unknown section '{sorted(unknown)[0]}'")
        if not isinstance(data.get("rules"), dict):
            raise ConfigError(f"rules '{name}': a 'rules' mapping is required")
        sections = {}
        for section in ("rules", "optimizer", "gradients", "muon"):
            table = data.get(section) or {}
            if not isinstance(table, dict):
                raise ConfigError(f"rules '{name}' {section}: expected a mapping of logical axes, got {table!r}")
            sections[section] = {
                str(k): _mesh_axes(v, f"rules '{name}' {section}.{k}") for k, v in table.items()
            }
        typos = [k for k in sections["rules"] if k not in LOGICAL_AXES]
        if typos:
            raise ConfigError(
                f"rules '{name}' rules.{typos[0]}: not a logical axis (one of: {', '.join(LOGICAL_AXES)})"
            )
        for section in ("optimizer", "gradients", "muon"):
            for k in sections[section]:
                if k not in sections["rules"]:
                    raise ConfigError(f"rules '{name}' {section}.{k}: not in the 'rules' section")
        return cls(name, sections["rules"], sections["optimizer"], sections["gradients"], sections["muon"])

    @classmethod
    def load(cls, name_or_path: str) -> Rules:
        path = resolve_named(name_or_path, "rules")
        return cls.from_dict(Path(path).stem, read_yaml(path))

    def table(self, kind: str = "params") -> Table:
        if kind == "params":
            return self.params
        return {**self.params, **getattr(self, kind)}

    def partition(self, axes: Axes, kind: str = "params") -> tuple[Part, ...]:
        """The PartitionSpec entries of an array whose dimensions have these logical names.

        Raises for a name the table lacks (but :data:`~jaxscale.config.axes.WHOLE_AXES`, whole where
        unmapped) and for a mesh axis that would split two dimensions.
        """
        table = self.table(kind)
        used: dict[str, str] = {}
        parts: list[Part] = []
        for name in axes:
            if name is None or (name in WHOLE_AXES and name not in table):
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
        return tuple(parts)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Inside a pipeline stage's loop (:mod:`jaxscale.parallel.pipeline`): what the code traced there must know.

    The loop recomputes each layer itself (no remat policy applies), ring attention runs its per-device kernel
    over the ``ring`` axes, already manual, where the ``tensor`` axes are manual too (these are fields of
    :class:`jaxscale.layout.stage_plan.StagePlan`) the projections of :mod:`jaxscale.parallel.sequence` write
    TP's and SP's collectives themselves, over the block parameters' logical names in ``split``, and an MoE
    layer with explicit experts (``model.moe.impl=shard_map``) runs expert parallelism's per-device body over
    ``expert`` (:mod:`jaxscale.parallel.expert`). While a split schedule's B or W slot traces a unit,
    ``weights`` runs its weight matmuls (:func:`jaxscale.precision.policy.einsum`)."""

    manual: tuple[str, ...]  # the mesh axes the loop is manual over: stage, then data, context and tensor axes
    ring: tuple[str, ...]  # of them, the context axes (ring attention's ring)
    tensor: tuple[str, ...] = ()  # of them, TP's: they split the blocks' parameters, each device keeps its shard
    split: tuple[str, ...] = ()  # the logical names of block parameter dimensions that ``tensor`` splits
    sequence: tuple[str, ...] = ()  # of ``tensor``, SP's: the residual stream split on the sequence over them
    weights: Any = None  # in a split backward's unit, how weight matmuls run (:mod:`jaxscale.parallel.weight_split`)
    expert: tuple[str, ...] = ()  # of the row axes, EP's: each device keeps its experts, tokens exchanged over them
    expert_mlp: tuple[str, ...] = ()  # of ``tensor``, those splitting the experts' MLP (their outputs partial sums)
    ulysses: tuple[str, ...] = ()  # of ``ring``, those attention all-to-alls over (the rules' ``ulysses``)

    @property
    def tokens(self) -> tuple[str, ...]:
        """The manual axes besides ``stage`` over which a microbatch's tokens are spread (each device holds its
        own rows or part of the sequence): an MoE layer's routing statistics are sums over them."""
        return tuple(a for a in self.manual[1:] if a not in self.tensor or a in self.sequence)


@dataclasses.dataclass(frozen=True)
class Layout:
    """``rules`` on a mesh of axis sizes ``mesh`` (mesh axis -> size; axes it lacks have size 1).

    The queries are lenient (a name the table lacks is replicated); :meth:`partition` is strict.
    While a step is traced (:func:`jaxscale.layout.sharding.use_rules`) the layout also carries the pipeline's
    settings, and inside a pipeline stage's loop the :class:`Stage`.
    """

    rules: Rules
    mesh: Mapping[str, int]
    pipeline: PipelineConfig | None = None
    stage: Stage | None = None

    @property
    def name(self) -> str:
        return self.rules.name

    def partition(self, axes: Axes, kind: str = "params") -> tuple[Part, ...]:
        """The PartitionSpec entries of an array with these logical names (:meth:`Rules.partition`)."""
        return self.rules.partition(axes, kind)

    def axes_of(self, name: str, kind: str = "params") -> tuple[str, ...]:
        """Every mesh axis the rules map ``name`` to, of any size (none if the table lacks it)."""
        return self.rules.table(kind).get(name, ())

    def size(self, axes: Iterable[str]) -> int:
        """The number of devices along these mesh axes together."""
        return math.prod(self.mesh.get(a, 1) for a in axes)

    def mesh_axes(self, names: Iterable[str | None], kind: str = "params") -> tuple[str, ...]:
        """The mesh axes of size > 1 that split an array with these logical names, in order, once each."""
        out: list[str] = []
        for name in names:
            for axis in self.axes_of(name, kind) if name else ():
                if self.mesh.get(axis, 1) > 1 and axis not in out:
                    out.append(axis)
        return tuple(out)

    def ways(self, names: Iterable[str | None], kind: str = "params") -> int:
        """Into how many shards the rules split an array with these logical names."""
        return self.size(self.mesh_axes(names, kind))

    # -- what each parallelism asks ------------------------------------------------------

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the batch: each device's sequences differ along them."""
        return self.mesh_axes(("batch",))

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split."""
        return self.size(self.batch_axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the tokens (batch and sequence): each holds different data."""
        return self.mesh_axes(TOKENS)

    def data_axes(self, params: Iterable[Axes]) -> tuple[str, ...]:
        """The leading mesh axes of ``batch`` (of any size) that split none of these parameters' axes.

        Over them each device holds every such parameter whole: its gradient is a sum over them.
        """
        held = {a for axes in params for name in axes if name for a in self.axes_of(name)}
        out: list[str] = []
        for axis in self.axes_of("batch"):
            if axis in held:
                break
            out.append(axis)
        return tuple(out)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the sequence but not the batch: context parallelism."""
        batch = self.batch_axes
        return tuple(a for a in self.mesh_axes(("length",)) if a not in batch)

    @property
    def ulysses_axes(self) -> tuple[str, ...]:
        """The mesh axes of ``length`` over which attention trades the sequence for the heads (all-to-all)."""
        return self.mesh_axes(("ulysses",))

    @property
    def ring_axes(self) -> tuple[str, ...]:
        """The mesh axes of ``length`` that form the ring of ring attention (all of them but Ulysses')."""
        return tuple(a for a in self.mesh_axes(("length",)) if a not in self.ulysses_axes)

    @property
    def ring_size(self) -> int:
        """Devices that hold one sequence's blocks between them (the ring of ring attention)."""
        return self.size(self.ring_axes)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Sequence parallelism's mesh axes: they split ``norm_length`` but not ``length``."""
        inner = self.axes_of("length")
        return tuple(a for a in self.mesh_axes(("norm_length",)) if a not in inner)

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Expert parallelism's mesh axes: they split the experts."""
        return self.mesh_axes(("expert",))

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        """Tensor parallelism's mesh axes: they split the attention heads or the MLP."""
        return self.mesh_axes(("heads", "kv_heads", "mlp"))

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the layer stack."""
        return self.mesh_axes(("layers",))

    @property
    def pipelined(self) -> bool:
        """Whether the rules put ``layers`` on the ``stage`` axis (size > 1): the pipeline loop runs."""
        return STAGE in self.stage_axes

    @property
    def stages(self) -> int:
        """Pipeline stages: the size of ``stage`` when the layers are on it, else 1."""
        return self.mesh[STAGE] if self.pipelined else 1

    # -- validation ----------------------------------------------------------------------

    def validate(self, config: Config, blocks: Blocks | None = None) -> None:
        """Raise the first layout error of ``config`` on this layout (``model.attention`` resolved): the refusal
        table's rows (:mod:`jaxscale.config.refusals`, the config's and the layout's; a pipeline stage's plan for
        the model's ``blocks``, default a built-in model's, :meth:`~jaxscale.layout.stage_plan.Blocks.of`, says
        which axes explicit experts would leave to the partitioner), then the rules' own."""
        plan = stage_plan.plan(self, config.pipeline, blocks or Blocks.of(config.model))
        free = plan.free if self.pipelined and plan.experts == "shard_map" else ()
        refusals.check(refusals.Context(config, self, experts_free=free))
        if self.pipelined:
            stage_plan.check(self, config)
        self._check_sequence(config)
        if config.model.attention in ("blockwise", "ring"):
            self._check_attention()
        if config.model.moe is not None and config.model.moe.impl == "shard_map":
            self._check_experts()

    def _check_sequence(self, config: Config) -> None:
        where, manual, moe = f"rules '{self.name}'", self.sequence_axes, config.model.moe
        inner, outer = self.axes_of("length"), self.axes_of("norm_length")
        if manual and inner and outer[: len(inner)] != inner:
            # Gathering the SP shards must give back the blocks of 'length' (context parallelism).
            raise ConfigError(
                f"{where}: norm_length {list(outer)} must start with the mesh axes of length {list(inner)}"
            )
        # Leaving a tensor-parallel region (attention; a dense or shared-expert MLP) reduce-scatters the
        # partial sums of its contracted dimensions onto the sequence.
        dense_mlp = moe is None or moe.every_n_layers > 1 or moe.shared_experts > 0
        for contracted in (("heads", "head_dim"), ("mlp",)) if dense_mlp else (("heads", "head_dim"),):
            if manual and {a for name in contracted for a in self.axes_of(name)} != set(manual):
                raise ConfigError(
                    f"{where}: sequence parallelism over {manual} needs the contracted axes {contracted} "
                    "sharded over the same mesh axes (e.g. heads and mlp on tensor)"
                )

    def _check_attention(self) -> None:
        where = f"rules '{self.name}'"
        if self.axes_of("head_dim"):
            raise ConfigError(f"{where}: 'head_dim' must not be sharded for ring/blockwise attention")
        heads, kv_heads = self.partition(("heads",))[0], self.partition(("kv_heads",))[0]
        if heads != kv_heads:
            raise ConfigError(
                f"{where}: 'heads' and 'kv_heads' must be sharded over the same mesh axes "
                f"for ring/blockwise attention (got {heads} and {kv_heads})"
            )

    def _check_experts(self) -> None:
        where = f"rules '{self.name}'"
        ep, batch = self.expert_axes, set(self.batch_axes)
        seq, mlp = self.mesh_axes(("norm_length",)), self.mesh_axes(("expert_mlp",))
        if not set(ep) <= batch:
            raise ConfigError(
                f"{where}: expert parallelism over {ep} needs 'batch' sharded over the same mesh axes "
                "(outside the MoE blocks they act as data parallelism)"
            )
        if set(mlp) & batch:
            raise ConfigError(f"{where}: 'expert_mlp' and 'batch' share mesh axes {sorted(set(mlp) & batch)}")
        if self.mesh_axes(("act_embed",)):
            raise ConfigError(f"{where}: expert parallelism needs 'act_embed' unsharded")
        if set(seq) & set(mlp) and not set(seq) <= set(mlp):
            raise ConfigError(
                f"{where}: the sequence ('norm_length' on {seq}) must be sharded over all or none "
                f"of the axes of 'expert_mlp' ({mlp})"
            )
