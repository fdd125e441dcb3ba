"""A projection's operand on its way into fp8 (:class:`Operand`), and what code outside the fp8 kernels does
with an operand that may be fp8 or a plain array: its arrays mapped by role (:func:`mapped`: shard_map specs,
gathers, constraints), its readers (:func:`sharing`), its histories pushed (:func:`pushed`).

What a recipe makes ahead of its kernels is a typed variant, never a None: :class:`Quantized` (per tensor:
the e4m3 values, made once and read by every projection that shares the input) or :class:`Deferred`
(tiled recipes: quantized inside each kernel). The kernels that read it are the recipe's row of
:data:`jaxscale.precision.fp8.recipes.KERNELS`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxscale.precision.fp8.scaling import Quantized, Recipe, global_amax

Map = Callable[[Any], Any]


def _same(a: Any) -> Any:
    return a


class Deferred(NamedTuple):
    """Nothing made ahead: the recipe quantizes inside its kernels (``blockwise``'s tiles and blocks)."""

    def mapped(self, float8: Map, scale: Map) -> Deferred:
        """Itself: it holds no arrays."""
        return self


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "quantized", "history", "grad_history"],
    meta_fields=["recipe"],
)
@dataclasses.dataclass(frozen=True)
class Operand:
    """A projection operand on its way into fp8: ``value`` in the compute dtype (whose gradient the projection
    returns), what its recipe made of it ahead of the kernels (:class:`Quantized` or :class:`Deferred`), its amax
    history (None: another projection updates it) and, for a weight, the history of the output gradient's amax."""

    value: jax.Array
    quantized: Quantized | Deferred
    history: jax.Array | None
    grad_history: jax.Array | None
    recipe: Recipe

    def replace(self, **changes: Any) -> Operand:
        return dataclasses.replace(self, **changes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def mapped(
        self, tensor: Map, float8: Map | None = None, scale: Map = _same, history: Map = _same,
        grad_history: Map | None = None,
    ) -> Operand:
        """The operand's arrays through a function by role: the value through ``tensor``, the float8 values
        through ``float8`` (default ``tensor``), the scale and amax through ``scale``, the histories (those there
        are) through ``history`` and ``grad_history`` (default ``history``)."""
        return Operand(
            tensor(self.value),
            self.quantized.mapped(tensor if float8 is None else float8, scale),
            jax.tree.map(history, self.history),
            jax.tree.map(history if grad_history is None else grad_history, self.grad_history),
            self.recipe,
        )


def mapped(x: jax.Array | Operand, tensor: Map, **roles: Map) -> Any:
    """``x``'s arrays through :meth:`Operand.mapped`'s functions by role; a plain array is a tensor."""
    return x.mapped(tensor, **roles) if isinstance(x, Operand) else tensor(x)


def sharing(x: jax.Array | Operand, n: int) -> list[Any]:
    """Input ``x`` for ``n`` projections that read it: an fp8 input's history updated by the first only."""
    return [x] + [mapped(x, _same, history=lambda _: None, grad_history=_same)] * (n - 1)


def pushed(history: jax.Array | None, amax: jax.Array) -> jax.Array | None:
    """The history with ``amax`` (:func:`global_amax`) as its newest entry and the oldest dropped (None: no
    history to update); per expert, histories ``[experts, steps]`` and amaxes ``[experts]``."""
    return jax.tree.map(lambda h: jnp.roll(h, 1, axis=-1).at[..., 0].set(global_amax(amax, h)), history)
