"""A pipeline stage's plan: one value, from the config's pipeline
settings and the model's parts, and the pipeline's errors that are no
row of the refusal table (no jax).

The plan says what a stage's loop is manual over (``stage``, the row
axes, TP's), what it gathers and how (FSDP's axes, ``pipeline.fsdp``),
whether its idle slots are skipped or masked (``skip``: nothing left to
the partitioner), and where an MoE model's experts run (by the
partitioner, or by explicit collectives among the stage's devices).
:meth:`jaxscale.layout.rules.Layout.validate` computes it when the
trainer is built (the axes explicit experts would leave to the
partitioner, for :mod:`jaxscale.config.refusals`) and raises the rest
(:func:`check`);
:func:`jaxscale.parallel.pipeline.build` computes the same plan from the
same inputs at trace time, where nothing is refused any more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from jaxscale.config.read import Config, ConfigError, ModelConfig, PipelineConfig
from jaxscale.config.schema import FsdpGather

Axes = tuple[str | None, ...]
STAGE = "stage"  # the mesh axis a pipeline runs over
TOKENS = ("batch", "length")  # the logical axes of a batch of token ids
# A dense block's parameters' axes; an MoE block's (MLA's too).
BLOCK_AXES = ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp")
MOE_BLOCK = (*BLOCK_AXES, "expert", "expert_mlp", "q_lora", "kv_lora",
             "q_lora_up", "kv_lora_up")


class Place(Protocol):
    """What a plan reads of a layout (:class:`~jaxscale.layout.rules.Layout`,
    which imports this module)."""

    mesh: Mapping[str, int]

    @property
    def name(self) -> str: ...

    @property
    def pipelined(self) -> bool: ...

    @property
    def stages(self) -> int: ...

    @property
    def stage_axes(self) -> tuple[str, ...]: ...

    @property
    def batch_axes(self) -> tuple[str, ...]: ...

    @property
    def sequence_axes(self) -> tuple[str, ...]: ...

    @property
    def expert_axes(self) -> tuple[str, ...]: ...

    @property
    def ulysses_axes(self) -> tuple[str, ...]: ...

    def axes_of(self, name: str, kind: str = "params") -> tuple[str, ...]: ...

    def mesh_axes(self, names: Iterable[str | None],
                  kind: str = "params") -> tuple[str, ...]: ...

    def data_axes(self, params: Iterable[Axes]) -> tuple[str, ...]: ...

    def size(self, axes: Iterable[str]) -> int: ...

    def partition(self, axes: Axes, kind: str = "params") -> tuple: ...


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The model's parts a plan reads: its stacked blocks' parameters'
    logical axes (layers first), who runs its experts (``None``: a dense
    model; else ``model.moe.impl``), and whether its projections write
    TP's collectives themselves (the model contract's ``explicit_tp``)."""

    axes: tuple[Axes, ...]
    experts: str | None = None
    explicit_tp: bool = True

    @classmethod
    def of(cls, model: ModelConfig, axes: Iterable[Axes] | None = None,
           explicit_tp: bool = True) -> Blocks:
        """``model``'s blocks: ``axes`` (default: every name a built-in
        block's parameters may carry), the experts by ``model.moe.impl``."""
        if axes is None:
            axes = (MOE_BLOCK if model.moe else BLOCK_AXES,)
        experts = None if model.moe is None else model.moe.impl
        return cls(tuple(axes), experts, explicit_tp)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What a pipeline stage's loop is manual over, gathers, skips."""

    manual: tuple[str, ...]  # stage, the rows, TP's; all when none free
    rows: tuple[str, ...]  # stage, then each device's own rows' axes
    ring: tuple[str, ...]  # of the rows, the context axes
    ulysses: tuple[str, ...]  # of ``ring``, Ulysses' (all-to-alls)
    tensor: tuple[str, ...]  # TP's (and SP's), each device its shard
    split: tuple[str, ...]  # the block dimensions' names ``tensor`` splits
    sequence: tuple[str, ...]  # of ``tensor``, SP's
    expert: tuple[str, ...]  # of the rows, EP's: explicit experts' shards
    expert_mlp: tuple[str, ...]  # of ``tensor``, the experts' MLP's
    gathered: tuple[str, ...]  # of the rows, FSDP's: the stage gathers
    free: tuple[str, ...]  # the axes of size > 1 left to the partitioner
    fsdp: FsdpGather  # how FSDP's axes are gathered (pipeline.fsdp)
    experts: str | None  # who runs an MoE model's experts

    @property
    def skip(self) -> bool:
        """Whether idle slots are skipped by a conditional: nothing is
        left to the partitioner (which cannot split the collectives of a
        conditional whose branch differs between stages); else they are
        computed on zeros and masked."""
        return not self.free

    @property
    def visit(self) -> bool:
        """Whether each layer is gathered as a slot runs it."""
        return self.fsdp == "visit"


def _gatherable(place: Place, blocks: Sequence[Axes]) -> bool:
    """Whether every block dimension the batch axes split is split by
    batch axes alone."""
    batch = set(place.axes_of("batch"))
    splits = [set(place.axes_of(n)) for axes in blocks for n in axes if n]
    return all(s <= batch or not s & batch for s in splits)


def _rows(place: Place, blocks: Sequence[Axes], experts: str | None,
          fsdp: FsdpGather) -> tuple[str, ...]:
    """``stage`` and the manual axes over which each device holds its own
    rows: none where the partitioner runs the experts (their routing
    statistics span the microbatch); the batch axes where the stage can
    gather its blocks over those that split them (unless
    ``pipeline.fsdp=tick``), else those that split none; the context
    axes, whose ring attention runs inside the loop."""
    if experts == "partitioner":
        return (STAGE,)
    gather = fsdp != "tick" and _gatherable(place, blocks)
    batch = place.axes_of("batch") if gather else place.data_axes(blocks)
    return (STAGE, *batch, *_context(place))


