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

Balance without an auxiliary loss (``model.moe.balance``): a per-expert bias
on the scores for the top-k choice only, kept outside the parameters and
updated after each step (:mod:`jaxscale.models.balance`).

Load, per MoE layer and whole-batch (so summed over every data and expert
shard by construction): the choices routed to each expert, the fraction
dropped, the router's entropy (:func:`jaxscale.ops.routing.route`); the
train step logs their summary (:func:`load_metrics`) as one value per layer.

Where the experts run is ``model.moe.impl``: ``shard_map`` is expert
parallelism with explicit all-to-alls (``jaxscale/parallel/expert.py``);
``partitioner`` is GShard's einsum dispatch (:func:`partitioner_experts`),
which states only the layouts (the buffers' ``expert`` dimension on the rules'
``expert`` axes, their batch on ``expert_batch``) and leaves the collectives to
XLA's SPMD partitioner.

With ``precision.fp8`` on, the experts' matmuls run in fp8 with a scale per expert (``blockwise``: per
block of each expert's weight; :class:`MoE`'s ``fp8``: per-expert weight histories, the buffers' and hidden
activations' per tensor).

The routing math and the kernels both places share (dispatch, combine,
grouped matmuls) are :mod:`jaxscale.ops.routing`.

Logical axes: parameters ``expert, embed, expert_mlp`` (the router is
``embed x None``: replicated over experts); activations ``expert`` and
``expert_batch`` (the batch dimension of dispatched buffers: the rules map it
to the batch's mesh axes other than the expert ones).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.axes import BUFFER, BUFFER_HIDDEN, RESIDUAL, ROUTING, W_IN, W_OUT
from jaxscale.config.read import Config, ModelConfig, MoEConfig
from jaxscale.layout.sharding import active, constrain
from jaxscale.models import balance
from jaxscale.models.params import param
from jaxscale.ops import lean
from jaxscale.ops.routing import LAYER_STATS, METRICS, Routing, Weight, capacity, dropless, flat_slot, route
from jaxscale.parallel import expert
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision
from jaxscale.precision.fp8 import Fp8

WEIGHTS = {"w_gate": "gate", "w_up": "up", "w_down": "down"}  # the experts' weights, their outputs' names
LOAD_METRICS = ("moe_load_max", "moe_load_min", "moe_load_cv", "moe_layer_dropped", "moe_entropy")


def expert_width(config: ModelConfig) -> int:
    """Hidden size of one expert."""
    return config.moe.mlp or config.mlp


def aux_objective(aux: dict[str, jax.Array], config: ModelConfig) -> jax.Array:
    """The auxiliary terms the loss gets from an MoE model: weighted load-balance and z-loss."""
    return config.moe.aux_loss_weight * aux["moe_aux_loss"] + config.moe.z_loss_weight * aux["moe_z_loss"]


def over_layers(aux: dict[str, jax.Array]) -> dict[str, Any]:
    """The MoE layers' stacked statistics [layers, ...] as the model returns them: ``METRICS`` averaged over
    the layers, and under ``moe_layers`` the per-layer ``LAYER_STATS`` (:func:`load_metrics`, the balance)."""
    out: dict[str, Any] = {k: jnp.mean(aux[k]) for k in METRICS}
    out["moe_layers"] = {k: aux[k] for k in LAYER_STATS if k in aux}
    return out


def load_metrics(layers: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-layer load summary [layers] each: max/mean and min/mean of the choices per expert, their
    coefficient of variation (std/mean), the fraction of choices dropped and the router entropy."""
    load = layers["moe_load"]
    mean = jnp.mean(load, axis=-1)
    return {
        "moe_load_max": jnp.max(load, axis=-1) / mean,
        "moe_load_min": jnp.min(load, axis=-1) / mean,
        "moe_load_cv": jnp.std(load, axis=-1) / mean,
        "moe_layer_dropped": layers["moe_dropped"],
        "moe_entropy": layers["moe_entropy"],
    }


def partitioner_experts(
    x: jax.Array,
    routing: Routing,
    weights: tuple[Weight, ...],
    moe: MoEConfig,
    seq_capacity: int,
    grads: jnp.dtype | None = None,
    f8: fp8.Inputs | None = None,
) -> jax.Array:
    """The experts as plain einsums under sharding constraints; XLA's partitioner picks the collectives.

    Capacity mode is GShard's one-hot dispatch: ``[b, s, experts, C]`` masks contract the tokens into
    ``[b, experts, C, d]`` buffers laid out by the rules (``expert_batch``, ``expert``), so moving from
    the token layout to the expert layout is the partitioner's resharding. Dropless mode runs the
    grouped matmuls on the global arrays (their weight gradients in autodiff's dtype, not ``grads``).
    ``f8``: the buffers' fp8 histories with precision.fp8 on (:mod:`jaxscale.models.routing`).
    """
    if moe.dispatch == "dropless":
        return constrain(dropless(x, routing, *weights, f8=f8), RESIDUAL)
    where = flat_slot(routing, moe.experts, seq_capacity)  # dropped: out of range, a zero one-hot row
    slots = jax.nn.one_hot(where, moe.experts * seq_capacity, dtype=x.dtype)  # [b, s, k, e·c]
    b, s = x.shape[:2]
    mask = slots.sum(2).reshape(b, s, moe.experts, seq_capacity)
    gates = jnp.einsum("bskn,bsk->bsn", slots, routing.gate.astype(x.dtype)).reshape(mask.shape)
    buf = constrain(jnp.einsum("bsec,bsd->becd", mask, x), BUFFER)
    w_gate, w_up, w_down = weights
    bufs = [buf] * 2 if f8 is None else fp8.sharing(f8.input("buffer", buf), 2)
    gate, up = (precision.einsum("becd,edf->becf", b, w, grads) for b, w in zip(bufs, (w_gate, w_up), strict=True))
    hidden = constrain(lean.swiglu(gate, up), BUFFER_HIDDEN)
    hidden = hidden if f8 is None else f8.input("hidden", hidden)
    out = constrain(precision.einsum("becf,efd->becd", hidden, w_down, grads), BUFFER)
    return constrain(jnp.einsum("bsec,becd->bsd", gates, out), RESIDUAL)


class MoE(nnx.Module):
    """Routed experts (plus an optional shared dense MLP): [batch, length, embed] -> (same, layer metrics)."""

    def __init__(self, config: Config, rngs: nnx.Rngs, shared: nnx.Module | None = None):
        c, moe = config.model, config.model.moe
        self.config = c
        f, std, pdt = expert_width(c), c.init_std, c.param_dtype
        self.router = param(rngs, (c.embed, moe.experts), ("embed", None), std, pdt)
        self.w_gate = param(rngs, (moe.experts, c.embed, f), W_IN, std, pdt)
        self.w_up = param(rngs, (moe.experts, c.embed, f), W_IN, std, pdt)
        self.w_down = param(rngs, (moe.experts, f, c.embed), W_OUT, std, pdt)
        self.shared = shared
        self.bias = balance.router_bias(moe)
        self.grads = precision.weight_grads(config)
        on = config.precision.fp8 != "off"
        self.fp8 = Fp8(config.precision, ("buffer", "hidden"), WEIGHTS, moe.experts) if on else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        c, moe = self.config, self.config.moe
        dt = jnp.dtype(c.dtype)
        logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        seq_capacity = capacity(moe, x.shape[1])
        bias = None if self.bias is None else self.bias[...]
        routing, aux = route(constrain(logits, ROUTING), moe, seq_capacity, bias, expert.token_axes())
        weights = tuple(getattr(self, name)[...].astype(dt) for name in WEIGHTS)
        state = None if self.fp8 is None else fp8.live(self.fp8)
        f8 = None if state is None else state.inputs()
        if state is not None:  # per-expert e4m3 copies and scales (jaxscale.precision.fp8.prepare; blockwise: none)
            weights = tuple(state.weight(name, w) for name, w in zip(WEIGHTS, weights, strict=True))
        if moe.impl == "partitioner" or active() is None:
            y = partitioner_experts(x, routing, weights, moe, seq_capacity, self.grads, f8)
        else:
            y = expert.experts(x, routing, weights, moe, seq_capacity, self.grads, f8)
        if self.shared is not None:
            y = y + self.shared(x)
        return checkpoint_name(y, "mlp_out"), aux
