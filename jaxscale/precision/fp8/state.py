"""The fp8 state of a module's projections (:class:`Fp8`): an amax history per input, per weight and per
weight's output gradient, the operands its projections read, and the weights' copies made once a step.

State: one amax history (fp32, newest first) per quantized tensor, an :class:`Fp8Meta` variable of the module,
stacked with the blocks (``[layers, amax_history]``). The trainer splits it from the parameters
(``TrainState.fp8``, replicated, checkpointed, never seen by the optimizer) and differentiates the loss with
respect to it too: the projection's backward returns, as the "gradient" of each history, the history with this
step's amax pushed in, and the train step takes that as the new value (flax's fp8 ops do the same). Under
gradient accumulation the microbatches' histories are combined with a maximum (:func:`combine`).

Weights are quantized once per forward (per step; per microbatch under ``train.microbatches``; once per step in
a pipeline), before the layer scan (:func:`prepare`): the layers get their copies as scanned inputs and read
them through :func:`using` (nothing is set on a module), so the remat recompute does not quantize them again,
and FSDP gathers the e4m3 copy. An activation read by several projections (q, k and v read the same input) is
quantized once; the first projection updates its history (:func:`jaxscale.precision.fp8.operand.sharing`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.config.read import ConfigError, PrecisionConfig
from jaxscale.precision.fp8.operand import Deferred, Operand
from jaxscale.precision.fp8.recipes import kernels
from jaxscale.precision.fp8.scaling import Quantized, Recipe

Copies = Mapping[str, Mapping[str, Quantized | Deferred]]  # an fp8 module's path -> its weights' copies
F = TypeVar("F")


@dataclasses.dataclass(frozen=True)
class _Scope:
    """While a stack's layers are traced (:func:`using`): each fp8 module's weights' copies, by the module's id,
    and whether the modules take part at all (``plain``: :func:`live` is None, ``precision.nvfp4.bf16_last``)."""

    copies: Mapping[int, Mapping[str, Any]]
    plain: bool = False


_OUTSIDE = _Scope(types.MappingProxyType({}))
_SCOPE: contextvars.ContextVar[_Scope] = contextvars.ContextVar("fp8_scope", default=_OUTSIDE)


class Fp8Meta(nnx.Variable):
    """The amax history of one quantized tensor (newest first): fp8 scaling state, not a parameter."""


def activation(x: jax.Array, history: jax.Array, recipe: Recipe) -> Operand:
    """Activation ``x`` as the input of one or more projections (its recipe's form; ``history`` updated once,
    :func:`jaxscale.precision.fp8.operand.sharing`)."""
    return Operand(x, kernels(recipe).activation(x, history, recipe), history, None, recipe)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["histories"], meta_fields=["recipe"])
@dataclasses.dataclass(frozen=True)
class Inputs:
    """The activations' histories of a module's projections as a pytree (:meth:`Fp8.inputs`): what code that
    holds no module (a ``shard_map``'s body) quantizes its projections' inputs with."""

    histories: dict[str, jax.Array]
    recipe: Recipe

    def input(self, name: str, x: jax.Array) -> Operand:
        return activation(x, self.histories[name], self.recipe)


class Fp8(nnx.Module):
    """The fp8 state of one module's projections: an amax history per input, per weight and per weight's output.

    ``inputs``: the activations' names; ``weights``: each weight's attribute name on the owning module
    mapped to its output's name; ``experts``: the weights are stacks of that many experts', each with its
    own scale and history (``[experts, amax_history]``). Made only with ``precision.fp8`` on: with it off
    the owning module holds None and its projections never enter this module
    (:func:`jaxscale.models.llama.make_fp8`).
    """

    def __init__(
        self, precision: PrecisionConfig, inputs: Sequence[str], weights: Mapping[str, str], experts: int = 0
    ):
        nv = precision.nvfp4
        self.recipe = Recipe(precision.fp8, precision.margin, precision.fp8_block, nv.hadamard, nv.weight_2d,
                             nv.stochastic_rounding)
        self.weights = dict(weights)
        self.input_names = tuple(inputs)
        steps = precision.amax_history
        for name in (*inputs, *weights.values()):
            setattr(self, name, Fp8Meta(jnp.zeros((steps,), jnp.float32), out_sharding=(None,)))
        per_weight = ((experts, steps), (None, None)) if experts else ((steps,), (None,))
        for name in weights:
            setattr(self, name, Fp8Meta(jnp.zeros(per_weight[0], jnp.float32), out_sharding=per_weight[1]))

    def input(self, name: str, x: jax.Array) -> Operand:
        """Activation ``name``, the input of one or more projections (its history updated once)."""
        return activation(x, getattr(self, name)[...], self.recipe)

    def inputs(self) -> Inputs:
        """The activations' histories, to quantize inputs with outside this module (:class:`Inputs`)."""
        return Inputs({name: getattr(self, name)[...] for name in self.input_names}, self.recipe)

    def weight(self, name: str, w: jax.Array) -> Operand:
        """Weight ``name`` (the module's attribute) in the compute dtype: its copy made by :func:`prepare` (read
        through :func:`using`), or made here where there is none."""
        history, grad_history = getattr(self, name)[...], getattr(self, self.weights[name])[...]
        made = _SCOPE.get().copies.get(id(self), {})
        q = made[name] if name in made else kernels(self.recipe).weight(w, history, self.recipe)
        return Operand(w, q, history, grad_history, self.recipe)

    def prepare(self, weights: Mapping[str, jax.Array]) -> dict[str, Quantized | Deferred]:
        """``weights`` (stacked like the histories: ``[layers, ...]``) as their recipe makes them ahead."""
        made = kernels(self.recipe).weight
        return {name: made(w, getattr(self, name)[...], self.recipe) for name, w in weights.items()}


def _owners(root: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """The modules under ``root`` whose ``fp8`` is an :class:`Fp8`, by their path."""
    found = nnx.iter_graph(root)
    return [("/".join(map(str, p)), m) for p, m in found if isinstance(getattr(m, "fp8", None), Fp8)]


def prepare(root: nnx.Module) -> dict[str, dict[str, Quantized | Deferred]]:
    """Every fp8 weight under ``root`` made once, before the layers run, as its recipe makes it ahead: the copies
    by the owner's path (read in the layers through :func:`using`); ``root`` is left as it is."""
    return {
        path: module.fp8.prepare({name: getattr(module, name)[...] for name in module.fp8.weights})
        for path, module in _owners(root)
    }


@contextlib.contextmanager
def using(root: nnx.Module, copies: Copies, plain: bool = False) -> Iterator[None]:
    """Within this block the fp8 modules under ``root`` (a layer of the stack :func:`prepare` read, or the stack)
    read their weights from ``copies`` (by path, as :func:`prepare` returns them); with ``plain`` (or inside a
    plain block) no fp8 module takes part (:func:`live`)."""
    scope = _SCOPE.get()
    mine = {id(module.fp8): copies[path] for path, module in _owners(root) if path in copies}
    token = _SCOPE.set(_Scope({**scope.copies, **mine}, plain or scope.plain))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def live(f8: F | None) -> F | None:
    """A module's fp8 state (``module.fp8``) where its projections quantize: None with ``precision.fp8`` off (no
    state) and inside a plain :func:`using` block (the stack's last units, :mod:`jaxscale.precision.fp8.tail`)."""
    return None if f8 is None or _SCOPE.get().plain else f8


def check_resume(saved: dict[str, Any], precision: PrecisionConfig, step: int) -> None:
    """Raise if a checkpoint's fp8 state (``saved``: its config) does not restore into ``precision``'s."""
    old = {"fp8": "off", "amax_history": PrecisionConfig.amax_history, **saved.get("precision", {})}
    shape = (old["fp8"] != "off", old["amax_history"])
    if shape != (precision.fp8 != "off", precision.amax_history) and (shape[0] or precision.fp8 != "off"):
        raise ConfigError(
            f"resume: checkpoint step {step} has precision.fp8={old['fp8']} with amax_history="
            f"{old['amax_history']}, the config has precision.fp8={precision.fp8} with "
            f"amax_history={precision.amax_history} (switching between fp8 modes is fine)"
        )


def combine(a: Any, b: Any) -> Any:
    """Two microbatches' updated histories as one step's: the larger amax at each position."""
    return jax.tree.map(jnp.maximum, a, b)
