"""Mixture-of-experts feed-forward: router, top-k, capacity or dropless dispatch, auxiliary losses.

:class:`MoE` stands in place of the dense SwiGLU of a block (``model.moe``).
A router (``embed x experts``, fp32) scores every token; each token goes to
its ``top_k`` experts, each a SwiGLU of width ``model.moe.mlp``, and the
expert outputs are summed weighted by the gates (the top-k softmax
probabilities, or sigmoid scores, renormalised to sum to 1 when
``normalize_gates``). ``shared_experts`` adds a dense SwiGLU every token goes
through (DeepSeek-MoE style).

Dispatch (``model.moe.dispatch``):

* ``capacity``: tokens are grouped by sequence (MaxText's grouping): each
  expert takes at most ``C = min(s, ceil(capacity_factor · s · top_k / experts))``
  of a sequence's ``s`` tokens. Slots are filled first choices first, in token
  order, then second choices, and so on (GShard's priority). A choice past
  ``C`` is dropped: its expert output is zero and the token goes on through
  the residual; ``moe_dropped`` logs the fraction of choices dropped. Because
  groups are sequences, the same tokens are dropped on one device and on any
  mesh. Buffers have a fixed size, ``[sequences, experts, C, embed]``.
* ``dropless``: choices are sorted by expert and run through grouped matmuls
  (``jax.lax.ragged_dot``); nothing is dropped.

Auxiliary losses, both returned per layer and averaged over the MoE layers:

* load balance (Switch / Mixtral form): ``experts · Σ_e f_e · P_e`` with ``f_e``
  the fraction of the ``tokens · top_k`` choices routed to expert ``e``
  (before dropping) and ``P_e`` the mean router probability of ``e``
  (softmax; for the sigmoid router, the scores normalised to sum to 1 per
  token). A uniform router gives 1. Hugging Face's Mixtral loss sums
  ``f_e`` over the k choices without dividing by k: ``top_k`` times this.
* router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)²``.

Both are taken over the whole batch, so every layout computes the same
numbers; the trainer adds ``aux_loss_weight · aux + z_loss_weight · z`` to
the loss (:func:`aux_objective`).

Where the experts run is ``model.moe.impl``: ``shard_map`` is expert
parallelism with explicit all-to-alls (``jaxscale/parallel/expert.py``);
``partitioner`` is GShard's einsum dispatch (:func:`partitioner_experts`),
which states only the layouts (the buffers' ``expert`` dimension on the rules'
``expert`` axes, their batch on ``expert_batch``) and leaves the collectives to
XLA's SPMD partitioner.

Logical axes: parameters ``expert, embed, expert_mlp`` (the router is
``embed x None``: replicated over experts); activations ``expert`` and
``expert_batch`` (the batch dimension of dispatched buffers: the rules map it
to the batch's mesh axes other than the expert ones).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config import ModelConfig, MoEConfig
from jaxscale.models import lean
from jaxscale.sharding import active, constrain

RESIDUAL = ("batch", "norm_length", "act_embed")
ROUTING = ("batch", "norm_length", None)
BUFFER = ("expert_batch", "expert", None, "act_embed")
BUFFER_HIDDEN = ("expert_batch", "expert", None, "expert_mlp")
W_IN = ("expert", "embed", "expert_mlp")
W_OUT = ("expert", "expert_mlp", "embed")
METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")


class Routing(NamedTuple):
    """Where each token's choices go: all ``[batch, length, top_k]``."""

    index: jax.Array  # int32 expert of each choice
    gate: jax.Array  # fp32 weight of each choice
    slot: jax.Array  # int32 place in its expert's buffer for this sequence; >= capacity: dropped


def expert_width(config: ModelConfig) -> int:
    """Hidden size of one expert."""
    return config.moe.mlp or config.mlp


def capacity(moe: MoEConfig, seq_len: int) -> int:
    """Slots per expert per sequence: ``min(s, ceil(capacity_factor · s · top_k / experts))``."""
    return min(seq_len, math.ceil(moe.capacity_factor * seq_len * moe.top_k / moe.experts))


