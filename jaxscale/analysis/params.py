"""What the analytic model is given: the parameters, their placement on the mesh, the step's batch.

Everything the model predicts is derived from three things: the model's parameters with
their logical axes (:class:`Param`, the same annotations the model carries, read abstractly
by :func:`param_table`), a rules table on the mesh sizes (:class:`Placement`) and the batch
side of the step (:class:`Step`). :func:`split` says how one parameter lies against the mesh
axes that split the tokens: which of them its layout gathers (ZeRO-3), scatters (ZeRO-1/2)
or all-reduces over (DP). Nothing here imports jax until :func:`param_table` runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxscale.config import Config

TOKEN_NAMES = ("batch", "length")


def dtype_bytes(name: str) -> int:
    return np.dtype(name).itemsize


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter array: its path, global shape and logical axes."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_layers(self) -> bool:
        return "layers" in self.axes

    @property
    def is_embedding(self) -> bool:
        """The token embedding table (looked up, not multiplied)."""
        return self.axes == ("vocab", "embed") and self.path.split(".")[-1] == "embedding"

    @property
    def in_sp_region(self) -> bool:
        """A weight that sequence parallelism's shard_maps consume: the projections and the output head."""
        return bool({"heads", "kv_heads", "mlp"} & set(self.axes)) or self.axes == ("embed", "vocab")


def params_of(abstract_params: Any, axes: Any) -> list[Param]:
    """The :class:`Param` table of a tree of parameter shapes and its tree of logical axes."""
    from jaxscale.sharding import named_params

    return [Param(name, tuple(leaf.shape), a) for name, leaf, a in named_params(abstract_params, axes)]


def param_table(config: Config) -> list[Param]:
    """The model's parameters, abstractly (``nnx.eval_shape``: nothing is allocated, any size)."""
    from jaxscale.train import abstract_model

    _, shapes, axes = abstract_model(config)
    return params_of(shapes, axes)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A rules table (logical name -> mesh axes, per kind) on mesh sizes; names it lacks are replicated."""

    tables: Mapping[str, Mapping[str, tuple[str, ...]]]  # kind ("params", "optimizer", "gradients") -> table
    mesh: Mapping[str, int]

    @classmethod
    def from_rules(cls, rules: Any, mesh: Mapping[str, int]) -> Placement:
        """From a :class:`jaxscale.sharding.Rules` and mesh sizes."""
        kinds = ("params", "optimizer", "gradients")
        return cls({k: dict(rules.table(k)) for k in kinds}, dict(mesh))

    def mesh_axes(self, names: Iterable[str | None], kind: str = "params") -> tuple[str, ...]:
        """The mesh axes (of size > 1) that split an array with these logical names."""
        table = self.tables[kind]
        out: list[str] = []
        for name in names:
            for axis in table.get(name, ()) if name else ():
                if self.mesh[axis] > 1 and axis not in out:
                    out.append(axis)
        return tuple(out)

    def ways(self, names: Iterable[str | None], kind: str = "params") -> int:
        return math.prod(self.mesh[a] for a in self.mesh_axes(names, kind))

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.mesh[a] for a in axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the tokens (batch and sequence): each holds different data."""
        return self.mesh_axes(TOKEN_NAMES)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the sequence but not the batch: context parallelism."""
        batch = self.mesh_axes(("batch",))
        return tuple(a for a in self.mesh_axes(("length",)) if a not in batch)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Mesh axes of SP: they split ``norm_length`` but not ``length``."""
        inner = self.mesh_axes(("length",))
        return tuple(a for a in self.mesh_axes(("norm_length",)) if a not in inner)

    @property
    def pipelined(self) -> bool:
        """Whether the rules put ``layers`` on the ``stage`` axis (size > 1): the pipeline loop runs."""
        return "stage" in self.mesh_axes(("layers",))


@dataclasses.dataclass(frozen=True)
class Step:
    """The batch side of a step: global batch in sequences, sequence length, accumulation, pipeline."""

    global_batch: int
    seq_len: int
    microbatches: int = 1  # gradient accumulation steps
    pipeline_microbatches: int = 1
    repeats: int = 1
    pipeline_remat: bool = True

    @classmethod
    def from_config(cls, config: Config, stages: int = 1) -> Step:
        """The step of an experiment; ``stages`` is the resolved size of the ``stage`` mesh axis."""
        pipeline, t = config.pipeline, config.train
        return cls(t.global_batch, t.seq_len, t.microbatches, pipeline.microbatches or stages, pipeline.repeats,
                   pipeline.remat)


def trainer_inputs(trainer: Any) -> tuple[list[Param], Placement, Step]:
    """The parameters, placement and step of a built :class:`jaxscale.train.Trainer` (its model, rules, mesh)."""
    params = params_of(trainer.abstract_params, trainer.axes)
    place = Placement.from_rules(trainer.rules, dict(trainer.mesh.shape))
    return params, place, Step.from_config(trainer.config, trainer.mesh.shape["stage"])


def pipeline_ticks(place: Placement, step: Step) -> int:
    """Iterations of the pipeline loop, v·m + p − 1: every stage runs them all, the bubble's too."""
    return step.repeats * step.pipeline_microbatches + place.ways(("layers",)) - 1


@dataclasses.dataclass(frozen=True)
class Split:
    """How one parameter is laid out against the axes that split the tokens."""

    held: tuple[str, ...]  # mesh axes its parameters' layout splits it over
    gathered: tuple[str, ...]  # ... of them, token axes: ZeRO-3, gathered to compute
    scattered: tuple[str, ...]  # token axes only its optimizer (gradient) layout splits: ZeRO-1/2
    reduced: tuple[str, ...]  # token axes that split neither: its gradient is all-reduced over them
    count: float  # layers of it on this device (1 outside the layer stack)
    whole: float  # elements on a device once gathered (all its layers)

    @property
    def unit(self) -> float:
        """Elements of one layer, gathered."""
        return self.whole / self.count


def split(p: Param, place: Placement, step: Step, layers: int) -> Split:
    """The :class:`Split` of ``p`` in a model of ``layers`` layers."""
    tokens = place.token_axes
    held = place.mesh_axes(p.axes)
    experts = place.mesh_axes(("expert",)) if "expert" in p.axes else ()
    gathered = tuple(a for a in held if a in tokens and a not in experts)
    kind = "optimizer" if step.microbatches == 1 else "gradients"
    scattered = tuple(a for a in place.mesh_axes(p.axes, kind) if a in tokens and a not in held)
    reduced = tuple(a for a in tokens if a not in held and a not in scattered)
    count = layers / place.ways(("layers",)) if p.in_layers else 1
    whole = p.size / place.size([a for a in held if a not in gathered])
    return Split(held, gathered, scattered, reduced, count, whole)


def layer_elems(params: Sequence[Param], place: Placement, reduced: bool) -> float:
    """Elements of one layer's parameters on this device; ``reduced`` False: before any data-parallel split."""
    total = 0.0
    for p in params:
        if not p.in_layers:
            continue
        axes = [a for a in place.mesh_axes(p.axes) if reduced or a not in place.token_axes]
        total += p.size / p.shape[p.axes.index("layers")] / place.size(axes)
    return total
