"""The optimizer: optax AdamW (or Muon, ``train.optimizer: muon``: :mod:`jaxscale.training.muon`) with warmup + cosine
decay and global-norm clipping.

The optimizer updates the master weights (:mod:`jaxscale.precision.policy`: the fp32
parameters themselves in fp32 training, else a master apart from the bf16
compute copy), and Adam's moments take the master's dtype. Weight decay applies to
matrices only: a parameter with fewer than two dimensions other than
``layers`` (norm scales, biases) is not decayed.

ZeRO stages are not code here: the rules table's ``optimizer`` and
``gradients`` sections give the state and the gradients their own layout,
and the partitioner computes each shard's update where the state lives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxscale.config.schema import TrainConfig, schedule_length
from jaxscale.training import muon


def schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup to the peak rate, cosine decay to ``min_lr_ratio`` of it at :func:`schedule_length`."""
    length = schedule_length(config)
    warmup = min(config.warmup_steps, max(length - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(length, warmup + 1),
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def decay_mask(axes: Any) -> Any:
    """True for parameters that get weight decay (matrices), from their logical axes."""
    return jax.tree.map(
        lambda a: sum(1 for n in a if n != "layers") >= 2, axes, is_leaf=lambda x: isinstance(x, tuple)
    )


def make_optimizer(config: TrainConfig, axes: Any) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW (or Muon: :func:`muon_of`) with the schedule; ``axes`` is the tree of
    logical axes."""
    if config.optimizer == "muon":
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), muon_of(config, axes))
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask(axes),
        ),
    )


def muon_of(config: TrainConfig, axes: Any) -> optax.GradientTransformation:
    """:func:`jaxscale.training.muon.muon` of ``train.muon``: the hidden matrices on the schedule of
    ``train.muon.learning_rate``
    (default ``train.learning_rate``), the rest on AdamW's of ``train.*``."""
    m = config.muon
    peak = config.learning_rate if m.learning_rate is None else m.learning_rate
    return muon.muon(
        schedule(dataclasses.replace(config, learning_rate=peak)),
        axes,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        ns_dtype=jnp.dtype(m.ns_dtype),
        scale=m.scale,
        rms=m.rms,
        weight_decay=config.weight_decay if m.weight_decay is None else m.weight_decay,
        adamw_learning_rate=schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        adamw_weight_decay=config.weight_decay,
        adamw_axes=tuple(m.adamw_axes),
    )
