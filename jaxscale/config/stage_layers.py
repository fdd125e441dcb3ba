"""The layer stack's storage: uneven stages' padded slots, and each stage's chunks contiguous on it.

With ``pipeline.layers_per_stage`` = [n_0, ..., n_{G−1}] (G = p·v virtual stages, numbered as the
schedules number them, summing to the stacked layers, :func:`stacked`) every virtual stage is a chunk of
Lmax = max(n_g) *slots*: the model's stacked blocks hold G·Lmax slots (they still split evenly over
``stage``), chunk g's first n_g slots are its layers and the rest are unused (zero). The pipeline runs an
unused slot as the identity (h passes through; its gradient is exactly zero), so a stage with
fewer layers finishes its slot sooner where the loop skips idle work, and computes the same
numbers in any case. With v > 1 chunks per stage the stack keeps each stage's chunks together
(:class:`Storage`), even or not, so that splitting it over ``stage`` gives every stage the chunks it runs.

The storage never changes the model: the model draws its canonical [L, ...] stack (the unpipelined
one, whatever the split) and the trainer places it into the storage (:meth:`Storage.place`); the
optimizer state follows the parameters. Checkpoints record their storage and are converted on
restore (:mod:`jaxscale.checkpoint.restack`). Counts here are in stacked units: layers, or groups of
``model.moe.every_n_layers`` layers. The list is checked in :func:`jaxscale.config.read.validate_stage_layers`
and by :meth:`jaxscale.layout.rules.Layout.validate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxscale.config.schema import Config, ModelConfig, PipelineConfig


def unit(model: ModelConfig) -> int:
    """Layers per stacked unit: 1, or ``model.moe.every_n_layers`` with experts."""
    return model.moe.every_n_layers if model.moe else 1


def plain_units(config: Config) -> int:
    """How many of the stack's last units run in the compute dtype (:mod:`jaxscale.precision.fp8.tail`):
    ``precision.nvfp4.bf16_last`` of the stacked units, rounded to the nearest; 0 unless ``precision.fp8: nvfp4``."""
    if config.precision.fp8 != "nvfp4":
        return 0
    units = stacked(config.model) // unit(config.model)
    return min(units, round(config.precision.nvfp4.bf16_last * units))


def stacked(model: ModelConfig) -> int:
    """The layers of the model's stacked blocks: ``model.layers``, less a DeepSeek model's dense first layers
    (``model.deepseek.dense_layers``: its prefix, which a pipeline runs with the embedding)."""
    return model.layers - (model.deepseek.dense_layers if model.deepseek else 0)


def stacked_named(model: ModelConfig) -> str:
    """:func:`stacked` as an error message names it."""
    if model.deepseek and model.deepseek.dense_layers:
        return f"the stacked layers ({stacked(model)}: model.layers less model.deepseek.dense_layers)"
    return f"model.layers ({model.layers})"


def counts(pipeline: PipelineConfig, model: ModelConfig, stages: int) -> tuple[int, ...]:
    """Stacked units of each virtual stage (even when ``layers_per_stage`` is unset)."""
    units = stacked(model) // unit(model)
    chunks = stages * pipeline.repeats
    if pipeline.layers_per_stage is None:
        return (units // chunks,) * chunks
    return tuple(n // unit(model) for n in pipeline.layers_per_stage)


def stack_size(config: Config) -> int:
    """Slots in the model's stacked blocks: the stacked units, or G·Lmax with uneven stages."""
    listed = config.pipeline.layers_per_stage
    if listed is None:
        return stacked(config.model) // unit(config.model)
    return len(listed) * max(listed) // unit(config.model)


def lighter_ends(layers: int, chunks: int) -> tuple[int, ...]:
    """``layers`` over ``chunks`` virtual stages, as even as it goes, the first and last ones lighter
    (they also run the embedding and the head): ⌈layers/chunks⌉ each, one fewer on stages 0, G−1, 1,
    G−2, ... for the remainder (Megatron's first/last-stage layers, by one)."""
    top = math.ceil(layers / chunks)
    out = [top] * chunks
    ends = [g for pair in zip(range(chunks), reversed(range(chunks)), strict=True) for g in pair]
    for g in list(dict.fromkeys(ends))[: top * chunks - layers]:
        out[g] -= 1
    return tuple(out)


