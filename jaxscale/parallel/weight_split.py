"""Zero bubble's W slot at the price of the weight-gradient matmuls: a unit's weight matmuls split between its
B slot (:meth:`~jaxscale.parallel.stage_slots.Slots.backward_slot`) and its W slot (``weight_slot``).

Every weight matmul of a unit goes through :func:`jaxscale.precision.policy.einsum`. While a split schedule's slot
traces a unit (:func:`reap`), the stage's layout carries a :class:`Split` (:attr:`jaxscale.layout.rules.Stage.weights`)
and ``precision.einsum`` hands it each matmul ``y = einsum(x, w)``, which it marks (``checkpoint_name``: its input
:data:`IN`, its output :data:`OUT`). Nothing is recorded while the unit is traced: :func:`reap` traces it to a
jaxpr and runs that again equation by equation, and the marks there give the slot its records as values:

* **B** (``taps``): ``y`` with ``w``'s gradient stopped, plus a zero *tap*, an input of the function B
  differentiates, so that the tap's cotangent is the matmul's output gradient ``dy``. The matmul's input
  (:func:`readable`: as it is, or what its fp8 recipe's weight gradient reads: per tensor the e4m3 values and
  scale, blockwise the compute-dtype values that the weight gradient tiles the other way) is an output of the
  unit's trace, once for matmuls that read the same input (q, k and v). Everything of the unit that is not a
  weight matmul (norm scales, the router, grouped experts, a model's own einsums) takes its gradient in B, with
  the input's: correct for any model.
* **W** (``kept``): each matmul ``einsum(x_kept, w)``, its live input ignored; the unit's matmul outputs,
  differentiated in its parameters by the kept ``dy``, give each ``dW = xᵀ·dy`` to its parameter through
  whatever the unit does to it (casts, FSDP's gathers, fused projections), by the einsum's own backward (the
  policy's gradient dtype, fp8's weight-gradient path and history updates). Nothing reads the rest of the
  unit's forward there: XLA removes it, and the slot runs the weight-gradient matmuls alone.

What B keeps for W, per unit (:func:`kept_bytes`): every distinct matmul input and every matmul output
gradient; a Llama layer with model width h, q·d = h, kv heads' width k and MLP width f: inputs 3h + f
(normed input, attention output, normed input, hidden), output gradients 3h + 2k + 2f (q, o, down: h; k, v;
gate, up) per token, against the one h of the layer's input the unsplit backward keeps.

A first trace (under ``jax.eval_shape``, :func:`types`) finds the taps' and the kept inputs'
types. A unit's matmuls must be traced where the unit is (no ``jax.checkpoint``, scan or conditional around
them inside the unit, as in every built-in model: a stage runs no remat); otherwise their marks lie in an inner
jaxpr, where :func:`reap` does not look.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal, Var, subjaxprs

from jaxscale.layout.sharding import active, use_layout, vary, varying
from jaxscale.precision import fp8

Projection = Callable[[str, Any, Any], jax.Array]  # precision.einsum outside a split slot


def readable(x: jax.Array | fp8.Operand) -> tuple[Any, Callable[[Any], Any]]:
    """What the weight gradient reads of a matmul input (the array, or what its fp8 recipe's weight gradient
    reads: :func:`jaxscale.precision.fp8.kernels`' ``residual``) and how the input is read back from it (an fp8
    input without its history: B pushed its amax; the unit's forward stays dead)."""
    if isinstance(x, fp8.Operand):
        kernels = fp8.kernels(x.recipe)
        return kernels.residual(x), functools.partial(kernels.restored, x)
    return x, lambda kept: kept


IN, OUT = "jaxscale.weight_split.input", "jaxscale.weight_split.output"  # the marks a slot's unit leaves


@dataclasses.dataclass(frozen=True)
class Split:
    """How a split slot's unit runs its weight matmuls (:attr:`jaxscale.layout.rules.Stage.weights`): each
    weight's gradient stopped (B, and the first trace) or each matmul on the input B kept (W, ``kept``). It
    holds nothing that changes: each matmul marks its input (:data:`IN`) and output (:data:`OUT`) in the
    unit's jaxpr, where :func:`reap` finds them."""

    kept: bool = False
    axes: tuple[str, ...] = ()  # W: the manual axes the kept inputs vary over; each marked input is typed so too

    def einsum(self, equation: str, x: jax.Array | fp8.Operand, w: jax.Array | fp8.Operand,
               projection: Projection) -> jax.Array:
        """Matmul ``einsum(equation, x, w)`` of the unit, marked."""
        residual, restore = readable(x)
        leaves, tree = jax.tree.flatten(residual)
        marked = [checkpoint_name(a, f"{IN} {k}") for k, a in enumerate(leaves)]
        read = tree.unflatten([vary(a, self.axes) for a in marked] if self.axes else marked)  # as kept ones vary
        y = projection(equation, restore(read), w) if self.kept else projection(equation, x, lax.stop_gradient(w))
        return checkpoint_name(y, OUT)


@dataclasses.dataclass
class _Records:
    """What one run of :func:`reap` reads off its jaxpr (local to that run)."""

    inputs: list[list[Any]] = dataclasses.field(default_factory=list)  # each distinct matmul input's leaves
    outputs: list[jax.Array] = dataclasses.field(default_factory=list)  # each matmul's output
    seen: dict[Any, int] = dataclasses.field(default_factory=dict)  # an input's first leaf's variable -> place
    slot: int = 0  # the input whose leaves are being read
    kept: set[Any] = dataclasses.field(default_factory=set)  # W: the variables a kept input stands in for


def _marked(records: _Records, eqn: Any, value: Any, taps: Sequence[jax.Array] | None,
            kept: Sequence[Any] | None) -> Any:
    """The value a mark stands for: a matmul input as read (or as B kept it, in W), an output plus its tap (B)."""
    tag = eqn.params["name"]
    if tag == OUT:
        value = value if taps is None else value + taps[len(records.outputs)]
        records.outputs.append(value)
        return value
    leaf = int(tag.split()[-1])
    if leaf == 0:
        records.slot = records.seen.setdefault(eqn.invars[0], len(records.inputs))
        if records.slot == len(records.inputs):
            records.inputs.append([])
    if len(records.inputs[records.slot]) == leaf:
        records.inputs[records.slot].append(value)
    if kept is None:
        return value
    records.kept.add(eqn.outvars[0])
    return vary(kept[records.slot][leaf], _varying(eqn.outvars[0]))


def _varying(var: Any) -> tuple[str, ...]:
    return tuple(sorted(var.aval.manual_axis_type.varying))


def _is_mark(eqn: Any) -> bool:
    return eqn.primitive.name == "name" and eqn.params["name"].startswith((IN, OUT))


def _marks(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in it holds a mark."""
    return any(_is_mark(eqn) for eqn in jaxpr.eqns) or any(_marks(inner) for inner in subjaxprs(jaxpr))


def reap(unit: Callable[[], Any], split: Split, taps: Sequence[jax.Array] | None = None,
         kept: Sequence[Any] | None = None) -> tuple[Any, list[tuple], list[jax.Array]]:
    """``unit()`` under ``split``, traced once to a jaxpr and run from it equation by equation (the same
    primitives, so the same program): its output, each distinct matmul input (:func:`readable`'s leaves) and
    each matmul output, as values. B adds ``taps`` to the outputs; W reads the inputs from ``kept``."""
    mesh, place = active()
    with use_layout(mesh, dataclasses.replace(place, stage=dataclasses.replace(place.stage, weights=split))):
        closed, shape = jax.make_jaxpr(unit, return_shape=True)()
    if any(_marks(inner) for inner in subjaxprs(closed.jaxpr)):
        raise ValueError("zero bubble's split: a weight matmul of a stage's unit runs inside a nested jax "
                         "transformation (jit, checkpoint, scan, cond): its weight gradient cannot wait for the W")
    env, records = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True)), _Records()
    for eqn in closed.jaxpr.eqns:
        args = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
        if _is_mark(eqn):
            env[eqn.outvars[0]] = _marked(records, eqn, args[0], taps, kept)
            continue
        if eqn.primitive.name == "pvary" and records.kept.intersection(v for v in eqn.invars if isinstance(v, Var)):
            # W typing a kept input as it marked its live one: the axes the kept one lacks
            env.update((v, vary(a, _varying(v))) for v, a in zip(eqn.outvars, args, strict=True))
            continue
        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))
    result = jax.tree.unflatten(jax.tree.structure(shape), [env[v] if not isinstance(v, Literal) else v.val
                                                            for v in closed.jaxpr.outvars])
    return result, [tuple(leaves) for leaves in records.inputs], records.outputs


def types(unit: Callable[[], Any]) -> tuple[list[jax.ShapeDtypeStruct], list[Any]]:
    """The types of a unit's matmul outputs and of its distinct matmul inputs (:func:`readable`), from a first
    trace of ``unit()``; nothing runs."""
    def first() -> tuple[list[jax.Array], list[tuple]]:
        _, inputs, outputs = reap(unit, Split())
        return outputs, inputs

    return jax.eval_shape(first)


def zeros(shapes: Any, lead: tuple[int, ...] = ()) -> Any:
    """Zeros of ``jax.ShapeDtypeStruct``s (with leading dimensions ``lead``), each varying over the manual axes
    its type does."""

    def one(s: jax.ShapeDtypeStruct) -> jax.Array:
        manual = s.manual_axis_type  # None outside a shard_map
        return vary(jnp.zeros((*lead, *s.shape), s.dtype), tuple(sorted(manual.varying)) if manual else ())

    return jax.tree.map(one, shapes)


def input_grad(unit: Callable[[], Any], taps: Sequence[jax.Array]) -> tuple[Any, list[tuple]]:
    """B: ``unit()``'s output, its weight matmuls' gradient deferred and ``taps`` added to their outputs, and
    the matmul inputs W reads."""
    out, inputs, _ = reap(unit, Split(), taps=taps)
    return out, inputs


def weight_outputs(unit: Callable[[], Any], kept: Sequence[Any]) -> list[jax.Array]:
    """W: the outputs of ``unit()``'s weight matmuls on the inputs B kept (the rest of the unit is dead)."""
    axes = {a for leaf in jax.tree.leaves(kept) for a in varying(leaf)}
    return reap(unit, Split(kept=True, axes=tuple(sorted(axes))), kept=kept)[2]


def kept_bytes(shapes: Any) -> int:
    """The bytes of what B keeps for W (types from :func:`types`)."""
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
