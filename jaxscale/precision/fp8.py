"""FP8 projections: float8 arrays handed to ``lax.dot_general``, forward and backward (``precision.fp8``).

What is quantized: the projections of every block, q/k/v/o of attention and
gate/up/down of the MLP (the shared expert's too), and the routed experts'
(a scale and a history per expert, :mod:`jaxscale.models.routing`; grouped
matmuls: :mod:`jaxscale.precision.fp8_grouped`, :mod:`jaxscale.precision.fp8_blockwise_grouped`).
The embedding and the MoE router stay in ``model.dtype``; so does the LM head
unless ``precision.fp8_head`` (the head and the router are small and
sensitive). Master
weights, gradients and Adam's moments stay fp32 (:mod:`jaxscale.training.optim`).

One ``custom_vjp`` per projection ``y = x · w`` (:func:`einsum`):

- forward: ``dot_general(q_x, q_w)`` on e4m3 operands (largest value 448),
  accumulated in fp32, times the product of the two fp32 scalar scales, then
  cast to the compute dtype;
- backward: the gradient ``g`` arriving at ``y`` quantized to e5m2 (range to
  57344, fewer mantissa bits), then ``dx = dot(q_g, q_w)`` and
  ``dw = dot(q_x, q_g)``: e5m2 against e4m3, never e5m2 x e5m2 (cuBLASLt has
  no such kernel). The weight gradient leaves the matmul in fp32 and is cast
  once to the weight's dtype (fp32 with an fp32 compute copy).
- residuals: the e4m3 operands themselves (1 byte an element), the activation
  one named :data:`RESIDUAL` so that ``model.remat: save_named`` can keep it.

This is the form XLA's GPU GEMM rewriter takes without pattern matching a
dequantization (``MatchFp8Param``: an operand that is itself f8 matches
directly; a multiply of the fp8 GEMM's output by a broadcast scalar is taken
into the call as its output scale, ``F8ScaleD``): ``__cublas$lt$matmul$f8``
on Hopper and later. On CPU XLA computes the dot in a wider type (the
numerics are fp8's, the speed is not).

Scaling recipe (per tensor, as Transformer Engine): ``x`` of format ``F`` is
stored as ``clip(x / s, ±max_F)`` cast to ``F`` and read as that times ``s``,
``s = amax · 2^margin / max_F``. ``current`` takes ``amax = max|x|``;
``delayed`` the largest of the last ``precision.amax_history`` steps'
amaxes, or the tensor's own while the history is empty (a ``jnp.where``:
nothing in the step branches). Scales are fp32 scalars. ``blockwise`` is
DeepSeek-V3's recipe (:mod:`jaxscale.precision.fp8_blockwise`).

Weights are quantized once per forward (per step; per microbatch under
``train.microbatches``; once per step in a pipeline), before the layer scan (:func:`prepare`): the layers
get their e4m3 copy and scale as scanned inputs, so the remat recompute does
not quantize them again, and FSDP gathers the e4m3 copy (XLA:CPU widens it to
f16 for the collective; the tiny model under ``zero3``: every weight gather
2 bytes an element where bf16 compute gathers fp32 on CPU).
An activation read by several projections (q, k and v read the same input) is
quantized once; the first projection updates its history.

State: one amax history (fp32, newest first) per quantized tensor, an
:class:`Fp8Meta` variable of the module (:class:`Fp8`), stacked with the
blocks (``[layers, amax_history]``). The trainer splits it from the
parameters (``TrainState.fp8``, replicated, checkpointed, never seen by the
optimizer) and differentiates the loss with respect to it too: the
projection's backward returns, as the "gradient" of each history, the
history with this step's amax pushed in, and the train step takes that as
the new value (flax's fp8 ops do the same). Under gradient accumulation the
microbatches' histories are combined with a maximum.

Sharding: inputs and weights are quantized in the partitioned program, so
their amax is the partitioner's global reduction; inside a sequence-parallel
``shard_map`` the f8 arrays are what is gathered, and the output gradient's
amax is a ``pmax`` over the axes it varies over: every layout quantizes as
one device. Inside a pipeline stage (:mod:`jaxscale.parallel.stage_program`)
each stage holds its own layers' histories and quantizes its weights once per
step, before the loop of ticks; a history's update is the largest of the
microbatches' (:func:`global_amax`, :meth:`~jaxscale.parallel.stage_units.Units.add_amax`; the head's
on the last stage). Per-tensor scales there are per microbatch, as under ``train.microbatches``.
Collective matmuls (``model.tp_overlap``) quantize as the plain collectives do: one scale per
operand for the whole ring, a ``custom_vjp`` around it (:mod:`jaxscale.parallel.fp8_collective`;
``blockwise``: each chunk's tiles, :mod:`jaxscale.parallel.fp8_blockwise_collective`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.read import ConfigError, PrecisionConfig

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RESIDUAL = "fp8_input"  # the checkpoint_name of a projection's e4m3 input


class Fp8Meta(nnx.Variable):
    """The amax history of one quantized tensor (newest first): fp8 scaling state, not a parameter."""


class Fp8Weight(nnx.Variable):
    """A weight's e4m3 copy for this step (:func:`prepare`): made inside the step, never saved."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How scales are chosen: ``delayed`` (amax history), ``current`` (the tensor's amax), ``blockwise``."""

    mode: str
    margin: int
    block: int = 128

    @property
    def delayed(self) -> bool:
        return self.mode == "delayed"


class Quantized(NamedTuple):
    """A tensor in float8: the values, the scale that reads them back, and the tensor's amax (fp32)."""

    q: jax.Array
    scale: jax.Array
    amax: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "quantized", "history", "grad_history"],
    meta_fields=["recipe"],
)
@dataclasses.dataclass(frozen=True)
class Operand:
    """A projection operand on its way into fp8: ``value`` in the compute dtype (whose gradient the projection
    returns), its e4m3 form (None: quantized inside the projection, ``blockwise``), its amax history (None:
    another projection updates it) and, for a weight, the history of the output gradient's amax."""

    value: jax.Array
    quantized: Quantized | None
    history: jax.Array | None
    grad_history: jax.Array | None
    recipe: Recipe

    def replace(self, **changes: Any) -> Operand:
        return dataclasses.replace(self, **changes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape


def global_amax(amax: jax.Array, history: jax.Array) -> jax.Array:
    """A device's ``amax`` as the tensor's: the ``pmax`` over the manual mesh axes it varies over and
    ``history`` does not. Whole histories (a sequence-parallel ``shard_map``) reduce over every axis the
    tensor is split over; inside a pipeline stage each stage holds its own layers' histories (varying over
    ``stage``): a stage's amax is its own."""
    axes = tuple(sorted(jax.typeof(amax).mat.varying - jax.typeof(history).mat.varying))
    return lax.pmax(amax, axes) if axes else amax


def _amax(x: jax.Array, history: jax.Array) -> jax.Array:
    """``max|x|`` in fp32 over the devices that hold parts of ``x`` (:func:`global_amax`)."""
    return global_amax(jnp.max(jnp.abs(x)).astype(jnp.float32), history)


def pushed(history: jax.Array | None, amax: jax.Array) -> jax.Array | None:
    """The history with ``amax`` (:func:`global_amax`) as its newest entry and the oldest dropped (None: no
    history to update); per expert, histories ``[experts, steps]`` and amaxes ``[experts]``."""
    if history is None:
        return None
    return jnp.roll(history, 1, axis=-1).at[..., 0].set(global_amax(amax, history))


def scale_of(amax: jax.Array, fmt: Any, margin: int) -> jax.Array:
    """The scale mapping ``amax · 2^margin`` to the largest value of ``fmt`` (1 where amax is 0 or not finite)."""
    s = amax * 2.0**margin / float(jnp.finfo(fmt).max)
    return jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0)


