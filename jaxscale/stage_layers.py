"""Uneven pipeline stages: how ``pipeline.layers_per_stage`` lays the layer stack out in padded slots.

With ``pipeline.layers_per_stage`` = [n_0, ..., n_{G−1}] (G = p·v virtual stages, numbered as the
schedules number them, summing to ``model.layers``) every virtual stage is a chunk of
Lmax = max(n_g) *slots*: the model's stacked blocks hold G·Lmax slots (they still split evenly over
``stage``), chunk g's first n_g slots are its layers and the rest are unused. The pipeline runs an
unused slot as the identity (h passes through; its gradient is exactly zero), so a stage with
fewer layers finishes its slot sooner where the loop skips idle work, and computes the same
numbers in any case.

The padding lives in the parameters: initialisation, the optimizer state and checkpoints hold the
G·Lmax slots. Real layer ``j`` of the one-device L-layer model is slot ``slots(counts)[j]``;
:func:`pad` and :func:`unpad` map a stacked [L, ...] tree to the [G·Lmax, ...] one and back
(e.g. to compare with one device, or to load a checkpoint of the same model with another split).
Counts here are in stacked units: layers, or groups of ``model.moe.every_n_layers`` layers. The
list is checked in :func:`jaxscale.config.validate_stage_layers` and by :meth:`jaxscale.layout.Layout.validate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxscale.schema import Config, ModelConfig, PipelineConfig


def unit(model: ModelConfig) -> int:
    """Layers per stacked unit: 1, or ``model.moe.every_n_layers`` with experts."""
    return model.moe.every_n_layers if model.moe else 1


def counts(pipeline: PipelineConfig, model: ModelConfig, stages: int) -> tuple[int, ...]:
    """Stacked units of each virtual stage (even when ``layers_per_stage`` is unset)."""
    units = model.layers // unit(model)
    chunks = stages * pipeline.repeats
    if pipeline.layers_per_stage is None:
        return (units // chunks,) * chunks
    return tuple(n // unit(model) for n in pipeline.layers_per_stage)


def stack_size(config: Config) -> int:
    """Slots in the model's stacked blocks: the stacked units, or G·Lmax with uneven stages."""
    listed = config.pipeline.layers_per_stage
    if listed is None:
        return config.model.layers // unit(config.model)
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


def slots(counts: tuple[int, ...]) -> np.ndarray:
    """The slot of each real unit, in order: unit j of chunk g sits at g·Lmax + j."""
    top = max(counts)
    return np.concatenate([g * top + np.arange(n) for g, n in enumerate(counts)])


def pad(stacked: Any, counts: tuple[int, ...]) -> Any:
    """A tree of [units, ...] arrays as the padded [G·Lmax, ...] stack (unused slots zero)."""
    where = slots(counts)

    def one(w: Any) -> Any:
        out = np.zeros((len(counts) * max(counts), *w.shape[1:]), w.dtype)
        out[where] = np.asarray(w)
        return out

    return _map(one, stacked)


def unpad(stacked: Any, counts: tuple[int, ...]) -> Any:
    """The real units of a padded [G·Lmax, ...] stack, in order: [units, ...]."""
    where = slots(counts)
    return _map(lambda w: np.asarray(w)[where], stacked)
