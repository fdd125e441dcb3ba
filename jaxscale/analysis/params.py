"""What the analytic model is given: the parameters, their placement on the mesh, the step's batch.

Everything the model predicts is derived from three things: the model's parameters with
their logical axes (:class:`Param`, the same annotations the model carries, read abstractly
by :func:`param_table`), a rules table on the mesh sizes (:class:`jaxscale.layout.rules.Layout`, the
object the runtime's shardings and parallel modules ask too, so the two agree by construction)
and the batch side of the step (:class:`Step`). :func:`split` says how one parameter lies against the mesh
axes that split the tokens: which of them its layout gathers (ZeRO-3), scatters (ZeRO-1/2)
or all-reduces over (DP). Nothing here imports jax until :func:`param_table` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxscale.config import stage_layers
from jaxscale.config.dtypes import Dtypes, resolve
from jaxscale.config.read import DEFAULT_SCHEDULE, Config, ModelConfig
from jaxscale.layout.rules import Layout
from jaxscale.parallel import schedules


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
    # Imports jax: this module stays jax-free for the CLI's plan (it reads configs before devices exist).
    from jaxscale.layout.sharding import named_params

    named = named_params(abstract_params, axes)
    return [Param(name, tuple(leaf.shape), _stack_axes(name, a)) for name, leaf, a in named]


def _stack_axes(name: str, axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """``axes``, with the leading axis of DeepSeek's dense stack read as ``layers``: the model leaves it unnamed
    so that no rules table splits it over ``stage`` (:mod:`jaxscale.models.deepseek`), but it is scanned and
    recomputed as the layer stack is (its gathers repeat in the backward); the planner pipelines no such model."""
    return ("layers", *axes[1:]) if name.split(".")[0] == "dense" and axes and axes[0] is None else axes


def param_table(config: Config) -> list[Param]:
    """The model's parameters, abstractly (``nnx.eval_shape``: nothing is allocated, any size)."""
    # Imports jax: this module stays jax-free for the CLI's plan (it reads configs before devices exist).
    from jaxscale.training.trainer import abstract_model

    _, shapes, axes, _ = abstract_model(config)
    return params_of(shapes, axes)


@dataclasses.dataclass(frozen=True)
class MuonCost:
    """What the analytic model reads of ``train.muon``: Newton-Schulz steps, their dtype, AdamW's axes."""

    ns_steps: int = 5
    ns_dtype: str = "bfloat16"
    adamw_axes: tuple[str, ...] = ("vocab",)


@dataclasses.dataclass(frozen=True)
class Step:
    """The batch side of a step: global batch in sequences, sequence length, accumulation, pipeline."""

    global_batch: int
    seq_len: int
    microbatches: int = 1  # gradient accumulation steps
    pipeline_microbatches: int = 1
    repeats: int = 1
    schedule: str = DEFAULT_SCHEDULE
    params_dtype: str = "auto"  # precision.params: the compute copy (auto: model.dtype)
    master_dtype: str = "auto"  # precision.master: the weights the optimizer updates (auto: model.param_dtype)
    reduce_dtype: str = "float32"  # precision.grads_reduce: the accumulator's
    layers_per_stage: tuple[int, ...] | None = None  # pipeline.layers_per_stage: uneven virtual stages
    muon: MuonCost | None = None  # train.optimizer: muon (jaxscale/analysis/muon_cost.py); None: AdamW
    documents: str = ""  # rows packed with documents of this corpus (jaxscale.analysis.ring_imbalance), or none
    ring_balance: bool = False  # data.ring_balance: the ring's documents arranged to even its devices' tiles

    @classmethod
    def from_config(cls, config: Config, stages: int = 1) -> Step:
        """The step of an experiment; ``stages`` is the resolved size of the ``stage`` mesh axis."""
        pipeline, t, p = config.pipeline, config.train, config.precision
        split = tuple(pipeline.layers_per_stage) if pipeline.layers_per_stage is not None else None
        muon = MuonCost(t.muon.ns_steps, t.muon.ns_dtype, tuple(t.muon.adamw_axes)) if t.optimizer == "muon" else None
        return cls(t.global_batch, t.seq_len, t.microbatches, pipeline.microbatches or stages, pipeline.repeats,
                   pipeline.schedule, p.params, p.master, p.grads_reduce, split, muon)

    def dtypes(self, m: ModelConfig) -> Dtypes:
        """The step's compute, master and reduce dtypes (:func:`jaxscale.config.dtypes.resolve`)."""
        return resolve({"dtype": m.dtype, "param_dtype": m.param_dtype},
                       {"params": self.params_dtype, "master": self.master_dtype, "grads_reduce": self.reduce_dtype})

    def copies(self, m: ModelConfig) -> tuple[str, str]:
        """The dtypes of the compute copy and of the master (:mod:`jaxscale.precision.policy`; equal: one copy)."""
        names = self.dtypes(m)
        return names.compute, names.master


