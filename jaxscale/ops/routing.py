"""MoE routing kernels: top-k routing, capacity slots, dispatch into expert buffers, combine, grouped matmuls.

Pure array functions of the routing decisions, shared by the two places the
experts run: under the partitioner (:func:`jaxscale.models.moe.partitioner_experts`)
and in expert parallelism's ``shard_map`` (:mod:`jaxscale.parallel.expert`), so
this module sits below both ``models/`` and ``parallel/``.
With ``precision.fp8`` on the experts' matmuls run in fp8: the weights are fp8 operands with a scale
per expert (:class:`jaxscale.precision.fp8.Operand`), the buffers and hidden activations are quantized per tensor by
``f8`` (:class:`jaxscale.precision.fp8.Inputs`), the einsums of capacity dispatch by
their recipe's ``einsum`` and the grouped matmuls by its ``ragged`` (:func:`jaxscale.precision.fp8.kernels`).
Under ``blockwise`` the scales are per ``1 x B`` tile and per ``B x B`` block of each expert's weight (the expert
a batch letter of the capacity buffers' einsums).
See :mod:`jaxscale.models.moe` for the routing rules (GShard's capacity
priority, the auxiliary losses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.read import MoEConfig
from jaxscale.layout.sharding import constrain
from jaxscale.ops import lean
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision

METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")  # of route's statistics, the means over the MoE layers
LAYER_STATS = ("moe_load", "moe_entropy", "moe_dropped", "moe_bias_target")  # ... those kept per layer


def joined(metrics: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """A stack's metrics and more layers' (a model's predictions ahead): the per-layer statistics
    (``moe_layers``: ``LAYER_STATS`` stacked [layers, ...]) of ``more`` after the stack's."""
    out = {**metrics, **more}
    if "moe_layers" in metrics and "moe_layers" in more:
        out["moe_layers"] = {k: jnp.concatenate([v, more["moe_layers"][k]]) for k, v in metrics["moe_layers"].items()}
    return out


def layer_stat_shapes(moe: MoEConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of one layer's ``LAYER_STATS`` as :func:`route` gives them under ``moe``."""
    quantile = {"moe_bias_target": (moe.experts,)} if moe.balance == "quantile" else {}
    return {"moe_load": (moe.experts,), "moe_entropy": (), "moe_dropped": (), **quantile}


class Routing(NamedTuple):
    """Where each token's choices go: all ``[batch, length, top_k]``."""

    index: jax.Array  # int32 expert of each choice
    gate: jax.Array  # fp32 weight of each choice
    slot: jax.Array  # int32 place in its expert's buffer for this sequence; >= capacity: dropped


def capacity(moe: MoEConfig, seq_len: int) -> int:
    """Slots per expert per sequence: ``min(s, ceil(capacity_factor · s · top_k / experts))``."""
    return min(seq_len, math.ceil(moe.capacity_factor * seq_len * moe.top_k / moe.experts))


def group_limited(scores: jax.Array, groups: int, top_groups: int) -> jax.Array:
    """DeepSeek-V3's group-limited (node-limited) choice: ``scores`` [..., experts] with every expert outside
    each token's ``top_groups`` best groups set to -inf; a group's score is the sum of its two best scores
    (its best, for groups of one expert). Ties go to the lower group."""
    *lead, n = scores.shape
    grouped = scores.reshape(*lead, groups, n // groups)
    best = -jnp.sort(-grouped, axis=-1)[..., : min(2, n // groups)].sum(-1)  # [..., groups]
    chosen = jnp.argsort(-best, axis=-1, stable=True)[..., :top_groups]
    keep = jax.nn.one_hot(chosen, groups, dtype=jnp.bool_).any(-2)  # [..., groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(scores.shape)


def quantile_bias(need: jax.Array, share: float) -> jax.Array:
    """The centred ``share`` quantile over tokens of ``need`` [..., experts] (the bias each token needs
    for each expert to be chosen): the bias under which each expert gets ``share`` of the tokens."""
    target = jnp.quantile(need.reshape(-1, need.shape[-1]), share, axis=0)
    return target - jnp.mean(target)


def _varying_like(a: jax.Array, like: jax.Array) -> jax.Array:
    """``a`` typed as varying over every manual axis ``like`` is: jax's argsort (jax 0.10 and 0.12) drops the
    type, so each device's choices would read as the same everywhere (a sum over the devices would scale them)."""
    more = tuple(jax.typeof(like).manual_axis_type.varying - jax.typeof(a).manual_axis_type.varying)
    return lax.pcast(a, more, to="varying") if more else a


def _size(axes: tuple[str, ...]) -> int:
    """The number of devices along these manual mesh axes."""
    return math.prod(lax.axis_size(a) for a in axes)


def _mean(x: jax.Array, dims: tuple[int, ...], over: tuple[str, ...]) -> jax.Array:
    """The mean of ``x`` over ``dims`` and over the manual axes ``over`` (each device holding as many)."""
    if not over:
        return jnp.mean(x, dims)
    return lax.psum(jnp.sum(x, dims), over) / (math.prod(x.shape[d] for d in dims) * _size(over))


def route(
    logits: jax.Array, moe: MoEConfig, seq_capacity: int, bias: jax.Array | None = None, over: tuple[str, ...] = ()
) -> tuple[Routing, dict[str, jax.Array]]:
    """Top-k routing of ``logits`` [batch, length, experts]; the layer's auxiliary losses, drop fraction and load.

    ``bias`` [experts] (``model.moe.balance``) is added to the scores for the choice of the top k only:
    the gates are the unbiased scores of the chosen experts. With ``groups > 1`` the choice is
    group-limited (:func:`group_limited`). The load statistics (whole-batch, so every
    layout counts the same) are ``moe_load`` (choices per expert, before dropping), ``moe_dropped`` (the
    fraction of choices dropped), ``moe_entropy`` (the router distribution's mean entropy, nats) and,
    with ``balance: quantile``, ``moe_bias_target`` (:func:`quantile_bias`). ``over``: the manual mesh axes
    the batch's sequences are spread over (a pipeline stage's rows, :attr:`jaxscale.layout.rules.Stage.tokens`): the
    statistics are sums and means over them too, the same on each device.
    """
    logits = logits.astype(jnp.float32)
    n, k = moe.experts, moe.top_k
    if moe.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    biased = scores if bias is None else scores + bias.astype(jnp.float32)
    if moe.groups > 1:
        biased = group_limited(biased, moe.groups, moe.top_groups)
    # top-k as a sort along the experts: the partitioner keeps it local to each token shard
    # (it gathers every token's scores for lax.top_k); ties go to the lower index either way.
    ranked = _varying_like(jnp.argsort(-biased, axis=-1, stable=True), biased)
    index = ranked[..., :k]
    top = jnp.take_along_axis(scores, index, axis=-1)
    gate = top / top.sum(-1, keepdims=True) if moe.normalize_gates else top
    load, choices = jax.nn.one_hot(index, n, dtype=jnp.int32).sum((0, 1, 2)), index.size * _size(over)
    load = lax.psum(load, over) if over else load
    aux = {
        "moe_aux_loss": n * jnp.sum(load / choices * _mean(probs, (0, 1), over)),
        "moe_z_loss": _mean(jax.nn.logsumexp(logits, axis=-1) ** 2, (0, 1), over),
        "moe_load": load.astype(jnp.float32),
        "moe_entropy": -_mean(jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1), (0, 1), over),
    }
    if moe.balance == "quantile":
        cutoff = jnp.take_along_axis(biased, ranked[..., k : k + 1], axis=-1)  # each token's (k+1)-th score
        need = cutoff - scores
        aux["moe_bias_target"] = quantile_bias(lax.all_gather(need, over, tiled=True) if over else need, k / n)
    if moe.dispatch == "capacity":
        b, s = index.shape[:2]
        # Choice-major order within a whole sequence: every first choice, then every second, ...
        order = jax.nn.one_hot(constrain(index, ("batch", "length", None)).swapaxes(1, 2), n, dtype=jnp.int32)
        order = order.reshape(b, k * s, n)
        before = jnp.cumsum(order, axis=1) - order
        slot = (before * order).sum(-1).reshape(b, k, s).transpose(0, 2, 1)
        aux["moe_dropped"] = _mean((slot >= seq_capacity).astype(jnp.float32), (0, 1, 2), over)
    else:
        slot = jnp.zeros_like(index)
        aux["moe_dropped"] = jnp.zeros((), jnp.float32)
    return Routing(index.astype(jnp.int32), gate, slot.astype(jnp.int32)), aux


Weight = jax.Array | fp8.Operand  # an expert weight [experts, ...]: fp8 operands with precision.fp8 on


def _input(f8: fp8.Inputs | None, name: str, x: jax.Array, readers: int) -> list[jax.Array | fp8.Operand]:
    """Activation ``x`` for ``readers`` projections: fp8 operands (its history updated once) with ``f8``."""
    return [x] * readers if f8 is None else fp8.sharing(f8.input(name, x), readers)


def swiglu(
    x: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, grads: jnp.dtype | None = None,
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """Each expert's SwiGLU on its buffer: ``x`` [batch, experts, slots, embed], weights [experts, ...];
    ``grads``: the weight gradients' dtype (:func:`jaxscale.precision.policy.einsum`)."""
    x_gate, x_up = _input(f8, "buffer", x, 2)
    gate = precision.einsum("becd,edf->becf", x_gate, w_gate, grads)
    hidden = lean.swiglu(gate, precision.einsum("becd,edf->becf", x_up, w_up, grads))
    return precision.einsum("becf,efd->becd", _input(f8, "hidden", hidden, 1)[0], w_down, grads)


def flat_slot(routing: Routing, experts: int, seq_capacity: int) -> jax.Array:
    """Index of each choice in its sequence's flattened ``[experts · C]`` buffer; ``experts · C`` if dropped."""
    kept = routing.slot < seq_capacity
    return jnp.where(kept, routing.index * seq_capacity + routing.slot, experts * seq_capacity)


def dispatch(x: jax.Array, routing: Routing, experts: int, seq_capacity: int) -> jax.Array:
    """Scatter tokens [b, s, d] into their experts' slots: [b, experts, C, d]; dropped choices go nowhere."""
    b, s, d = x.shape
    k = routing.index.shape[-1]
    where = flat_slot(routing, experts, seq_capacity).reshape(b, s * k)
    src = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(b, s * k, d)
    buf = jax.vmap(lambda w, v: jnp.zeros((experts * seq_capacity, d), x.dtype).at[w].add(v, mode="drop"))(where, src)
    return buf.reshape(b, experts, seq_capacity, d)


def combine(out: jax.Array, routing: Routing) -> jax.Array:
    """Gather each choice's expert output from [b, experts, C, d] and sum them weighted by the gates."""
    b, n, c, d = out.shape
    s, k = routing.index.shape[1:]
    where = flat_slot(routing, n, c).reshape(b, s * k, 1)
    picked = jnp.take_along_axis(out.reshape(b, n * c, d), where, axis=1, mode="fill", fill_value=0)
    return jnp.einsum("bskd,bsk->bsd", picked.reshape(b, s, k, d), routing.gate.astype(out.dtype))


def _grouped_dot(f8: fp8.Inputs | None) -> Callable[..., jax.Array]:
    """The grouped matmul ``(x, w, sizes) -> y``: ``lax.ragged_dot``, or its fp8 recipe's
    (:func:`jaxscale.precision.fp8.kernels`)."""
    return lax.ragged_dot if f8 is None else fp8.kernels(f8.recipe).ragged


def grouped_swiglu(
    x: jax.Array, expert: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, f8: fp8.Inputs | None = None
) -> jax.Array:
    """Rows ``x`` [m, d] through the SwiGLU of expert ``expert`` [m] with grouped matmuls (``ragged_dot``).

    Rows whose expert is outside ``[0, len(w_gate))`` (another device's) give zeros.
    """
    groups = w_gate.shape[0]
    local = (expert >= 0) & (expert < groups)
    key = jnp.where(local, expert, groups)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((groups,), jnp.int32).at[key].add(1, mode="drop")
    dot = _grouped_dot(f8)
    x_gate, x_up = _input(f8, "buffer", x[order], 2)
    hidden = lean.swiglu(dot(x_gate, w_gate, sizes), dot(x_up, w_up, sizes))
    out = dot(_input(f8, "hidden", hidden, 1)[0], w_down, sizes)[jnp.argsort(order)]
    return jnp.where(local[:, None], out, 0)


def dropless(
    x: jax.Array,
    routing: Routing,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    first_expert: jax.Array | int = 0,
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """Tokens ``x`` [b, s, d] through their chosen experts among ``first_expert + [0, len(w_gate))``, gated, summed."""
    b, s, d = x.shape
    k = routing.index.shape[-1]
    rows = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(b * s * k, d)
    out = grouped_swiglu(rows, routing.index.reshape(-1) - first_expert, w_gate, w_up, w_down, f8)
    return jnp.einsum("bskd,bsk->bsd", out.reshape(b, s, k, d), routing.gate.astype(x.dtype))
