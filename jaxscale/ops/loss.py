"""Cross-entropy, plain and chunked ("fused linear": from the final hidden states and the head weight).

**Loss masks**: a negative target (:data:`jaxscale.data.batches.IGNORE`: a prompt's token) is not trained. The
loss is the mean over the trained targets of the whole global batch: their summed cross-entropy divided
by their count. Across data shards that holds as written: the step is one global computation, the sum
and the count are over every shard's rows (XLA's all-reduces). Across ``train.microbatches`` the trainer
weighs microbatch ``i``'s mean by ``n_i / N`` (its trained targets over the global batch's,
:func:`microbatch_weights`), and a pipeline's microbatches are weighed the same way, so accumulation
gives the loss and gradients of the whole batch at once. A batch with no trained target has loss 0.

The plain loss (:func:`cross_entropy`) takes logits
``[batch, length, vocab]``: the head matmul's output in the compute dtype,
its fp32 copy, the softmax and the gradient of the logits, of which XLA fuses
all but the logits and their gradient in the compute dtype (compiled alone:
``2·b·s·V·dtype`` bytes for XLA:GPU, half that for libtpu; 1.6 fp32 buffers
for XLA:CPU, ``benchmarks/loss_memory.py``); for a 128k vocabulary and 8k
tokens per device, 2 GiB per bf16 buffer.

:func:`chunked_cross_entropy` never builds them: it takes the hidden states
``[b, s, e]`` and the head weight ``[e, V]`` and runs a ``lax.scan`` over
``n`` slices of the **vocabulary** (``n = s / chunk``, rounded up to divide
each vocabulary shard: :func:`slice_count`), so each block of logits
``[b, s, V/n]`` is no larger than ``[b, chunk, V]`` (``model.loss_chunk``
keeps its meaning for memory). The forward keeps an online log-sum-exp (running
maximum and sum) and the target logit, ``b·s`` floats per vocabulary shard,
combined over the shards once after the loop. The backward is a
``custom_vjp`` that runs the scan again, recomputing each block of logits to
form its gradient (softmax minus one-hot). Each slice's head gradient
``[e, V/n]`` is complete after its step (a sum over all the tokens): it is a
loop **output**, written once, reduced over the batch shards into the weight's
own layout (a reduce-scatter over fsdp under ZeRO-3/HSDP) inside the step that
made it, so the head gradient's bytes do not grow with ``n``. What is
accumulated is the hidden states' gradient, ``b·s·e`` fp32 (one part per
vocabulary shard, summed over the shards once after the loop): for a 128k
vocabulary and 16k tokens per device 8x fewer bytes per step than a
``[e, V]`` accumulator, which chunking the tokens would need.

**What it costs**: the head matmul runs once more (recomputed in the backward:
4 head matmuls instead of 3, +2·b·s·e·V FLOPs); Liger's variant computes the
gradient in the forward instead, which wastes it in evaluation, so the
recomputation is chosen here. **What it communicates** under the rules: the
hidden states are constrained to ``('batch', 'length', 'act_embed')`` (under
sequence parallelism, an all-gather of the sequence, which the plain path does
inside its column-parallel head); the head weight is gathered over its
``embed`` axes once before the scan. The slices are laid out
``[n, e, shards, width]`` with the vocabulary shards a dimension of their
own, so every per-slice statistic stays on its shard: nothing is reduced over
the vocabulary inside the loop; after it, the log-sum-exp and target logit
(``b·s`` floats) and the hidden states' gradient (``b·s·e``, as the plain
head's backward sums it) are summed over the vocabulary shards once. The
head gradient's reductions over the batch shards run per slice, ``e·V/n``
each, the plain head's one reduction in ``n`` parts.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.config.axes import HIDDEN
from jaxscale.config.read import ConfigError
from jaxscale.layout.rules import TOKENS
from jaxscale.layout.sharding import active, constrain, stated, vary
from jaxscale.ops.routing import joined

WEIGHT = ("embed", "vocab")  # the head weight [embed, vocab] as its parameter is laid out
HEAD = (None, "vocab")  # ... gathered on embed for the loop
SLICE = (None, "vocab", None)  # one vocabulary slice of the weight [embed, shards, width], gathered on embed
SLICE_GRAD = ("embed", "vocab", None)  # ... its gradient, in the weight's own layout
BLOCK = ("batch", "length", "vocab", None)  # one block of logits [batch, length, shards, width]
PER_SHARD = ("batch", "length", "vocab")  # running statistics, one per vocabulary shard [batch, length, shards]
HIDDEN_PARTS = ("batch", "length", "vocab", None)  # the hidden states' gradient, one part per vocabulary shard
# The named scope of the head gradient's instructions (analysis/hlo_compute.py's scoped_bytes counts them).
HEAD_GRADIENT = "head_gradient"


def _vocab_shards() -> int:
    """How many ways the active rules split ``vocab`` (1 outside :func:`jaxscale.layout.sharding.use_rules`)."""
    current = active()
    return current[1].size(current[1].mesh_axes(("vocab",))) if current is not None else 1


def slice_count(vocab: int, shards: int, length: int, chunk: int) -> int:
    """How many vocabulary slices the loss runs in: the fewest that keep every block of logits within
    ``[batch, chunk, vocab]`` (``length / chunk`` of them), rounded up to divide each shard's vocabulary."""
    local, want = vocab // shards, length // chunk
    return next(n for n in range(want, local + 1) if local % n == 0)


