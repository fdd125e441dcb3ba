"""FP8 matmuls: e4m3 inputs and weights, e5m2 gradients, per-tensor scales (``precision.fp8``).

What is quantized: the projections of every block, q/k/v/o of attention and
gate/up/down of the MLP (the shared expert's too). Each matmul ``y = x · w``
becomes ``y = qdq(x) · qdq(w)`` in the forward, where ``qdq`` quantizes to
float8 e4m3 (largest value 448) and dequantizes; in the backward the
gradient arriving at ``y`` is quantized to e5m2 (range to 57344, fewer
mantissa bits) before it meets ``w`` and ``x``. The gradient that leaves
``qdq`` is passed straight through. The embedding, the LM head, the MoE
router and the routed experts stay in ``model.dtype``: the head and the
router are small and sensitive, the experts' ragged matmuls have no fp8
path here. Master weights, gradients and Adam's moments stay fp32
(:mod:`jaxscale.optim`).

Scaling recipe (per tensor, as Transformer Engine and flax's ``fp8_ops``):
a tensor ``x`` of format ``F`` is stored as ``clip(x / s, ±max_F)`` cast to
``F``, and read back as that times ``s``, where ``s = amax · 2^margin /
max_F``. ``current`` takes ``amax = max|x|`` of the tensor itself (one more
reduction over it, before the cast); ``delayed`` takes the largest of the
last ``precision.amax_history`` steps' amaxes, so the cast does not wait
for a reduction over the tensor it casts (only at the first step, with an
empty history, does it fall back to the tensor's own amax, in a
``lax.cond`` branch). The history takes this step's amax for the next
steps. ``precision.margin`` halves the range per unit, headroom for growth
between steps. Scales are computed in fp32.

State: one amax history (fp32, newest first, ``amax_history`` long) per
quantized tensor: an :class:`Fp8Meta` variable of the module
(:class:`Fp8`), stacked with the blocks (``[layers, amax_history]``). The
trainer splits it from the parameters (``TrainState.fp8``, replicated,
checkpointed with the state, never seen by the optimizer). It is updated
the way flax's fp8 ops do it: the quantizers are ``custom_vjp`` functions
whose backward returns, as the "gradient" of the history, the history with
this step's amax pushed in; the train step differentiates the loss with
respect to the histories too and takes that as their new value. Forward
amaxes (inputs, weights) and backward ones (gradients) then come out of the
same ``jax.grad``, through the layer scan and remat. Under gradient
accumulation the microbatches' histories are combined with a maximum.

Sharding: the quantizers run in the partitioned (automatic) part of the
program, outside the sequence-parallel ``shard_map`` (the dequantized values
go in), so ``max|x|`` of a sharded tensor is the partitioner's global
reduction (an all-reduce of one scalar) and every layout quantizes as one
device. Pipeline parallelism is refused (:meth:`jaxscale.layout.Layout.validate`):
a stage applies each layer to several microbatches, and the "gradients" of its
history would be summed.

Where it pays: on Hopper (H100/H200) and later GPUs, where XLA rewrites
``convert -> scale -> dot`` into a cuBLASLt fp8 GEMM at twice the bf16 peak,
and on TPU v5p and v6e, whose MXUs take fp8 (or int8) inputs. On CPU (and
on older GPUs) XLA converts to fp8 and back and multiplies in the wider
type: the numerics are those of fp8 training, the speed is not (the extra
converts and reductions make it slower than bf16).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxscale.config import ConfigError, PrecisionConfig

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


class Fp8Meta(nnx.Variable):
    """The amax history of one quantized tensor (newest first): fp8 scaling state, not a parameter."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How scales are chosen: ``delayed`` (amax history) or ``current`` (the tensor's own amax)."""

    delayed: bool
    margin: int


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _push(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history with ``amax`` as its newest entry and the oldest dropped."""
    return jnp.roll(history, 1).at[0].set(amax)


def scale(history: jax.Array, x: jax.Array, fmt: Any, recipe: Recipe) -> jax.Array:
    """The dequantization scale ``s`` of ``x``: ``amax · 2^margin`` maps to the largest finite value of ``fmt``."""

    def of(amax: jax.Array) -> jax.Array:
        s = amax * 2.0**recipe.margin / float(jnp.finfo(fmt).max)
        return jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0)

    if not recipe.delayed:
        return of(_amax(x))
    past = jnp.max(history)
    # A branch, not a select: once there is a history, the scale does not wait for max|x|.
    return lax.cond(past > 0, lambda: of(past), lambda: of(_amax(x)))


def qdq(x: jax.Array, s: jax.Array, fmt: Any) -> jax.Array:
    """``x`` quantized to ``fmt`` with scale ``s`` (saturating) and read back in ``x``'s dtype."""
    top = float(jnp.finfo(fmt).max)
    q = jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(fmt)
    return (q.astype(jnp.float32) * s).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantize(x: jax.Array, history: jax.Array, recipe: Recipe) -> jax.Array:
    """A matmul operand in e4m3; the gradient of ``history`` is its update (``x``'s amax pushed in)."""
    return qdq(x, scale(history, x, E4M3, recipe), E4M3)


def _quantize_fwd(x: jax.Array, history: jax.Array, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    return qdq(x, scale(history, x, E4M3, recipe), E4M3), _push(history, _amax(x))


def _quantize_bwd(recipe: Recipe, new_history: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, new_history


quantize.defvjp(_quantize_fwd, _quantize_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantize_grad(y: jax.Array, history: jax.Array, recipe: Recipe) -> jax.Array:
    """Identity on a matmul's output; its gradient is quantized to e5m2 and its amax pushed into ``history``."""
    return y


def _quantize_grad_fwd(y: jax.Array, history: jax.Array, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    return y, history


def _quantize_grad_bwd(recipe: Recipe, history: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return qdq(g, scale(history, g, E5M2, recipe), E5M2), _push(history, _amax(g))


quantize_grad.defvjp(_quantize_grad_fwd, _quantize_grad_bwd)


class Fp8(nnx.Module):
    """The fp8 state of one module's matmuls: an amax history per named operand and per output gradient.

    With ``fp8: off`` it holds nothing and both methods return their input.
    """

    def __init__(self, precision: PrecisionConfig, operands: Sequence[str], outputs: Sequence[str]):
        on = precision.fp8 != "off"
        self.recipe = Recipe(precision.fp8 == "delayed", precision.margin) if on else None
        for name in (*operands, *outputs) if on else ():
            setattr(self, name, Fp8Meta(jnp.zeros((precision.amax_history,), jnp.float32), out_sharding=(None,)))

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        """Operand ``name`` of a matmul (an activation or a weight), through e4m3."""
        return x if self.recipe is None else quantize(x, getattr(self, name)[...], self.recipe)

    def grad(self, name: str, y: jax.Array) -> jax.Array:
        """Output ``name`` of a matmul, whose gradient goes through e5m2."""
        return y if self.recipe is None else quantize_grad(y, getattr(self, name)[...], self.recipe)


def check_resume(saved: dict[str, Any], precision: PrecisionConfig, step: int) -> None:
    """Raise if a checkpoint's fp8 state (``saved``: its config) does not restore into ``precision``'s."""
    old = {"fp8": "off", "amax_history": PrecisionConfig.amax_history, **saved.get("precision", {})}
    shape = (old["fp8"] != "off", old["amax_history"])
    if shape != (precision.fp8 != "off", precision.amax_history) and (shape[0] or precision.fp8 != "off"):
        raise ConfigError(
            f"resume: checkpoint step {step} has precision.fp8={old['fp8']} with amax_history="
            f"{old['amax_history']}, the config has precision.fp8={precision.fp8} with "
            f"amax_history={precision.amax_history} (switching between delayed and current is fine)"
        )


def combine(a: Any, b: Any) -> Any:
    """Two microbatches' updated histories as one step's: the larger amax at each position."""
    return jax.tree.map(jnp.maximum, a, b)