def stack_layers(m: ModelConfig, step: Step) -> int:
    """Layers the stacked blocks hold: ``model.layers``, or with uneven stages p·v chunks of the largest one's
    slots (:mod:`jaxscale.config.stage_layers`): held in memory, and computed where a stage masks its slots."""
    split = step.layers_per_stage
    return m.layers if split is None else len(split) * max(split)


def stacked(params: Sequence[Param], m: ModelConfig, step: Step) -> list[Param]:
    """``params`` with the layer stack as the step's uneven stages pad it (unchanged when even or padded)."""
    unit = stage_layers.unit(m)
    real, slots = m.layers // unit, stack_layers(m, step) // unit

    def one(p: Param) -> Param:
        if not p.in_layers or p.shape[p.axes.index("layers")] != real:
            return p
        i = p.axes.index("layers")
        return dataclasses.replace(p, shape=(*p.shape[:i], slots, *p.shape[i + 1 :]))

    return [one(p) for p in params]


def trainer_inputs(trainer: Any) -> tuple[list[Param], Layout, Step]:
    """The parameters, placement and step of a built :class:`jaxscale.training.trainer.Trainer` (its model, rules,
    mesh)."""
    params = params_of(trainer.abstract_params, trainer.axes)
    layout = Layout(trainer.rules, dict(trainer.mesh.shape), pipeline=trainer.config.pipeline)
    return params, layout, Step.from_config(trainer.config, trainer.mesh.shape["stage"])


def pipeline_table(layout: Layout, step: Step) -> schedules.Table:
    """The table the pipeline loop runs for this layout and step (:mod:`jaxscale.parallel.schedules`)."""
    return _table(step.schedule, layout.ways(("layers",)), step.pipeline_microbatches, step.repeats)


@functools.lru_cache(maxsize=256)
def _table(schedule: str, p: int, m: int, v: int) -> schedules.Table:
    return schedules.build(schedule, p, m, v)


def pipeline_ticks(layout: Layout, step: Step) -> int:
    """Iterations of the pipeline loop: every stage runs them all, the bubble's too."""
    return pipeline_table(layout, step).ticks


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


def split(p: Param, layout: Layout, step: Step, layers: int) -> Split:
    """The :class:`Split` of ``p`` in a model of ``layers`` layers."""
    tokens = layout.token_axes
    held = layout.mesh_axes(p.axes)
    experts = layout.mesh_axes(("expert",)) if "expert" in p.axes else ()
    gathered = tuple(a for a in held if a in tokens and a not in experts)
    kind = "optimizer" if step.microbatches == 1 else "gradients"
    scattered = tuple(a for a in layout.mesh_axes(p.axes, kind) if a in tokens and a not in held)
    reduced = tuple(a for a in tokens if a not in held and a not in scattered)
    count = layers / layout.ways(("layers",)) if p.in_layers else 1
    whole = p.size / layout.size([a for a in held if a not in gathered])
    return Split(held, gathered, scattered, reduced, count, whole)


def layer_elems(params: Sequence[Param], layout: Layout, reduced: bool) -> float:
    """Elements of one layer's parameters on this device, of the largest stack's layer where a model stacks its
    layers apart (DeepSeek's ``dense`` and ``blocks``); ``reduced`` False: before any data-parallel split."""
    stacks: dict[str, float] = {}
    for p in params:
        if not p.in_layers:
            continue
        axes = [a for a in layout.mesh_axes(p.axes) if reduced or a not in layout.token_axes]
        stack = p.path.split(".")[0]
        stacks[stack] = stacks.get(stack, 0.0) + p.size / p.shape[p.axes.index("layers")] / layout.size(axes)
    return max(stacks.values(), default=0.0)