def _sliced(w: jax.Array, n: int) -> jax.Array:
    """[e, V] -> [n, e, shards, V / (shards n)]: slice j holds columns j·width ... of every vocabulary shard."""
    t = _vocab_shards()
    e, v = w.shape
    return jnp.moveaxis(w.reshape(e, t, n, v // (t * n)), 2, 0)


def _unsliced(dw: jax.Array) -> jax.Array:
    """The inverse of :func:`_sliced`."""
    n, e, t, c = dw.shape
    return jnp.moveaxis(dw, 0, 2).reshape(e, t * n * c)


def _block(h: jax.Array, w: jax.Array) -> jax.Array:
    """One slice's logits [b, s, shards, width] in fp32 (the matmul accumulated in fp32)."""
    return constrain(jnp.einsum("bse,etc->bstc", h, w, preferred_element_type=jnp.float32, out_sharding=stated(BLOCK)),
                     BLOCK)


def _is_target_in(block: jax.Array, j: jax.Array, vocab: int, targets: jax.Array) -> jax.Array:
    """One-hot mask of the targets in slice ``j``'s block, by comparison with the columns' global ids."""
    t, c = block.shape[2:]
    shard = jax.lax.broadcasted_iota(jnp.int32, block.shape, 2)
    column = shard * (vocab // t) + j * c + jax.lax.broadcasted_iota(jnp.int32, block.shape, 3)
    return column == targets[..., None, None]


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """One-hot mask of the targets, by comparison with an iota (stays sharded on vocab)."""
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]


def trained_count(targets: jax.Array) -> jax.Array:
    """How many of ``targets`` are trained (not ``IGNORE``, negative), at least 1: the loss's divisor, fp32."""
    return jnp.maximum(jnp.sum(targets >= 0, dtype=jnp.float32), 1.0)


def _varying(x: jax.Array, *like: jax.Array) -> jax.Array:
    """``x`` typed as varying over the manual axes ``like`` vary on (a scan's carry inside a pipeline stage's
    shard_map is typed as its body's output)."""
    manual = tuple(sorted(set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))))
    return vary(x, manual)


