"""The model contract: what the trainer asks of a model, in two forms (docs/models.md).

**Plain form**: any ``nnx.Module`` whose parameters carry logical axis names in Flax's standard
``out_sharding`` metadata and whose ``__call__(tokens, positions)`` returns logits
``[batch, length, vocab]``. Every layout but the pipeline runs it, with the plain cross-entropy.

**Richer form** (:class:`Staged`): the parts the trainer needs to see inside the model. Each group
unlocks one thing (:data:`NEEDS`), and asking for that thing without it is a one-line
:class:`~jaxscale.config.read.ConfigError` naming what is missing (:func:`require`).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import nnx

from jaxscale.config.read import ConfigError, ModelConfig

Metrics = dict[str, jax.Array]


class Staged(Protocol):
    """The richer form. ``metrics`` is the one channel for auxiliary losses (MoE load balance, z-loss, a
    model's own): a dict of fp32 arrays returned by each stacked unit, reduced over the layers by
    ``stack_metrics`` (:class:`Extended`) into those :meth:`hidden` returns, and turned into the weighted
    term the objective adds by :meth:`aux_loss`."""

    config: ModelConfig  # the shapes the pipeline's buffers take (embed, dtype, vocab_size, moe)
    # Optional, False when absent: every projection of the stacked unit goes through
    # jaxscale.parallel.sequence's column_parallel / row_parallel, which write TP's collectives where a
    # pipeline stage's loop is manual over TP's axes (jaxscale.layout.stage_plan): such a stage skips its idle
    # slots. Without it TP inside a stage stays with the partitioner and idle slots are masked.
    explicit_tp: bool
    embedding: nnx.Param  # the token table [vocab, embed] that :meth:`embed` reads
    blocks: nnx.Module  # the stacked unit, leading ``layers`` axis: ``unit(x, positions) -> (x, metrics)``

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token ids [batch, length] -> the residual stream [batch, length, embed]."""
        ...

    def final_norm(self, x: jax.Array) -> jax.Array:
        """What runs after the stack, before the head."""
        ...

    def hidden(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
        """The final-normed hidden states [batch, length, embed] and the metrics."""
        ...

    def logits(self, x: jax.Array) -> jax.Array:
        """The head on final-normed hidden states: logits [batch, length, vocab]."""
        ...

    def head_weight(self) -> jax.Array:
        """The output projection [embed, vocab] in the compute dtype (for the chunked loss)."""
        ...

    def aux_loss(self, metrics: Metrics) -> jax.Array | float:
        """The weighted auxiliary objective of the metrics (0 for none)."""
        ...


class Extended(Staged, Protocol):
    """Optional parts of the richer form, each read where present.

    ``stack_metrics``: how :meth:`hidden` reduces its units' metrics; a pipeline, which never runs ``hidden``,
    reduces them the same way (absent: each key's mean over the layers, :mod:`jaxscale.parallel.stage_metrics`).
    ``prefix``: what runs between :meth:`embed` and the stack (DeepSeek's dense blocks); a pipeline runs
    it on its first stage, after the lookup, its parameters with the embedding's; its metrics, where it returns
    some, go before the stack's. ``ahead``: predictions
    beyond the next token (DeepSeek's multi-token prediction) from the stack's output before
    :meth:`final_norm`; the objective adds their weighted terms by :meth:`aux_loss`, and a pipeline runs it
    on its last stage with the head. A model with ``ahead`` gives the plain objective that output by
    ``trunk``."""

    def stack_metrics(self, stacked: Metrics) -> Metrics:
        """The stacked units' metrics, each [layers, ...] in the model's layer order -> the metrics :meth:`hidden`
        returns for them."""
        ...

    def prefix(self, x: jax.Array, positions: jax.Array) -> jax.Array | tuple[jax.Array, Metrics]:
        """The residual stream after the embedding -> the stack's input, the same shape (and, optionally, its
        metrics)."""
        ...

    def trunk(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
        """The stack's output before :meth:`final_norm` and the metrics (``hidden`` without the final norm)."""
        ...

    def ahead(self, y: jax.Array, batch: dict[str, jax.Array]) -> Metrics:
        """The stack's output ``y`` and the batch (``inputs``, ``positions``, ``targets``) -> metrics for
        :meth:`aux_loss`; per-layer MoE statistics under ``moe_layers`` follow the stack's layers."""
        ...


# What each part of the richer form unlocks: the thing asked for -> the attributes it needs.
CHUNKED_LOSS = "the chunked loss (model.loss_chunk > 0)"
PIPELINE = "pipeline parallelism"
AHEAD = "predictions ahead (a model with ahead)"
NEEDS: dict[str, tuple[str, ...]] = {
    CHUNKED_LOSS: ("hidden", "head_weight"),
    PIPELINE: ("config", "embedding", "embed", "blocks", "final_norm", "logits", "head_weight", "aux_loss"),
    AHEAD: ("trunk", "final_norm", "logits", "head_weight", "aux_loss"),
}
OPTIONAL = ("hidden", "logits", "head_weight", "aux_loss", "flops_per_token", "explicit_tp", "prefix",
            "ahead", "stack_metrics")  # read when present


def parts(model: Any) -> frozenset[str]:
    """The attributes of the richer form (and ``flops_per_token``) that ``model`` has (a flag set False: not)."""
    names = {name for names in NEEDS.values() for name in names} | set(OPTIONAL)
    return frozenset(name for name in names if getattr(model, name, False) is not False)


def require(have: frozenset[str], what: str, model: str, why: str) -> None:
    """Raise a one-line ConfigError when a model with these parts cannot give ``what`` (asked by ``why``)."""
    missing = [name for name in NEEDS[what] if name not in have]
    if missing:
        raise ConfigError(
            f"{why} asks for {what}: model {model} lacks {', '.join(missing)} "
            "(the richer form of the model contract, docs/models.md)"
        )


def check_module(model: Any, factory: str) -> None:
    """Raise if ``factory`` did not give an ``nnx.Module`` with a ``__call__``."""
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"model factory {factory} returned {type(model).__name__}, not an nnx.Module")
    if not callable(model):
        raise ConfigError(f"model {type(model).__name__} has no __call__(tokens, positions) -> logits")
