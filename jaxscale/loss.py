"""Cross-entropy, plain and chunked ("fused linear": from the final hidden states and the head weight).

**Loss masks**: a negative target (:data:`jaxscale.data.IGNORE`: a prompt's token) is not trained. The
loss is the mean over the trained targets of the whole global batch: their summed cross-entropy divided
by their count. Across data shards that holds as written: the step is one global computation, the sum
and the count are over every shard's rows (XLA's all-reduces). Across ``train.microbatches`` the trainer
weighs microbatch ``i``'s mean by ``n_i / N`` (its trained targets over the global batch's,
:func:`microbatch_weights`), and a pipeline's microbatches are weighed the same way, so accumulation
gives the loss and gradients of the whole batch at once. A batch with no trained target has loss 0.

The plain loss (:func:`cross_entropy`) takes logits
``[batch, length, vocab]``: the head matmul's output in the compute dtype,
its fp32 copy, the softmax and the gradient of the logits, up to
``b·s·V·(dtype + 12)`` bytes at the loss's peak (XLA fuses some of them: 1.6
fp32 buffers measured on CPU, ``benchmarks/loss_memory.py``); for a 128k
vocabulary and 8k tokens per device, 4 GiB per fp32 buffer.

:func:`chunked_cross_entropy` never builds them: it takes the hidden states
``[b, s, e]`` and the head weight ``[e, V]`` and runs a ``lax.scan`` over
``s / chunk`` slices of the sequence; each step computes one
``[b, chunk, V]`` block of logits (matmul accumulated in fp32), its
log-sum-exp and the target logit, and keeps only the log-sum-exp (``b·s``
floats in all). The backward is a ``custom_vjp`` that runs the scan again,
recomputing each block of logits to form its gradient (softmax minus one-hot)
and accumulating the gradients of the hidden states and of the head weight
block by block. Peak loss memory falls from ``b·s·V·4`` per buffer to
``b·chunk·V·4``.

**What it costs**: the head matmul runs once more (recomputed in the backward:
4 head matmuls instead of 3, +2·b·s·e·V FLOPs); Liger's variant computes the
gradient in the forward instead, which wastes it in evaluation, so the
recomputation is chosen here. The chunks are strided (chunk ``j`` holds tokens
``j, j + s/chunk, ...``): the loss is a sum over tokens, so any partition
will do, and a strided one keeps a sequence-sharded layout (context
parallelism) sharded inside every chunk. **What it communicates** under the
rules: the hidden states are constrained to ``('batch', 'length',
'act_embed')`` (under sequence parallelism, an all-gather of the sequence,
which the plain path does inside its column-parallel head); the head weight is
gathered over its ``embed`` axes once before the scan; with ``vocab`` sharded
(tensor parallelism) the log-sum-exp and the target logit of each chunk are
all-reduced (``b·chunk`` floats each, a few per chunk) and the gradient of the
hidden states is summed over the vocabulary shards (``b·chunk·e`` per chunk,
as the plain head's backward sums ``b·s·e``; XLA:CPU all-reduces it where SP's
plain head reduce-scatters). The head gradient is accumulated per batch shard
(a ``[shards, e, V]`` fp32 accumulator sharded on the batch axes: ``e·V/t``
floats per device, the size of the plain path's unreduced head gradient) and
summed over the shards once after the loop: a partial sum carried through
the loop would be all-reduced by XLA in every chunk, ``s / chunk`` times the
head's gradient reduction. The sum lands in the weight's own layout: under
HSDP over the fsdp shards first (a reduce-scatter), then over the replicas
(:func:`_sum_shards`), as the plain head's gradient is reduced.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.axes import HIDDEN, LOGITS
from jaxscale.layout import TOKENS
from jaxscale.parallel import pipeline
from jaxscale.sharding import active, constrain, spec

WEIGHT = ("embed", "vocab")  # the head weight [embed, vocab] as its parameter is laid out
HEAD = (None, "vocab")  # ... gathered on embed for the loop
SHARD_HEAD = ("batch", None, "vocab")  # partial head gradients, one per batch shard


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[b, s, ...] -> [s / chunk, b, chunk, ...]: step j of the scan holds tokens j, j + s/chunk, ..."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, chunk, s // chunk, *x.shape[2:]), 2, 0)


def _unchunk(x: jax.Array) -> jax.Array:
    """The inverse of :func:`_chunks`."""
    n, b, chunk = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape(b, chunk * n, *x.shape[3:])


def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """One chunk's logits [b, chunk, V] in fp32 (the matmul accumulated in fp32)."""
    return constrain(jnp.einsum("bce,ev->bcv", h, w, preferred_element_type=jnp.float32), LOGITS)


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """One-hot mask of the targets, by comparison with an iota (stays sharded on vocab)."""
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]


