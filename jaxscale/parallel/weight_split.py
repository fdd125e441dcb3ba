"""Zero bubble's W slot at the price of the weight-gradient matmuls: a unit's weight matmuls split between its
B slot (:meth:`~jaxscale.parallel.stage_slots.Slots.backward_slot`) and its W slot (``weight_slot``).

Every weight matmul of a unit goes through :func:`jaxscale.precision.policy.einsum`. While a split schedule's slot
traces a unit (:func:`tracing`), the stage's layout carries a :class:`Trace`
(:attr:`jaxscale.layout.rules.Stage.weights`)
and ``precision.einsum`` hands it each matmul ``y = einsum(x, w)``:

* **B** (``taps``): ``y`` with ``w``'s gradient stopped, plus a zero *tap*, an input of the function B
  differentiates, so that the tap's cotangent is the matmul's output gradient ``dy``. The matmul's input
  (:func:`readable`: as it is, or fp8's e4m3 values and scale, or blockwise fp8's compute-dtype values that the
  weight gradient tiles the other way) is an output of the unit's trace, once for matmuls that read the same
  input (q, k and v). Everything of the unit that is not a weight matmul (norm scales, the router, grouped
  experts, a model's own einsums) takes its gradient in B, with the input's: correct for any model.
* **W** (``kept``): each matmul ``einsum(x_kept, w)``, its live input ignored; the unit's matmul outputs,
  differentiated in its parameters by the kept ``dy``, give each ``dW = xᵀ·dy`` to its parameter through
  whatever the unit does to it (casts, FSDP's gathers, fused projections), by the einsum's own backward (the
  policy's gradient dtype, fp8's weight-gradient path and history updates). Nothing reads the rest of the
  unit's forward there: XLA removes it, and the slot runs the weight-gradient matmuls alone.

What B keeps for W, per unit (:func:`kept_bytes`): every distinct matmul input and every matmul output
gradient; a Llama layer with model width h, q·d = h, kv heads' width k and MLP width f: inputs 3h + f
(normed input, attention output, normed input, hidden), output gradients 3h + 2k + 2f (q, o, down: h; k, v;
gate, up) per token, against the one h of the layer's input the unsplit backward keeps.

A first trace (``Trace()`` under ``jax.eval_shape``, :func:`types`) finds the taps' and the kept inputs'
types. A unit's matmuls must be traced where the unit is (no ``jax.checkpoint``, scan or conditional around
them inside the unit, as in every built-in model: a stage runs no remat); otherwise the kept inputs escape
their trace and jax says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.sharding import active, use_layout, vary
from jaxscale.precision import fp8

Projection = Callable[[str, Any, Any], jax.Array]  # precision.einsum outside a split slot


def readable(x: jax.Array | fp8.Operand) -> Any:
    """What the weight gradient reads of a matmul input: the array, fp8's e4m3 values with their scale and
    amax (per tensor), or the compute-dtype values (blockwise: tiled along the tokens for it)."""
    if not isinstance(x, fp8.Operand):
        return x
    return x.value if x.quantized is None else x.quantized


def restored(x: jax.Array | fp8.Operand, kept: Any) -> jax.Array | fp8.Operand:
    """Matmul input ``x`` read from what B kept of it; an fp8 input without its history (B pushed its amax), its
    live compute-dtype values (unread by the e4m3 matmul) cut from the gradient: the unit's forward stays dead."""
    if not isinstance(x, fp8.Operand):
        return kept
    if x.quantized is None:
        return x.replace(value=kept, history=None)
    return x.replace(value=lax.stop_gradient(x.value), quantized=kept, history=None)


@dataclasses.dataclass(eq=False)
class Trace:
    """One trace of a unit's weight matmuls: the first (no arguments), B's (``taps``) or W's (``kept``)."""

    taps: Sequence[jax.Array] | None = None  # B: a zero per matmul, added to its output
    kept: Sequence[Any] | None = None  # W: each distinct matmul input as B kept it (:func:`readable`)
    inputs: list[Any] = dataclasses.field(default_factory=list)  # each distinct matmul input, as read
    outputs: list[jax.Array] = dataclasses.field(default_factory=list)  # each matmul's output
    seen: dict[int, int] = dataclasses.field(default_factory=dict)  # an input's first array -> its place

    def einsum(self, equation: str, x: jax.Array | fp8.Operand, w: jax.Array | fp8.Operand,
               projection: Projection) -> jax.Array:
        """Matmul ``einsum(equation, x, w)`` of the unit, as this trace runs it."""
        read = readable(x)
        slot = self.seen.setdefault(id(jax.tree.leaves(read)[0]), len(self.inputs))
        if slot == len(self.inputs):
            self.inputs.append(read)
        if self.kept is not None:
            y = projection(equation, restored(x, self.kept[slot]), w)
        else:
            y = projection(equation, x, lax.stop_gradient(w))
            y = y if self.taps is None else y + self.taps[len(self.outputs)]
        self.outputs.append(y)
        return y


@contextlib.contextmanager
def tracing(trace: Trace) -> Iterator[Trace]:
    """Within this block the stage's weight matmuls run through ``trace``."""
    mesh, place = active()
    stage = dataclasses.replace(place.stage, weights=trace)
    with use_layout(mesh, dataclasses.replace(place, stage=stage)):
        yield trace


def types(unit: Callable[[], Any]) -> tuple[list[jax.ShapeDtypeStruct], list[Any]]:
    """The types of a unit's matmul outputs and of its distinct matmul inputs (:func:`readable`), from a first
    trace of ``unit()``; nothing runs."""

    def first() -> tuple[list[jax.Array], list[Any]]:
        with tracing(Trace()) as trace:
            unit()
        return trace.outputs, trace.inputs

    return jax.eval_shape(first)


def zeros(shapes: Any, lead: tuple[int, ...] = ()) -> Any:
    """Zeros of ``jax.ShapeDtypeStruct``s (with leading dimensions ``lead``), each varying over the manual axes
    its type does."""

    def one(s: jax.ShapeDtypeStruct) -> jax.Array:
        manual = s.manual_axis_type  # None outside a shard_map
        return vary(jnp.zeros((*lead, *s.shape), s.dtype), tuple(sorted(manual.varying)) if manual else ())

    return jax.tree.map(one, shapes)


def input_grad(unit: Callable[[], Any], taps: Sequence[jax.Array]) -> tuple[Any, list[Any]]:
    """B: ``unit()``'s output, its weight matmuls' gradient deferred and ``taps`` added to their outputs, and
    the matmul inputs W reads."""
    with tracing(Trace(taps=taps)) as trace:
        out = unit()
    return out, trace.inputs


def weight_outputs(unit: Callable[[], Any], kept: Sequence[Any]) -> list[jax.Array]:
    """W: the outputs of ``unit()``'s weight matmuls on the inputs B kept (the rest of the unit is dead)."""
    with tracing(Trace(kept=kept)) as trace:
        unit()
    return trace.outputs


def kept_bytes(shapes: Any) -> int:
    """The bytes of what B keeps for W (types from :func:`types`)."""
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
