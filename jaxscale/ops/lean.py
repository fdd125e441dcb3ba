"""RMSNorm and SwiGLU with hand-written backward passes that keep what Megatron keeps.

jax's autodiff of the plain formulas keeps every intermediate its backward touches:
around a norm, an fp32 copy of the input, the normalized input and the scaled output;
in a SwiGLU, the gate, its sigmoid, silu(gate), the up projection and their product.
These ``custom_vjp`` versions keep, per token:

- :func:`rms_norm`: the input in its own (compute) dtype and one fp32 statistic, 1/rms;
  the backward recomputes the normalized input from them. The output is the next
  matmul's input, which that matmul keeps anyway.
- :func:`swiglu`: the gate and up projections (2f values); the backward recomputes the
  sigmoid. The product, the down projection's input (f), is kept by that matmul.

Korthikanti et al.'s 34·s·b·h bytes per layer (bf16, GPT) count the same tensors: a norm's
input and the next matmul's input, and the MLP's matmul inputs. What a whole layer keeps,
policy by policy, is in :func:`jaxscale.models.llama.remat_policy`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _inverse_rms(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis, statistics in fp32, the result in ``x``'s dtype."""
    return _rms_norm_forward(x, scale, eps)[0]


def _explicit(x: jax.Array, like: jax.Array, dims: slice) -> jax.Array:
    """On explicit mesh axes, ``x`` resharded to the layout of ``like``'s dimensions ``dims``; else ``x``."""
    if not jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        return x
    spec = tuple(jax.typeof(like).sharding.spec)
    spec += (None,) * (like.ndim - len(spec))
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec[dims]))


def _rms_norm_forward(x: jax.Array, scale: jax.Array, eps: float) -> tuple[jax.Array, tuple]:
    r = _inverse_rms(x, eps)
    normed = x.astype(jnp.float32) * r
    return (normed * _explicit(scale, x, slice(-1, None)).astype(jnp.float32)).astype(x.dtype), (x, r, scale)


def _rms_norm_backward(eps: float, saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, r, scale = saved
    normed = x.astype(jnp.float32) * r
    g32 = g.astype(jnp.float32)
    d_scale = _explicit(jnp.sum(g32 * normed, axis=tuple(range(g.ndim - 1))), scale, slice(None))
    d_normed = g32 * _explicit(scale, x, slice(-1, None)).astype(jnp.float32)
    d_x = r * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def _swiglu_forward(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple]:
    return swiglu(gate, up), (gate, up)


def _swiglu_backward(saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = saved
    gate32, g32 = gate.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate32)
    silu = gate32 * sig
    d_up = g32 * silu
    d_gate = g32 * up.astype(jnp.float32) * sig * (1 + gate32 * (1 - sig))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_forward, _swiglu_backward)