def route(logits: jax.Array, moe: MoEConfig, seq_capacity: int) -> tuple[Routing, dict[str, jax.Array]]:
    """Top-k routing of ``logits`` [batch, length, experts] and the layer's auxiliary losses and drop fraction."""
    logits = logits.astype(jnp.float32)
    n, k = moe.experts, moe.top_k
    if moe.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    # top-k as a sort along the experts: the partitioner keeps it local to each token shard
    # (it gathers every token's scores for lax.top_k); ties go to the lower index either way.
    index = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    top = jnp.take_along_axis(scores, index, axis=-1)
    gate = top / top.sum(-1, keepdims=True) if moe.normalize_gates else top
    chosen = jax.nn.one_hot(index, n, dtype=jnp.int32)  # [b, s, k, e]
    fraction = chosen.sum((0, 1, 2)) / index.size
    aux = {
        "moe_aux_loss": n * jnp.sum(fraction * probs.mean((0, 1))),
        "moe_z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
    }
    if moe.dispatch == "capacity":
        b, s = index.shape[:2]
        # Choice-major order within a whole sequence: every first choice, then every second, ...
        order = jax.nn.one_hot(constrain(index, ("batch", "length", None)).swapaxes(1, 2), n, dtype=jnp.int32)
        order = order.reshape(b, k * s, n)
        before = jnp.cumsum(order, axis=1) - order
        slot = (before * order).sum(-1).reshape(b, k, s).transpose(0, 2, 1)
        aux["moe_dropped"] = jnp.mean((slot >= seq_capacity).astype(jnp.float32))
    else:
        slot = jnp.zeros_like(index)
        aux["moe_dropped"] = jnp.zeros((), jnp.float32)
    return Routing(index.astype(jnp.int32), gate, slot.astype(jnp.int32)), aux


def aux_objective(aux: dict[str, jax.Array], config: ModelConfig) -> jax.Array | float:
    """The auxiliary terms the loss gets: weighted load-balance and z-loss (0 for a dense model)."""
    if config.moe is None:
        return 0.0
    return config.moe.aux_loss_weight * aux["moe_aux_loss"] + config.moe.z_loss_weight * aux["moe_z_loss"]


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Each expert's SwiGLU on its buffer: ``x`` [..., experts, slots, embed], weights [experts, ...]."""
    hidden = lean.swiglu(jnp.einsum("...ecd,edf->...ecf", x, w_gate), jnp.einsum("...ecd,edf->...ecf", x, w_up))
    return jnp.einsum("...ecf,efd->...ecd", hidden, w_down)


def _flat_slot(routing: Routing, experts: int, seq_capacity: int) -> jax.Array:
    """Index of each choice in its sequence's flattened ``[experts · C]`` buffer; ``experts · C`` if dropped."""
    kept = routing.slot < seq_capacity
    return jnp.where(kept, routing.index * seq_capacity + routing.slot, experts * seq_capacity)


def dispatch(x: jax.Array, routing: Routing, experts: int, seq_capacity: int) -> jax.Array:
    """Scatter tokens [b, s, d] into their experts' slots: [b, experts, C, d]; dropped choices go nowhere."""
    b, s, d = x.shape
    k = routing.index.shape[-1]
    where = _flat_slot(routing, experts, seq_capacity).reshape(b, s * k)
    src = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(b, s * k, d)
    buf = jax.vmap(lambda w, v: jnp.zeros((experts * seq_capacity, d), x.dtype).at[w].add(v, mode="drop"))(where, src)
    return buf.reshape(b, experts, seq_capacity, d)


def combine(out: jax.Array, routing: Routing) -> jax.Array:
    """Gather each choice's expert output from [b, experts, C, d] and sum them weighted by the gates."""
    b, n, c, d = out.shape
    s, k = routing.index.shape[1:]
    where = _flat_slot(routing, n, c).reshape(b, s * k, 1)
    picked = jnp.take_along_axis(out.reshape(b, n * c, d), where, axis=1, mode="fill", fill_value=0)
    return jnp.einsum("bskd,bsk->bsd", picked.reshape(b, s, k, d), routing.gate.astype(out.dtype))