def _forward(hidden: jax.Array, slices: jax.Array, targets: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Mean loss over the trained targets and the log-sum-exp of every token [b, s]: an online log-sum-exp
    over the vocabulary ``slices`` [n, e, shards, width] (gathered on embed), one per vocabulary shard."""
    b, s = targets.shape

    def body(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, ...], None]:
        peak, total, picked = carry
        w, j = xs
        logits = _block(hidden, constrain(w, SLICE))
        new = jnp.maximum(peak, jnp.max(logits, axis=-1))
        total = total * jnp.exp(peak - new) + jnp.sum(jnp.exp(logits - new[..., None]), axis=-1)
        picked = picked + jnp.sum(jnp.where(_is_target_in(logits, j, vocab, targets), logits, 0.0), axis=-1)
        return (constrain(new, PER_SHARD), constrain(total, PER_SHARD), constrain(picked, PER_SHARD)), None

    shape = (b, s, slices.shape[2])
    zeros = _varying(constrain(jnp.zeros(shape, jnp.float32), PER_SHARD), hidden, slices)
    start = (_varying(constrain(jnp.full(shape, -jnp.inf), PER_SHARD), hidden, slices), zeros, zeros)
    (peak, total, picked), _ = jax.lax.scan(body, start, (slices, jnp.arange(slices.shape[0])))
    lse = jax.nn.logsumexp(peak + jnp.log(total), axis=-1)  # over the vocabulary shards
    per_token = lse - jnp.sum(picked, axis=-1)
    return jnp.sum(jnp.where(targets >= 0, per_token, 0.0)) / trained_count(targets), lse


def microbatch_weights(targets: jax.Array) -> jax.Array:
    """``n_i / N`` of each microbatch ``i`` of ``targets`` [microbatches, rows, length]: its trained targets
    over all of them (the weights that make the microbatches' means the global batch's mean)."""
    counts = jnp.sum(targets >= 0, axis=tuple(range(1, targets.ndim)), dtype=jnp.float32)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(hidden: jax.Array, w: jax.Array, targets: jax.Array, n: int) -> jax.Array:
    return _forward(hidden, _sliced(constrain(w, HEAD), n), targets, w.shape[1])[0]


def _cross_entropy_fwd(hidden: jax.Array, w: jax.Array, targets: jax.Array, n: int) -> tuple[jax.Array, Any]:
    slices = _sliced(constrain(w, HEAD), n)  # gathered once: the backward reuses it
    loss, lse = _forward(hidden, slices, targets, w.shape[1])
    return loss, (hidden, slices, targets, lse)


def _cross_entropy_bwd(n: int, residuals: Any, g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    hidden, slices, targets, lse = residuals
    vocab = slices.shape[0] * slices.shape[2] * slices.shape[3]
    weight = jnp.where(targets >= 0, g / trained_count(targets), 0.0)[..., None, None]  # IGNORE: no gradient

    def body(dh: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        w, j = xs
        w = constrain(w, SLICE)
        logits = _block(hidden, w)
        dlogits = (jnp.exp(logits - lse[..., None, None]) - _is_target_in(logits, j, vocab, targets)) * weight
        dlogits = constrain(dlogits.astype(w.dtype), BLOCK)
        # The slice's head gradient, summed over the tokens (and their shards) once: a loop output, not a carry.
        with jax.named_scope(HEAD_GRADIENT):
            dw = jnp.einsum("bse,bstc->etc", hidden, dlogits, preferred_element_type=jnp.float32,
                            out_sharding=stated(SLICE_GRAD))
            dw = constrain(dw, SLICE_GRAD).astype(w.dtype)
        # The hidden states' gradient, one part per vocabulary shard, summed over the shards once after the loop.
        dh = dh + jnp.einsum("bstc,etc->bste", dlogits, w, preferred_element_type=jnp.float32,
                             out_sharding=stated(HIDDEN_PARTS))
        return constrain(dh, HIDDEN_PARTS), dw

    b, s, e = hidden.shape
    dh0 = _varying(constrain(jnp.zeros((b, s, slices.shape[2], e), jnp.float32), HIDDEN_PARTS), hidden, slices)
    dh, dw = jax.lax.scan(body, dh0, (slices, jnp.arange(n)))
    return constrain(jnp.sum(dh, axis=2).astype(hidden.dtype), HIDDEN), constrain(_unsliced(dw), WEIGHT), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def chunked_cross_entropy(hidden: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """Mean cross-entropy of ``hidden @ w`` against ``targets``, in slices of the vocabulary no larger than
    ``chunk`` tokens of each sequence would make (:func:`slice_count`).

    ``hidden`` [batch, length, embed] and ``w`` [embed, vocab] in the compute dtype, ``targets``
    [batch, length] integers (negative: not trained, as :func:`cross_entropy`); ``chunk`` must divide
    ``length``. Equal to ``cross_entropy(hidden @ w, targets)`` in value and gradient (to rounding in fp32),
    without ever holding more than one ``[batch, chunk, vocab]``-sized block of logits.
    """
    s = hidden.shape[1]
    if chunk <= 0 or s % chunk:
        raise ValueError(f"chunk {chunk} does not divide the sequence length {s}")
    n = slice_count(w.shape[1], _vocab_shards(), s, chunk)
    hidden = constrain(hidden, HIDDEN)
    return _cross_entropy(hidden, constrain(w, WEIGHT), constrain(targets, TOKENS), n)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``logits`` [batch, length, vocab] against ``targets``, in fp32,
    over the trained targets (a negative target, :data:`jaxscale.data.batches.IGNORE`, is left out: it adds
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
    return cross_entropy(checked_logits(model.logits(x), targets, model, "logits(states)"), targets)


def checked_logits(logits: Any, targets: jax.Array, model: Any, call: str) -> jax.Array:
    """``logits`` if they are ``[batch, length, vocab]`` for ``targets`` ``[batch, length]`` (read while the step
    is traced, before anything compiles); else a one-line :class:`ConfigError` naming the model contract."""
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != tuple(targets.shape):
        got = f"shape {tuple(shape)}" if shape is not None else f"a {type(logits).__name__}"
        raise ConfigError(
            f"model {type(model).__name__}: {call} returned {got}, not logits [batch, length, vocab] = "
            f"[{', '.join(map(str, targets.shape))}, vocab] (the model contract, docs/models.md)"
        )
    return logits


def stage_head_loss(
    model: Any, y: jax.Array, batch: dict[str, jax.Array], chunk: int
) -> tuple[jax.Array, dict[str, Any]]:
    """A pipeline's last stage on one microbatch: final norm, head and mean cross-entropy of the stack's output
    ``y``, and the metrics of the model's ``ahead`` (the contract's predictions ahead; the pipeline weighs
    them by the model's ``aux_loss``, :mod:`jaxscale.parallel.stage_metrics`)."""
    loss = head_cross_entropy(model, model.final_norm(y), batch["targets"], chunk)
    return loss, model.ahead(y, batch) if hasattr(model, "ahead") else {}


def model_objective(model: Any, batch: dict[str, jax.Array], chunk: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The default training objective: mean cross-entropy plus the model's auxiliary losses, and its metrics.

    Asks the model contract (docs/models.md): a model with ``hidden`` and ``logits`` (or, with ``chunk`` > 0,
    ``head_weight``: the chunked loss) gives the hidden states and metrics, weighed by its ``aux_loss``; one
    with ``ahead`` gives the stack's output by ``trunk``, and ``ahead``'s metrics join the stack's.
    Otherwise the model is called, ``model(tokens, positions)``, for its logits.
    """
    tokens, positions, targets = batch["inputs"], batch["positions"], batch["targets"]
    if hasattr(model, "ahead"):
        y, metrics = model.trunk(tokens, positions)
        metrics = joined(metrics, model.ahead(y, batch))
        return head_cross_entropy(model, model.final_norm(y), targets, chunk) + model.aux_loss(metrics), metrics
    if not (hasattr(model, "hidden") and hasattr(model, "head_weight" if chunk else "logits")):
        return cross_entropy(checked_logits(model(tokens, positions), targets, model, "__call__(tokens, positions)"),
                             targets), {}
    hidden, metrics = model.hidden(tokens, positions)
    aux = model.aux_loss(metrics) if hasattr(model, "aux_loss") else 0.0
    return head_cross_entropy(model, hidden, targets, chunk) + aux, metrics