def scale(history: jax.Array, amax: jax.Array, fmt: Any, recipe: Recipe) -> jax.Array:
    """The dequantization scale of a tensor of amax ``amax``: from the history (``delayed``, once it holds an
    amax) or from ``amax``. A select, not a branch."""
    if not recipe.delayed:
        return scale_of(amax, fmt, recipe.margin)
    past = jnp.max(history, axis=-1)
    return jnp.where(past > 0, scale_of(past, fmt, recipe.margin), scale_of(amax, fmt, recipe.margin))


def cast(x: jax.Array, s: jax.Array, fmt: Any) -> jax.Array:
    """``x / s`` saturated to the range of ``fmt`` and cast to it."""
    top = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(fmt)


def quantize(x: jax.Array, history: jax.Array, fmt: Any, recipe: Recipe) -> Quantized:
    """``x`` in ``fmt`` scaled per tensor by ``recipe`` (no gradient flows through it)."""
    x, history = lax.stop_gradient(x), lax.stop_gradient(history)
    amax = _amax(x, history)
    s = scale(history, amax, fmt, recipe)
    return Quantized(cast(x, s, fmt), s, amax)


def stacked(x: jax.Array, history: jax.Array, recipe: Recipe) -> Quantized:
    """``x`` in e4m3 with one scale per leading index of ``history`` (``[..., steps]``): a stack of layers'
    weights, or of experts' (``[experts, ...]`` with ``[experts, steps]`` histories)."""
    fn = functools.partial(quantize, fmt=E4M3, recipe=recipe)
    for _ in range(history.ndim - 1):
        fn = jax.vmap(fn)
    return fn(x, history)


