"""The range of every numeric config key, as data, and the check that reads it.

:data:`RANGES` maps a dotted key to its :class:`Range`; :func:`out_of_range` finds a value outside
it (NaN and infinities included: a float must be finite) in one line naming the key and the range.
A key whose section is switched off (``model.moe: null``) or whose value is null (``train.peak_flops``)
is not checked. The mesh sizes are not here: -1 (the rest of the devices) is a size, not a range
(:func:`jaxscale.config.read.validate`). This module imports neither jax nor :mod:`jaxscale.config.read`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

INF = math.inf
SEED_MAX = 2**32 - 1  # numpy's and grain's seeds are unsigned 32-bit


@dataclasses.dataclass(frozen=True)
class Range:
    """``low`` to ``high``; ``open_low``/``open_high``: the bound itself excluded."""

    low: float = -INF
    high: float = INF
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        """``at least 1``, ``positive``, ``in [0, 1)``."""
        if self.high == INF:
            if self.low == 0 and self.open_low:
                return "positive"
            return f"{'more than' if self.open_low else 'at least'} {_number(self.low)}"
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(0, open_low=True)
AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
FRACTION = Range(0, 1)  # [0, 1]
BETA = Range(0, 1, open_high=True)  # [0, 1)

RANGES: dict[str, Range] = {
    "model.vocab_size": AT_LEAST_1,
    "model.embed": AT_LEAST_1,
    "model.layers": AT_LEAST_1,
    "model.heads": AT_LEAST_1,
    "model.kv_heads": AT_LEAST_1,
    "model.head_dim": AT_LEAST_1,
    "model.mlp": AT_LEAST_1,
    "model.rope_theta": POSITIVE,
    "model.norm_eps": POSITIVE,
    "model.init_std": POSITIVE,
    "model.attention_block": AT_LEAST_1,
    "model.loss_chunk": AT_LEAST_0,
    "model.moe.experts": AT_LEAST_1,
    "model.moe.top_k": AT_LEAST_1,
    "model.moe.mlp": AT_LEAST_1,
    "model.moe.every_n_layers": AT_LEAST_1,
    "model.moe.shared_experts": AT_LEAST_0,
    "model.moe.capacity_factor": POSITIVE,
    "model.moe.aux_loss_weight": AT_LEAST_0,
    "model.moe.z_loss_weight": AT_LEAST_0,
    "model.deepseek.q_lora_rank": AT_LEAST_1,
    "model.deepseek.kv_lora_rank": AT_LEAST_1,
    "model.deepseek.qk_nope_head_dim": AT_LEAST_1,
    "model.deepseek.qk_rope_head_dim": AT_LEAST_1,
    "model.deepseek.v_head_dim": AT_LEAST_1,
    "model.deepseek.dense_layers": AT_LEAST_0,
    "model.deepseek.routed_scale": POSITIVE,
    "model.deepseek.mtp_depth": AT_LEAST_0,
    "model.deepseek.mtp_loss_weight": AT_LEAST_0,
    "mesh.dcn.data": AT_LEAST_1,
    "mesh.dcn.stage": AT_LEAST_1,
    "mesh.dcn.fsdp": AT_LEAST_1,
    "mesh.dcn.context": AT_LEAST_1,
    "mesh.dcn.ulysses": AT_LEAST_1,
    "mesh.dcn.expert": AT_LEAST_1,
    "mesh.dcn.tensor": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.schedule_steps": AT_LEAST_1,
    "train.seed": Range(0, SEED_MAX),
    "train.global_batch": AT_LEAST_1,
    "train.seq_len": AT_LEAST_1,
    "train.microbatches": AT_LEAST_1,
    "train.log_every": AT_LEAST_1,
    "train.learning_rate": AT_LEAST_0,
    "train.warmup_steps": AT_LEAST_0,
    "train.min_lr_ratio": FRACTION,
    "precision.nvfp4.bf16_last": FRACTION,
    "train.weight_decay": AT_LEAST_0,
    "train.b1": BETA,
    "train.b2": BETA,
    "train.eps": POSITIVE,
    "train.clip_norm": POSITIVE,
    "train.peak_flops": POSITIVE,
    "train.eval_every": AT_LEAST_0,
    "train.eval_steps": AT_LEAST_1,
    "train.max_consecutive_skips": AT_LEAST_1,
    "train.qk_clip": POSITIVE,
    "train.muon.momentum": BETA,
    "train.muon.ns_steps": AT_LEAST_1,
    "train.muon.rms": POSITIVE,
    "train.muon.learning_rate": AT_LEAST_0,
    "train.muon.weight_decay": AT_LEAST_0,
    "data.max_bytes": AT_LEAST_1,
    "data.eval_bytes": AT_LEAST_1,
    "distributed.init_timeout_s": AT_LEAST_1,
    "distributed.heartbeat_timeout_s": AT_LEAST_1,
    "distributed.rejoin_every": AT_LEAST_0,
    "checkpoint.every": AT_LEAST_0,
    "checkpoint.keep": AT_LEAST_1,
    "checkpoint.keep_every": AT_LEAST_0,
    "checkpoint.continuous_interval_s": AT_LEAST_0,
    "pipeline.microbatches": AT_LEAST_1,
    "pipeline.repeats": AT_LEAST_1,
    "pipeline.layers_per_stage[]": AT_LEAST_1,
    "precision.amax_history": AT_LEAST_1,
    "precision.margin": AT_LEAST_0,
}


def _lookup(config: Any, key: str) -> Any:
    """The value at a dotted key; None where a section on the way is switched off."""
    node = config
    for part in key.split("."):
        if node is None:
            return None
        node = getattr(node, part)
    return node


def out_of_range(config: Any) -> str | None:
    """The first key of :data:`RANGES` whose value lies outside its range, as one line; None if all fit."""
    for key, allowed in RANGES.items():
        listed = key.endswith("[]")
        value = _lookup(config, key.removesuffix("[]"))
        if value is None:
            continue
        for i, item in enumerate(value if listed else [value]):
            if item not in allowed:
                where = f"{key[:-2]}[{i}]" if listed else key
                return f"{where} must be {allowed.describe()}, got {item!r}"
    return None
