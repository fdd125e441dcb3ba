"""The one fp8 dispatcher: each recipe (``precision.fp8``) and the kernels that run it, as a table.

Every fp8 matmul of the package asks :func:`kernels` for its operands' recipe's row and runs what the row
names; nothing else branches on the recipe. A row (:class:`Kernels`):

- ``activation``, ``weight``: what the recipe makes of an input (once for the projections that read it) and of a
  weight or stack (once a step, before the layers) ahead of its kernels: per tensor (``delayed``, ``current``)
  e4m3 with a scale per tensor or matrix (:class:`~jaxscale.precision.fp8.scaling.Quantized`); ``blockwise``
  nothing (:class:`~jaxscale.precision.fp8.operand.Deferred`: its kernels tile their operands);
- ``einsum``: a projection ``y = x · w`` with its custom VJP (:mod:`~jaxscale.precision.fp8.per_tensor`,
  :mod:`~jaxscale.precision.fp8.blockwise`, :mod:`~jaxscale.precision.fp8.block_scaled`: ``mxfp8``, ``nvfp4``);
- ``ragged``: the dropless experts' grouped matmul (:mod:`~jaxscale.precision.fp8.grouped`,
  :mod:`~jaxscale.precision.fp8.blockwise_grouped`, :mod:`~jaxscale.precision.fp8.block_scaled_grouped`);
- ``all_gather_matmul``, ``matmul_reduce_scatter``: the collective matmuls of ``model.tp_overlap``
  (:mod:`~jaxscale.precision.fp8.collective`, :mod:`~jaxscale.precision.fp8.blockwise_collective`);
- ``residual``, ``restored``: what a weight gradient reads of an input and the input read back from it (zero
  bubble's W slot, :mod:`jaxscale.parallel.weight_split`): the e4m3 input, or the compute-dtype one.

A new recipe is one new module holding its kernels and one row here (the block-scaled formats MXFP8 and NVFP4
share one: :mod:`~jaxscale.precision.fp8.block_scaled` and its grouped and collective matmuls),
plus its name among the values of ``precision.fp8`` (:data:`jaxscale.config.schema.Fp8Mode`) and, where its
kernels tile the projections, the sizes that must divide (:func:`jaxscale.config.read.validate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxscale.precision.fp8 import (
    block_scaled,
    block_scaled_collective,
    block_scaled_grouped,
    blockwise,
    blockwise_collective,
    blockwise_grouped,
    collective,
    grouped,
    per_tensor,
)
from jaxscale.precision.fp8.scaling import Recipe


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One recipe's row: what it makes of its operands ahead of the kernels, and the kernels."""

    activation: Callable[..., Any]  # (x, history, recipe) -> Quantized | Deferred
    weight: Callable[..., Any]  # (w, history, recipe) -> Quantized | Deferred
    einsum: Callable[..., Any]  # (equation, x, w) -> y
    ragged: Callable[..., Any]  # (x, w, sizes) -> y
    all_gather_matmul: Callable[..., Any]  # (x, [(equation, w)], axis, dim) -> [y]
    matmul_reduce_scatter: Callable[..., Any]  # (equation, h, w, axis, dim) -> y
    residual: Callable[..., Any]  # (x) -> what the weight gradient reads
    restored: Callable[..., Any]  # (x, kept) -> x as the weight gradient reads it


PER_TENSOR = Kernels(
    per_tensor.activation, per_tensor.weight, per_tensor.einsum, grouped.ragged, collective.all_gather_matmul,
    collective.matmul_reduce_scatter, per_tensor.residual, per_tensor.restored,
)
BLOCKWISE = Kernels(
    blockwise.ahead, blockwise.ahead, blockwise.einsum, blockwise_grouped.ragged,
    blockwise_collective.all_gather_matmul, blockwise_collective.matmul_reduce_scatter, blockwise.residual,
    blockwise.restored,
)
BLOCK_SCALED = Kernels(
    blockwise.ahead, blockwise.ahead, block_scaled.einsum, block_scaled_grouped.ragged,
    block_scaled_collective.all_gather_matmul, block_scaled_collective.matmul_reduce_scatter, blockwise.residual,
    blockwise.restored,
)
KERNELS = {"delayed": PER_TENSOR, "current": PER_TENSOR, "blockwise": BLOCKWISE, "mxfp8": BLOCK_SCALED,
           "nvfp4": BLOCK_SCALED}


def kernels(recipe: Recipe) -> Kernels:
    """The kernels of ``recipe`` (its row of :data:`KERNELS`)."""
    return KERNELS[recipe.mode]