def along(scale: jax.Array, have: str, want: str) -> jax.Array:
    """A scale over the leading letters of ``have`` (a scalar: per tensor; ``[experts]``: per expert) shaped to
    broadcast against an array of letters ``want``."""
    lead = have[: scale.ndim]
    order = [c for c in want if c in lead]
    scale = jnp.transpose(scale, [lead.index(c) for c in order])
    return scale.reshape([scale.shape[order.index(c)] if c in lead else 1 for c in want])


def letters(equation: str) -> tuple[str, str, str]:
    """The operand and output subscripts of a two-operand einsum equation."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def dot(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(equation, a, b)`` as one ``lax.dot_general`` of ``a`` and ``b`` as they are (float8 included, of
    two formats too: no promotion), accumulated and returned in fp32."""
    lhs, rhs, out = letters(equation)
    shared = [c for c in lhs if c in rhs]
    if any(c not in out and c not in shared for c in lhs + rhs):
        raise ValueError(f"fp8 einsum {equation!r}: a letter summed over in one operand only")
    contract, batch = [c for c in shared if c not in out], [c for c in shared if c in out]
    dims = (
        (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
        (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
    )
    y = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    order = batch + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
    return jnp.transpose(y, [order.index(c) for c in out])


class _Static(NamedTuple):
    equation: str
    recipe: Recipe
    x_dtype: Any
    w_dtype: Any


def einsum(equation: str, x: Operand, w: Operand) -> jax.Array:
    """``einsum(equation, x, w)`` of an activation and a weight quantized per tensor, in ``x``'s dtype."""
    return _einsum(_Static(equation, x.recipe, jnp.dtype(x.value.dtype), jnp.dtype(w.value.dtype)), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(static: _Static, x: Operand, w: Operand) -> jax.Array:
    return _forward(static, x, w)[0]


def _forward(static: _Static, x: Operand, w: Operand) -> tuple[jax.Array, tuple]:
    qx, qw = x.quantized, w.quantized
    _, rhs, out = letters(static.equation)
    y = dot(static.equation, qx.q, qw.q) * (qx.scale * along(qw.scale, rhs, out))
    return y.astype(static.x_dtype), (qx, qw, x.history, w.history, w.grad_history)


def _backward(static: _Static, saved: tuple, g: jax.Array) -> tuple[Operand, Operand]:
    qx, qw, x_history, w_history, g_history = saved
    recipe = static.recipe
    lhs, rhs, out = letters(static.equation)
    qg = quantize(g, g_history, E5M2, recipe)
    dx = dot(f"{out},{rhs}->{lhs}", qg.q, qw.q) * (qg.scale * along(qw.scale, rhs, lhs))
    dw = dot(f"{lhs},{out}->{rhs}", qx.q, qg.q) * (qx.scale * qg.scale)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(qw.q).mat.varying))
    if summed:  # inside a shard_map: the partial weight gradients of the devices x is split over, in fp32
        dw = lax.psum(dw, summed)
    summed = tuple(sorted(jax.typeof(dx).mat.varying - jax.typeof(qx.q).mat.varying))
    if summed:  # x the same on the devices w is split over (TP inside a pipeline stage): its partial gradients
        dx = lax.psum(dx, summed)

    none = Quantized(None, None, None)
    dx_op = Operand(dx.astype(static.x_dtype), none, pushed(x_history, qx.amax), None, recipe)
    dw_op = Operand(dw.astype(static.w_dtype), none, pushed(w_history, qw.amax), pushed(g_history, qg.amax), recipe)
    return dx_op, dw_op


_einsum.defvjp(_forward, _backward)


def activation(x: jax.Array, history: jax.Array, recipe: Recipe) -> Operand:
    """Activation ``x`` as the input of one or more projections (e4m3 but for ``blockwise``; ``history``
    updated once, :func:`sharing`)."""
    if recipe.mode == "blockwise":
        return Operand(x, None, history, None, recipe)
    q = quantize(x, history, E4M3, recipe)
    return Operand(x, q._replace(q=checkpoint_name(q.q, RESIDUAL)), history, None, recipe)


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
        self.recipe = Recipe(precision.fp8, precision.margin, precision.fp8_block)
        self.weights = dict(weights)
        self.input_names = tuple(inputs)
        steps = precision.amax_history
        for name in (*inputs, *weights.values()):
            setattr(self, name, Fp8Meta(jnp.zeros((steps,), jnp.float32), out_sharding=(None,)))
        per_weight = ((experts, steps), (None, None)) if experts else ((steps,), (None,))
        for name in weights:
            setattr(self, name, Fp8Meta(jnp.zeros(per_weight[0], jnp.float32), out_sharding=per_weight[1]))

    @property
    def per_tensor(self) -> bool:
        return self.recipe.mode != "blockwise"

    def input(self, name: str, x: jax.Array) -> Operand:
        """Activation ``name``, the input of one or more projections (e4m3; its history updated once)."""
        return activation(x, getattr(self, name)[...], self.recipe)

    def inputs(self) -> Inputs:
        """The activations' histories, to quantize inputs with outside this module (:class:`Inputs`)."""
        return Inputs({name: getattr(self, name)[...] for name in self.input_names}, self.recipe)

    def weight(self, name: str, w: jax.Array) -> Operand:
        """Weight ``name`` (the module's attribute) in the compute dtype: its e4m3 copy made by :meth:`prepare`,
        or made here where there is none."""
        history, grad_history = getattr(self, name)[...], getattr(self, self.weights[name])[...]
        cached = getattr(self, f"{name}_e4m3", None)
        if not self.per_tensor:
            q = None
        else:
            q = cached.get_value() if cached is not None else stacked(w, history, self.recipe)
        return Operand(w, q, history, grad_history, self.recipe)

    def prepare(self, weights: Mapping[str, jax.Array]) -> dict[str, Quantized]:
        """Quantize ``weights`` (stacked like the histories: ``[layers, ...]``) for :meth:`weight`; returned too."""
        if not self.per_tensor:
            return {}
        copies = {name: stacked(w, getattr(self, name)[...], self.recipe) for name, w in weights.items()}
        self.use(copies)
        return copies

    def use(self, copies: Mapping[str, Quantized]) -> None:
        """Read the weights' e4m3 copies ``copies`` (made by :meth:`prepare`) in :meth:`weight`."""
        for name, q in copies.items():
            setattr(self, f"{name}_e4m3", Fp8Weight(q))


def _owners(root: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """The modules under ``root`` whose ``fp8`` is an :class:`Fp8`, by their path."""
    found = nnx.iter_graph(root)
    return [("/".join(map(str, p)), m) for p, m in found if isinstance(getattr(m, "fp8", None), Fp8)]


def prepare(root: nnx.Module) -> dict[str, dict[str, Quantized]]:
    """Quantize every fp8 weight under ``root`` once, before the layers run: each module whose ``fp8`` is an
    :class:`Fp8` has its weights (the attributes it names) quantized into it. Returns the copies by the
    owner's path (for :func:`attach`)."""
    return {
        path: module.fp8.prepare({name: getattr(module, name)[...] for name in module.fp8.weights})
        for path, module in _owners(root)
    }


def attach(root: nnx.Module, copies: Mapping[str, Mapping[str, Quantized]]) -> None:
    """Give the modules under ``root`` the e4m3 weight copies :func:`prepare` made (of another copy of it)."""
    for path, module in _owners(root):
        module.fp8.use(copies.get(path, {}))


def sharing(x: Operand, n: int) -> list[Operand]:
    """fp8 input ``x`` for ``n`` projections that read it: its history updated by the first only."""
    return [x] + [x.replace(history=None)] * (n - 1)


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