def _context(place: Place) -> tuple[str, ...]:
    return place.mesh_axes(("length",)) if place.pipelined else ()


def _tensor(place: Place, blocks: Sequence[Axes], rows: tuple[str, ...],
            parts: Blocks) -> tuple[str, ...]:
    """TP's (and SP's) axes, manual too where they are all the stage
    would leave to the partitioner and each block dimension they split is
    split by them alone; none for partitioner experts, a model without
    ``explicit_tp`` (nothing would write TP's collectives), or SP with
    explicit experts (an MoE layer routes whole sequences)."""
    sequence = place.sequence_axes
    if parts.experts == "partitioner" or not parts.explicit_tp:
        return ()
    if parts.experts == "shard_map" and sequence:
        return ()
    free = tuple(a for a, n in place.mesh.items() if n > 1 and a not in rows)
    if set(free) & set(place.batch_axes):
        return ()
    splits = [set(place.mesh_axes((n,))) for axes in blocks for n in axes if n]
    if not all(s <= set(free) or not s & set(free) for s in splits):
        return ()
    held = {a for s in splits for a in s}
    return free if set(free) <= held and set(sequence) <= set(free) else ()


def plan(place: Place, pipeline: PipelineConfig, parts: Blocks) -> StagePlan:
    """The stage's plan for ``parts`` under ``place`` and ``pipeline``."""
    blocks = list(parts.axes)
    rows = _rows(place, blocks, parts.experts, pipeline.fsdp)
    tensor = _tensor(place, blocks, rows, parts)
    manual = (*rows, *tensor)
    free = tuple(a for a, n in place.mesh.items()
                 if n > 1 and a not in manual)
    if not free:  # the size-1 axes manual too (XLA:CPU, see pipeline.build)
        manual = (*manual, *(a for a in place.mesh if a not in manual))
    named = (n for axes in blocks for n in axes if n != "expert")
    in_tensor = set(tensor)
    explicit = parts.experts == "shard_map"
    ring = tuple(a for a in manual if a in _context(place))
    return StagePlan(
        manual=manual, rows=rows, ring=ring,
        ulysses=tuple(a for a in place.ulysses_axes if a in ring),
        tensor=tensor,
        split=tuple(dict.fromkeys(
            n for axes in blocks for n in axes
            if set(place.mesh_axes((n,))) & in_tensor)),
        sequence=tuple(a for a in place.sequence_axes if a in in_tensor),
        expert=tuple(a for a in place.expert_axes
                     if a in rows and explicit),
        expert_mlp=tuple(a for a in place.mesh_axes(("expert_mlp",))
                         if a in in_tensor),
        gathered=tuple(a for a in place.mesh_axes(named)
                       if a in rows and a != STAGE),
        free=free, fsdp=pipeline.fsdp, experts=parts.experts,
    )


def assumed(place: Place, model: ModelConfig,
            axes: Iterable[Axes] | None = None) -> StagePlan:
    """The plan the analytic model assumes: the layout's pipeline settings
    (the defaults without), a built-in model's blocks (``explicit_tp``)."""
    pipeline = getattr(place, "pipeline", None) or PipelineConfig()
    return plan(place, pipeline, Blocks.of(model, axes))


# -- what the refusal table does not hold ------------------------------------


def check(place: Place, config: Config) -> None:
    """Raise the first error of a pipeline under ``place`` that is no row
    of :mod:`jaxscale.config.refusals`: the layers on ``stage`` and
    another axis, the block parameters split over the stage's context
    axes, a microbatch against the batch axes."""
    where = f"rules '{place.name}'"
    if len(place.stage_axes) > 1:
        raise ConfigError(
            f"{where}: layers maps to {list(place.stage_axes)}; a pipeline "
            f"needs layers on '{STAGE}' alone")
    _check_context(place)
    _check_shapes(place, config)


def _check_context(place: Place) -> None:
    """Context parallelism inside a stage: the loop is manual over the
    context axes and runs ring attention's kernel there (a dense model,
    ``model.attention=ring``: rows of the table). (A ring's own
    shard_map nested in the partly manual loop does not lower: Shardy
    wants its residuals' manual axes before the loop's free ones.)"""
    context = _context(place)
    held = sorted({a for n in BLOCK_AXES for a in place.axes_of(n)} & set(context))
    if held:
        raise ConfigError(
            f"rules '{place.name}': context parallelism (length on "
            f"{list(context)}) inside a pipeline stage needs the block "
            f"parameters unsplit over {held}: the loop is manual over them "
            "and would gather the parameters whole on entry")


def _check_shapes(place: Place, config: Config) -> None:
    """A pipeline microbatch against the batch axes (the schedule, the
    layers and the batch against the stages are rows of the table)."""
    m = config.pipeline.microbatches or place.stages
    shape = (config.train.global_batch // config.train.microbatches // m,
             config.train.seq_len)
    parts = place.partition(TOKENS)
    for dim, (size, name, part) in enumerate(zip(shape, TOKENS, parts, strict=True)):
        ways = place.size(place.axes_of(name))
        if size % ways:
            raise ConfigError(
                f"pipeline microbatch: dimension {dim} ('{name}', size "
                f"{size}) is not divisible by mesh axes {part} of size "
                f"{ways}")
