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
list is checked in :func:`jaxscale.config.validate_stage_layers` and by the layout.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxscale.config import Config, ModelConfig, PipelineConfig


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

    return jax.tree.map(one, stacked)


def unpad(stacked: Any, counts: tuple[int, ...]) -> Any:
    """The real units of a padded [G·Lmax, ...] stack, in order: [units, ...]."""
    where = slots(counts)
    return jax.tree.map(lambda w: np.asarray(w)[where], stacked)