def _map(f: Callable[[Any], Any], tree: Any) -> Any:
    """``f`` on every array of a tree of nested mappings (the pure dicts parameters come as)."""
    return {k: _map(f, v) for k, v in tree.items()} if isinstance(tree, dict) else f(tree)


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where the stacked blocks keep the model's units: ``counts`` units in each virtual stage (numbered as
    the schedules number them, g = c·p + s) on ``stages`` (p) pipeline stages.

    Every virtual stage is a chunk of Lmax = max(counts) slots, and each stage's v chunks lie one after the
    other: unit j of virtual stage g = c·p + s sits at slot s·v·Lmax + c·Lmax + j. Split over ``stage``,
    the stack thus gives stage s its chunks in the order it runs them (no reshuffle per step). One
    virtual stage on one stage is the unpipelined (canonical) order.
    """

    counts: tuple[int, ...]
    stages: int = 1

    @property
    def size(self) -> int:
        """Slots in the stack: G·Lmax."""
        return len(self.counts) * max(self.counts)

    @property
    def units(self) -> int:
        return sum(self.counts)

    def positions(self) -> np.ndarray:
        """The slot of each unit of the canonical stack, in order."""
        top, p = max(self.counts), self.stages
        v = len(self.counts) // p
        return np.concatenate([((g % p) * v + g // p) * top + np.arange(n) for g, n in enumerate(self.counts)])

    @property
    def canonical_order(self) -> bool:
        """Whether the stack is the canonical one: no padding, units in order."""
        return self.size == self.units and bool((self.positions() == np.arange(self.units)).all())

    def place(self, stacked: Any) -> Any:
        """A tree of canonical [units, ...] arrays (numpy or jax) as this stack [G·Lmax, ...], unused slots zero."""
        if self.canonical_order:
            return stacked
        source = np.zeros(self.size, np.int32)
        source[self.positions()] = np.arange(self.units)
        used = np.zeros(self.size, bool)
        used[self.positions()] = True

        def one(w: Any) -> Any:
            return w[source] * np.asarray(used, w.dtype).reshape(-1, *(1,) * (w.ndim - 1))

        return _map(one, stacked)

    def canonical(self, stored: Any) -> Any:
        """A tree of this stack's [G·Lmax, ...] arrays as the canonical [units, ...] ones."""
        if self.canonical_order:
            return stored
        where = self.positions()
        return _map(lambda w: w[where], stored)

    def place_params(self, params: Any) -> Any:
        """A model's parameters or per-layer state (a pure dict) with the canonical ``blocks`` in this stack."""
        if self.canonical_order or "blocks" not in params:
            return params
        return {**params, "blocks": self.place(params["blocks"])}

    def canonical_params(self, params: Any) -> Any:
        """Parameters or per-layer state stored in this stack with their ``blocks`` in the canonical order."""
        if self.canonical_order or "blocks" not in params:
            return params
        return {**params, "blocks": self.canonical(params["blocks"])}

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "stages": self.stages}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Storage:
        return cls(tuple(int(n) for n in saved["counts"]), int(saved["stages"]))


def storage(config: Config, stages: int) -> Storage:
    """The stack's storage for ``config`` on ``stages`` pipeline stages (1: no pipeline, the canonical order)."""
    if stages == 1:
        return Storage((stacked(config.model) // unit(config.model),))
    return Storage(counts(config.pipeline, config.model, stages), stages)


def written_before(model: dict[str, Any], pipeline: dict[str, Any]) -> Storage:
    """The storage of a checkpoint that does not record its own (model and pipeline settings as saved): the
    canonical order, or with ``layers_per_stage`` chunks of padded slots in the order of the virtual stages."""
    moe = model.get("moe")
    per = moe["every_n_layers"] if moe else 1
    listed = pipeline.get("layers_per_stage")
    layers = model["layers"] - ((model.get("deepseek") or {}).get("dense_layers") or 0)  # as :func:`stacked`
    return Storage(tuple(n // per for n in listed) if listed else (layers // per,))