def trained_count(targets: jax.Array) -> jax.Array:
    """How many of ``targets`` are trained (not ``IGNORE``, negative), at least 1: the loss's divisor, fp32."""
    return jnp.maximum(jnp.sum(targets >= 0, dtype=jnp.float32), 1.0)


def _forward(hidden: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Mean loss over the trained targets and the log-sum-exp of every token, chunked as :func:`_chunks`;
    ``w`` gathered (``HEAD``)."""

    def body(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        h, t = xs
        logits = _logits(constrain(h, HIDDEN), w)
        picked = jnp.sum(jnp.where(_is_target(logits, t), logits, 0.0), axis=-1)
        return None, (jax.nn.logsumexp(logits, axis=-1), picked)

    _, (lse, picked) = jax.lax.scan(body, None, (_chunks(hidden, chunk), _chunks(targets, chunk)))
    trained = _chunks(targets, chunk) >= 0
    return jnp.sum(jnp.where(trained, lse - picked, 0.0)) / trained_count(targets), lse


def microbatch_weights(targets: jax.Array) -> jax.Array:
    """``n_i / N`` of each microbatch ``i`` of ``targets`` [microbatches, rows, length]: its trained targets
    over all of them (the weights that make the microbatches' means the global batch's mean)."""
    counts = jnp.sum(targets >= 0, axis=tuple(range(1, targets.ndim)), dtype=jnp.float32)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)


def _batch_shards() -> int:
    """How many ways the active rules split the batch (1 outside :func:`jaxscale.sharding.use_rules`)."""
    current = active()
    return current[1].batch_shards if current is not None else 1


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(hidden: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    return _forward(hidden, constrain(w, HEAD), targets, chunk)[0]


def _cross_entropy_fwd(hidden: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> tuple[jax.Array, Any]:
    w = constrain(w, HEAD)  # gathered once: the backward reuses it
    loss, lse = _forward(hidden, w, targets, chunk)
    return loss, (hidden, w, targets, lse)


def _cross_entropy_bwd(chunk: int, residuals: Any, g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    hidden, w, targets, lse = residuals
    scale = g / trained_count(targets)
    shards = _batch_shards()

    def by_shard(x: jax.Array) -> jax.Array:
        return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])

    def body(dw: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, t, chunk_lse = xs
        h = constrain(h, HIDDEN)
        logits = _logits(h, w)
        weight = jnp.where(t >= 0, scale, 0.0)[..., None]  # an IGNORE target has no gradient
        dlogits = (jnp.exp(logits - chunk_lse[..., None]) - _is_target(logits, t)) * weight
        dlogits = constrain(dlogits.astype(w.dtype), LOGITS)
        dh = jnp.einsum("bcv,ev->bce", dlogits, w, preferred_element_type=jnp.float32)
        # Each batch shard's partial head gradient, summed over the shards once after the loop.
        dw = dw + jnp.einsum("sbce,sbcv->sev", by_shard(h), by_shard(dlogits), preferred_element_type=jnp.float32)
        return constrain(dw, SHARD_HEAD), constrain(dh.astype(hidden.dtype), HIDDEN)

    # Inside a pipeline stage's shard_map the scan's carry is typed as varying as its body's output.
    manual = tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in (hidden, w)))))
    dw0 = pipeline.vary(constrain(jnp.zeros((shards, *w.shape), jnp.float32), SHARD_HEAD), manual)
    dw, dh = jax.lax.scan(body, dw0, (_chunks(hidden, chunk), _chunks(targets, chunk), lse))
    return _unchunk(dh), _sum_shards(dw).astype(w.dtype), None


def _sum_shards(dw: jax.Array) -> jax.Array:
    """The batch shards' head gradients [shards, e, V] summed into the weight's layout (``WEIGHT``).

    Summed at once, XLA all-reduces the whole gradient over every batch axis. Where some batch axes also
    split the weight (HSDP: batch over data x fsdp, embed over fsdp) the sum runs over those first (a
    reduce-scatter onto each device's slice), then over the others (an all-reduce of the slice), as the
    layers' gradients are reduced.
    """
    current = active()
    if current is None:
        return jnp.sum(dw, axis=0)
    mesh, place = current
    batch, held = place.batch_axes, place.mesh_axes(WEIGHT)
    rest = tuple(a for a in batch if a not in held)
    if len(rest) in (0, len(batch)):
        return constrain(jnp.sum(dw, axis=0), WEIGHT)
    embed, vocab = spec(place, WEIGHT)
    dw = dw.reshape(*(mesh.shape[a] for a in batch), *dw.shape[1:])  # a dimension per batch axis
    dw = jax.lax.with_sharding_constraint(dw, NamedSharding(mesh, PartitionSpec(*batch, None, vocab)))
    dw = jnp.sum(dw, axis=tuple(i for i, a in enumerate(batch) if a in held))
    dw = jax.lax.with_sharding_constraint(dw, NamedSharding(mesh, PartitionSpec(*rest, embed, vocab)))
    return constrain(jnp.sum(dw, axis=tuple(range(len(rest)))), WEIGHT)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def chunked_cross_entropy(hidden: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """Mean cross-entropy of ``hidden @ w`` against ``targets``, ``chunk`` tokens of each sequence at a time.

    ``hidden`` [batch, length, embed] and ``w`` [embed, vocab] in the compute dtype, ``targets``
    [batch, length] integers (negative: not trained, as :func:`cross_entropy`); ``chunk`` must divide
    ``length``. Equal to ``cross_entropy(hidden @ w, targets)`` in value and gradient (exactly so in fp32), without
    ever holding more than one ``[batch, chunk, vocab]`` block of logits.
    """
    s = hidden.shape[1]
    if chunk <= 0 or s % chunk:
        raise ValueError(f"chunk {chunk} does not divide the sequence length {s}")
    hidden = constrain(hidden, HIDDEN)
    return _cross_entropy(hidden, constrain(w, WEIGHT), constrain(targets, TOKENS), chunk)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``logits`` [batch, length, vocab] against ``targets``, in fp32,
    over the trained targets (a negative target, :data:`jaxscale.data.IGNORE`, is left out: it adds
    nothing and has no gradient).

    The target logit is picked by comparison with an iota, not gathered: its gradient is then a
    select, not a scatter (XLA cannot partition a scatter inside a pipeline's partly manual region).
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.sum(jnp.where(_is_target(logits, targets), logits, 0.0), axis=-1)
    per_token = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.sum(jnp.where(targets >= 0, per_token, 0.0)) / trained_count(targets)


def head_cross_entropy(model: Any, x: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """Mean cross-entropy of a richer-form model's head (:class:`jaxscale.models.contract.Staged`) on its
    final-normed hidden states ``x``: chunked (:func:`chunked_cross_entropy`) when ``chunk`` > 0
    (``model.loss_chunk``), else from the logits."""
    if chunk:
        return chunked_cross_entropy(x, model.head_weight(), targets, chunk)
    return cross_entropy(model.logits(x), targets)


def stage_head_loss(model: Any, y: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """A pipeline's last stage: final norm, head and mean cross-entropy of the stack's output ``y``."""
    return head_cross_entropy(model, model.final_norm(y), targets, chunk)


def model_objective(model: Any, batch: dict[str, jax.Array], chunk: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The default training objective: mean cross-entropy plus the model's auxiliary losses, and its metrics.

    Asks the model contract (docs/models.md): a model with ``hidden`` and ``logits`` (or, with ``chunk`` > 0,
    ``head_weight``: the chunked loss) gives the hidden states and metrics, weighed by its ``aux_loss``.
    Otherwise the model is called, ``model(tokens, positions)``, for its logits.
    """
    tokens, positions, targets = batch["inputs"], batch["positions"], batch["targets"]
    if not (hasattr(model, "hidden") and hasattr(model, "head_weight" if chunk else "logits")):
        return cross_entropy(model(tokens, positions), targets), {}
    hidden, metrics = model.hidden(tokens, positions)
    aux = model.aux_loss(metrics) if hasattr(model, "aux_loss") else 0.0
    return head_cross_entropy(model, hidden, targets, chunk) + aux, metrics