def grouped_swiglu(
    x: jax.Array, expert: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """Rows ``x`` [m, d] through the SwiGLU of expert ``expert`` [m] with grouped matmuls (``ragged_dot``).

    Rows whose expert is outside ``[0, len(w_gate))`` (another device's) give zeros.
    """
    groups = w_gate.shape[0]
    local = (expert >= 0) & (expert < groups)
    key = jnp.where(local, expert, groups)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((groups,), jnp.int32).at[key].add(1, mode="drop")
    xs = x[order]
    hidden = lean.swiglu(lax.ragged_dot(xs, w_gate, sizes), lax.ragged_dot(xs, w_up, sizes))
    out = lax.ragged_dot(hidden, w_down, sizes)[jnp.argsort(order)]
    return jnp.where(local[:, None], out, 0)


def dropless(
    x: jax.Array,
    routing: Routing,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """Tokens ``x`` [b, s, d] through their chosen experts among ``first_expert + [0, len(w_gate))``, gated, summed."""
    b, s, d = x.shape
    k = routing.index.shape[-1]
    rows = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(b * s * k, d)
    out = grouped_swiglu(rows, routing.index.reshape(-1) - first_expert, w_gate, w_up, w_down)
    return jnp.einsum("bskd,bsk->bsd", out.reshape(b, s, k, d), routing.gate.astype(x.dtype))


def partitioner_experts(
    x: jax.Array, routing: Routing, weights: tuple[jax.Array, ...], moe: MoEConfig, seq_capacity: int
) -> jax.Array:
    """The experts as plain einsums under sharding constraints; XLA's partitioner picks the collectives.

    Capacity mode is GShard's one-hot dispatch: ``[b, s, experts, C]`` masks contract the tokens into
    ``[b, experts, C, d]`` buffers laid out by the rules (``expert_batch``, ``expert``), so moving from
    the token layout to the expert layout is the partitioner's resharding. Dropless mode runs the
    grouped matmuls on the global arrays.
    """
    if moe.dispatch == "dropless":
        return constrain(dropless(x, routing, *weights), RESIDUAL)
    where = _flat_slot(routing, moe.experts, seq_capacity)  # dropped: out of range, a zero one-hot row
    slots = jax.nn.one_hot(where, moe.experts * seq_capacity, dtype=x.dtype)  # [b, s, k, e·c]
    b, s = x.shape[:2]
    mask = slots.sum(2).reshape(b, s, moe.experts, seq_capacity)
    gates = jnp.einsum("bskn,bsk->bsn", slots, routing.gate.astype(x.dtype)).reshape(mask.shape)
    buf = constrain(jnp.einsum("bsec,bsd->becd", mask, x), BUFFER)
    w_gate, w_up, w_down = weights
    hidden = lean.swiglu(jnp.einsum("becd,edf->becf", buf, w_gate), jnp.einsum("becd,edf->becf", buf, w_up))
    out = constrain(jnp.einsum("becf,efd->becd", constrain(hidden, BUFFER_HIDDEN), w_down), BUFFER)
    return constrain(jnp.einsum("bsec,becd->bsd", gates, out), RESIDUAL)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float, dtype) -> nnx.Param:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes)


class MoE(nnx.Module):
    """Routed experts (plus an optional shared dense MLP): [batch, length, embed] -> (same, layer metrics)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, shared: nnx.Module | None = None):
        c, moe = config, config.moe
        self.config = c
        f, std, pdt = expert_width(c), c.init_std, c.param_dtype
        self.router = _param(rngs, (c.embed, moe.experts), ("embed", None), std, pdt)
        self.w_gate = _param(rngs, (moe.experts, c.embed, f), W_IN, std, pdt)
        self.w_up = _param(rngs, (moe.experts, c.embed, f), W_IN, std, pdt)
        self.w_down = _param(rngs, (moe.experts, f, c.embed), W_OUT, std, pdt)
        self.shared = shared

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        from jaxscale.parallel import expert  # the EP module imports this one

        c, moe = self.config, self.config.moe
        dt = jnp.dtype(c.dtype)
        logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        seq_capacity = capacity(moe, x.shape[1])
        routing, aux = route(constrain(logits, ROUTING), moe, seq_capacity)
        weights = tuple(w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down))
        if moe.impl == "partitioner" or active() is None:
            y = partitioner_experts(x, routing, weights, moe, seq_capacity)
        else:
            y = expert.experts(x, routing, weights, moe, seq_capacity)
        if self.shared is not None:
            y = y + self.shared(x)
        return checkpoint_name(y, "mlp_out"), aux
