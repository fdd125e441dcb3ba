"""The vocabulary of a Hugging Face weight table: one jaxscale parameter, the HF tensors it is made of, and the
array moves between them (:mod:`jaxscale.hf.convert`; no jax, no torch)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxscale.config.read import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Weight:
    """One jaxscale parameter and the HF tensors it is made of.

    ``hf`` names one tensor, with ``{i}`` for the layer and ``{e}`` for the expert when the parameter is
    stacked over them. ``split``: the HF tensor is ``nn.Linear``'s ``[out, in]`` and ours (one layer, one
    expert) is ``[in..., out...]`` with ``split`` leading "in" dimensions; None: the same layout.
    ``first``, ``count``, ``every``: our stacked slice ``i`` is HF layer ``first + i · every`` (default: all
    ``model.layers``, from 0; ``every`` > 1 for one block of each group of ``every``, MoE every n-th layer).
    ``columns``: ours' last dimension is HF's taken in this order (None: the same order).
    ``balance``: not a parameter but routing state (``TrainState.balance``, :mod:`jaxscale.models.balance`),
    float32 both ways.
    """

    path: tuple[str | int, ...]
    hf: str
    split: int | None = 1
    first: int = 0
    count: int | None = None
    columns: tuple[int, ...] | None = None
    every: int = 1
    balance: bool = False

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    @property
    def expert(self) -> bool:
        return "{e}" in self.hf


def hf_shape(w: Weight, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for one layer's (and expert's) slice of ours of ``shape``."""
    return shape if w.split is None else (math.prod(shape[w.split :]), math.prod(shape[: w.split]))


def to_ours(w: Weight, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One HF tensor as one layer's (and expert's) slice of ours, of ``shape``."""
    value = tensor if w.split is None else tensor.T.reshape(shape)
    return value if w.columns is None else value[..., list(w.columns)]


def to_hf(w: Weight, value: np.ndarray) -> np.ndarray:
    """One layer's (and expert's) slice of ours as the HF tensor."""
    if w.columns is not None:
        value = value[..., np.argsort(w.columns)]
    if w.split is None:
        return value
    return value.reshape(math.prod(value.shape[: w.split]), -1).T


def slices(w: Weight, model: ModelConfig) -> Iterator[tuple[tuple[int, ...], str]]:
    """Each (index into our stacked parameter, HF tensor name) of ``w``."""
    layers = range(w.count if w.count is not None else model.layers // w.every) if w.layered else [None]
    experts = range(model.moe.experts) if w.expert else [None]
    for i in layers:
        for e in experts:
            index = tuple(x for x in (i, e) if x is not None)
            yield index, w.hf.format(i=None if i is None else w.first + i * w.every, e=e)


def bias_shape(w: Weight, model: ModelConfig) -> tuple[int, ...]:
    """Our shape of the routing biases ``w`` (``balance``): ``[layers, experts]`` stacked, else ``[experts]``."""
    return (w.count if w.count is not None else model.layers // w.every, model.moe.experts)[not w.layered :]


def put(tree: dict[str, Any], path: tuple[str | int, ...], value: np.ndarray) -> None:
    """Set ``value`` at a table's ``path`` in the nested dict ``tree``, making the levels it lacks."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def hf_int(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field of an HF ``config.json`` (``default`` where it is missing or null)."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ConfigError(f"config.json: no '{key}' (a partial config.json?)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value
