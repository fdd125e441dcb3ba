"""Per-tensor fp8 projections (``precision.fp8``: ``delayed``, ``current``): float8 arrays handed to
``lax.dot_general``, forward and backward.

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

The operands arrive quantized (:func:`activation`, :func:`weight`: made ahead of the kernel, once for an
input that several projections read and once per step for a weight); the scales are
:mod:`jaxscale.precision.fp8.scaling`'s.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.precision.fp8.operand import Operand, pushed
from jaxscale.precision.fp8.scaling import E4M3, E5M2, Quantized, Recipe, along, quantize, stacked
from jaxscale.precision.letters import letters, split

RESIDUAL = "fp8_input"  # the checkpoint_name of a projection's e4m3 input
NONE = Quantized(None, None, None)  # the cotangent of what was made ahead: none


def activation(x: jax.Array, history: jax.Array, recipe: Recipe) -> Quantized:
    """Activation ``x`` in e4m3, scaled per tensor, named :data:`RESIDUAL`."""
    q = quantize(x, history, E4M3, recipe)
    return q._replace(q=checkpoint_name(q.q, RESIDUAL))


def weight(w: jax.Array, history: jax.Array, recipe: Recipe) -> Quantized:
    """Weight ``w`` (a stack like ``history``: ``[layers, ...]``, ``[experts, ...]``) in e4m3, a scale per matrix."""
    return stacked(w, history, recipe)


def residual(x: Operand) -> Quantized:
    """What a weight gradient reads of input ``x``: its e4m3 values, scale and amax."""
    return x.quantized


def restored(x: Operand, kept: Quantized) -> Operand:
    """Input ``x`` read from what was kept of it (:func:`residual`), without its history (pushed already); its
    compute-dtype values (unread by the e4m3 matmul) cut from the gradient."""
    return x.replace(value=lax.stop_gradient(x.value), quantized=kept, history=None)


def dot(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(equation, a, b)`` as one ``lax.dot_general`` of ``a`` and ``b`` as they are (float8 included, of
    two formats too: no promotion), accumulated and returned in fp32."""
    lhs, rhs, out = letters(equation)
    batch, _, contract, _ = split(equation)
    dims = (
        (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
        (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
    )
    y = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    order = [*batch] + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
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

    dx_op = Operand(dx.astype(static.x_dtype), NONE, pushed(x_history, qx.amax), None, recipe)
    dw_op = Operand(dw.astype(static.w_dtype), NONE, pushed(w_history, qw.amax), pushed(g_history, qg.amax), recipe)
    return dx_op, dw_op


_einsum.defvjp(_forward, _backward)
