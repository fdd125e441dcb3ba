"""A Llama-style decoder in Flax NNX, annotated with logical axes.

RMSNorm, rotary position embeddings (the rotate-half layout of the Hugging
Face checkpoints), grouped-query attention and a SwiGLU feed-forward, with
optional tied embeddings. The model never names a device: every parameter
carries the logical names of its dimensions (``out_sharding`` metadata) and
the activations that decide communication are constrained by logical name
through :func:`jaxscale.layout.sharding.constrain`.

The logical axes are listed in :mod:`jaxscale.config.axes`.

The blocks are stacked (``nnx.vmap``, leading ``layers`` axis) and applied with
``nnx.scan`` so compile time does not grow with depth; each block is wrapped in
``nnx.remat`` with the configured policy.

With ``model.moe``, every ``every_n_layers``-th block's MLP is a mixture of
experts (``jaxscale/models/moe.py``). A scan needs identical steps, so the unit
stacked and scanned is then a :class:`Group` of ``every_n_layers`` blocks whose
last is the MoE one (the scan runs ``layers / every_n_layers`` times); one
stack of groups keeps the layer order and a single loop, where a dense stack
and an MoE stack would need a second loop or an interleaving schedule. Each
step returns its MoE layer's auxiliary losses and load statistics; :meth:`Llama.forward`
returns the losses' mean over the MoE layers, and the statistics per layer, next to the logits.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config import flops, stage_layers
from jaxscale.config.axes import GATE_UP_AXES, KV_AXES, LOGITS, MLP_AXES, Q_AXES, QKV_AXES, RESIDUAL, W_GATE_UP, W_QKV
from jaxscale.config.read import Config, ModelConfig, RopeScaling
from jaxscale.layout import offload
from jaxscale.layout.sharding import constrain, lookup, stage
from jaxscale.models import moe
from jaxscale.models.attention import core
from jaxscale.models.params import ones, param
from jaxscale.ops.lean import rms_norm, swiglu
from jaxscale.parallel import sequence
from jaxscale.parallel.logit_max import QK_LOGITS
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision
from jaxscale.precision.fp8 import Fp8, Operand


def remat_policy(config: ModelConfig) -> Callable | None:
    """The layer's activation-checkpointing policy, or None for no recomputation of the layer.

    What one layer keeps per token for its backward, h hidden, a·d_h query and g·d_h key/value
    widths, f the MLP width, B the compute dtype's bytes (bf16: 2), s the sequence length
    (Llama 3 8B in bf16 with flash-style attention, per token and layer: none 144 KiB, 36·h bytes
    next to Korthikanti's 34·h; selective 136 KiB; save_dots 84 KiB; full 8 KiB):

    - ``none``: B·(4h + 3·a·d_h + 2·g·d_h + 3f) + 4·(2 + a): two norm inputs and normed
      inputs, q, the attention output twice (the kernel's and the output projection's
      layout), k, v, gate, up, hidden; fp32 norm statistics and, with flash-style
      attention, the softmax's log-sum-exp per head (``dot`` keeps the a·s scores, fp32,
      and probabilities in their place: about 6·a·s bytes more).
    - ``selective``: the playbook's selective recomputation: the attention core is
      recomputed from q, k, v in the backward (:class:`Attention`), the rest kept as
      ``none``: the a·s scores and probabilities of ``dot`` attention (or the kernel's
      output and statistics, B·a·d_h + 4·a, of a flash-style one) are not kept.
    - ``save_dots``: the layer input and the outputs of the weight matmuls (jax's
      ``dots_with_no_batch_dims_saveable``, and the projections of :func:`jaxscale.precision.policy.einsum`,
      named ``weight_dot``) that the backward reads: B·(2h + a·d_h + 2·g·d_h + 2f),
      namely input, q, k, v, output projection, gate, up; norms, attention and SwiGLU are
      recomputed.
    - ``full``: the layer input, B·h; the whole layer is recomputed.
    - ``save_named``: the layer input and the ``checkpoint_name``s in ``model.remat_names`` on the device,
      those in ``model.remat_offload`` in host memory (:func:`jaxscale.layout.offload.remat_policy`).
    - ``offload_dots``: ``save_dots``' matmul outputs in host memory, the layer input on the device, B·h
      (:func:`jaxscale.layout.offload.dots_policy`); recomputed as ``save_dots``.
    """
    policies = jax.checkpoint_policies
    if config.remat == "save_named" and config.remat_offload:
        return offload.remat_policy(config.remat_names, config.remat_offload)
    if config.remat == "offload_dots":
        return offload.dots_policy(precision.WEIGHT_DOT)
    return {
        "none": None,
        "selective": None,
        "full": policies.nothing_saveable,
        "save_dots": policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(precision.WEIGHT_DOT)
        ),
        "save_named": policies.save_only_these_names(*config.remat_names),
    }[config.remat]


def make_fp8(config: Config, inputs: tuple[str, ...], weights: dict[str, str]) -> Fp8 | None:
    """The fp8 state of a module's projections (:class:`jaxscale.precision.fp8.Fp8`), or None with ``precision.fp8``
    off: decided here, once, so an fp32 or bf16 step never calls into :mod:`jaxscale.precision.fp8`."""
    return None if config.precision.fp8 == "off" else Fp8(config.precision, inputs, weights)


def fp8_input(f8: Fp8 | None, name: str, x: jax.Array) -> jax.Array | Operand:
    """Activation ``x`` (``name``) as the input of projections: an fp8 operand where fp8 state is live."""
    return x if f8 is None or fp8.live(f8) is None else f8.input(name, x)


def fp8_weight(module: nnx.Module, name: str, dtype: jnp.dtype) -> jax.Array | Operand:
    """``module``'s weight ``name`` in ``dtype``: an fp8 operand where the module's fp8 state is live (``module.fp8``,
    :func:`jaxscale.precision.fp8.live`). Where :func:`jaxscale.precision.policy.takes_wide` (``module.wide``), the
    weight as held: that einsum casts it to ``dtype`` inside (no rounding of a wider parameter's gradient back)."""
    w, f8 = getattr(module, name)[...], None if module.fp8 is None else fp8.live(module.fp8)
    if f8 is None and module.wide:
        return w
    w = w.astype(dtype)
    return w if f8 is None else f8.weight(name, w)


class RMSNorm(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config.model
        self.eps = c.norm_eps
        self.dtype = jnp.dtype(c.dtype)
        self.scale = ones((c.embed,), ("embed",), c.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Keeps for the backward ``x`` in the compute dtype and one fp32 statistic per token (:mod:`.lean`)."""
        return rms_norm(x.astype(self.dtype), self.scale[...], self.eps)


# -- rotary position embeddings: pair j of a head (dimensions j and j + d/2) turns by position · f_j, with
# f_j = θ^(-j/(d/2)). Llama 3.1 (``model.rope_scaling``, rope_type llama3) stretches the context by ``factor``
# without touching the short wavelengths: with L the original context (original_max_position_embeddings) and
# λ_j = 2π / f_j, λ_j < L / high_freq_factor keeps f_j; λ_j > L / low_freq_factor gives f_j / factor; between
# them (1 - t)·f_j/factor + t·f_j, t = (L/λ_j - low_freq_factor) / (high_freq_factor - low_freq_factor); no
# attention factor (Llama 3.1 has none).


def llama3_scaled(freq: jax.Array, s: RopeScaling) -> jax.Array:
    """Inverse frequencies ``freq`` [d/2] scaled as Llama 3.1 (the comment above)."""
    length = s.original_max_position_embeddings
    wavelength = 2 * math.pi / freq
    low = wavelength > length / s.low_freq_factor
    high = wavelength < length / s.high_freq_factor
    t = (length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smooth = (1 - t) * freq / s.factor + t * freq
    return jnp.where(low, freq / s.factor, jnp.where(high, freq, smooth))


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """The inverse frequency of each rotated pair of a head, fp32 [head_dim / 2]."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    return freq if scaling is None else llama3_scaled(freq, scaling)


def rope(
    x: jax.Array, positions: jax.Array, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotary embedding of ``x`` [batch, length, heads, head_dim] at integer ``positions`` [batch, length]:
    base ``theta``, and Llama 3.1's frequency ``scaling`` (``model.rope_scaling``) when given."""
    half = x.shape[-1] // 2
    angle = positions.astype(jnp.float32)[..., None, None] * frequencies(x.shape[-1], theta, scaling)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class HeadNorm(nnx.Module):
    """RMSNorm over ``head_dim`` of every head of q or k (``model.qk_norm``): one scale [head_dim] for all heads."""

    def __init__(self, config: Config):
        c = config.model
        self.eps = c.norm_eps
        self.scale = ones((c.head_dim,), ("head_dim",), c.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads.

    The kernel is ``model.attention`` (:mod:`jaxscale.models.attention`); the projections
    go through :class:`jaxscale.precision.fp8.Fp8` when ``precision.fp8`` is on (:func:`make_fp8`).
    With ``model.qk_norm`` each head's query and key are RMS-normed (:class:`HeadNorm`) before RoPE.
    """

    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config.model
        self.config = c
        self.documents = config.data.documents  # packed documents: attention masked across them
        self.grads = precision.weight_grads(config)
        self.wide = precision.takes_wide(config)
        std, pdt = c.init_std, c.param_dtype
        if c.fused_projections:  # jaxscale/models/fusion.py
            group = c.heads // c.kv_heads + 2
            self.w_qkv = param(rngs, (c.embed, c.kv_heads, group, c.head_dim), W_QKV, std, pdt)
        else:
            self.wq = param(rngs, (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim"), std, pdt)
            self.wk = param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), std, pdt)
            self.wv = param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wo = param(rngs, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"), std, pdt)
        self.fp8 = make_fp8(config, ("x", "out"), {"wq": "q", "wk": "k", "wv": "v", "wo": "o"})
        if c.qk_norm:
            self.q_norm, self.k_norm = HeadNorm(config), HeadNorm(config)
        self.head_max = config.train.qk_clip is not None  # QK-clip's statistic (jaxscale/training/qk_clip.py)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.forward(x, positions)[0]

    def forward(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The output and, under ``train.qk_clip``, each query head's largest pre-softmax logit [heads] (or None)."""
        q, k, v = self.project(x, positions)
        selective = self.config.remat == "selective" and stage() is None  # keep q, k, v; recompute the core
        out, most = core(self.config, Q_AXES, KV_AXES, self.head_max, selective)(
            q, k, v, positions if self.documents else None)
        return self.output(out), most

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v of ``x`` at ``positions``: the projections, the heads' norms (``model.qk_norm``), RoPE."""
        c = self.config
        weight = functools.partial(fp8_weight, self, dtype=jnp.dtype(c.dtype))
        q, k, v = self.fused_qkv(x) if c.fused_projections else sequence.column_parallel(
            fp8_input(self.fp8, "x", x),
            RESIDUAL,
            [
                ("bse,ehd->bshd", weight("wq"), ("embed", "heads", "head_dim"), Q_AXES),
                ("bse,ehd->bshd", weight("wk"), ("embed", "kv_heads", "head_dim"), KV_AXES),
                ("bse,ehd->bshd", weight("wv"), ("embed", "kv_heads", "head_dim"), KV_AXES),
            ],
            overlap=c.tp_overlap,
            grads=self.grads,
        )
        if c.qk_norm:
            q, k = constrain(self.q_norm(q), Q_AXES), constrain(self.k_norm(k), KV_AXES)
        q = constrain(rope(q, positions, c.rope_theta, c.rope_scaling), Q_AXES)
        k = constrain(rope(k, positions, c.rope_theta, c.rope_scaling), KV_AXES)
        return checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")

    def output(self, out: jax.Array) -> jax.Array:
        """The output projection of the attention's ``out`` [batch, length, heads, head_dim]."""
        c = self.config
        out = checkpoint_name(constrain(out, Q_AXES), "attention")
        y = sequence.row_parallel(
            "bshd,hde->bse", fp8_input(self.fp8, "out", out), Q_AXES, fp8_weight(self, "wo", jnp.dtype(c.dtype)),
            ("heads", "head_dim", "embed"), RESIDUAL, overlap=c.tp_overlap, grads=self.grads,
        )
        return checkpoint_name(y, "attention_out")

    def fused_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v from one GEMM with ``w_qkv`` [embed, kv_heads, q_per_kv + 2, head_dim], split on its group."""
        c = self.config
        w = self.w_qkv[...] if self.wide else self.w_qkv[...].astype(jnp.dtype(c.dtype))
        (qkv,) = sequence.column_parallel(
            x, RESIDUAL, [("bse,ekgd->bskgd", w, W_QKV, QKV_AXES)], overlap=c.tp_overlap, grads=self.grads
        )
        b, s, k, g, d = qkv.shape
        q = constrain(qkv[..., : g - 2, :].reshape(b, s, k * (g - 2), d), Q_AXES)
        return q, constrain(qkv[..., g - 2, :], KV_AXES), constrain(qkv[..., g - 1, :], KV_AXES)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` of hidden size ``width`` (default ``model.mlp``).

    The matmuls go through :class:`jaxscale.precision.fp8.Fp8` when ``precision.fp8`` is on (:func:`make_fp8`).
    """

    def __init__(self, config: Config, rngs: nnx.Rngs, width: int | None = None):
        c = config.model
        f = width or c.mlp
        self.dtype = jnp.dtype(c.dtype)
        self.overlap = c.tp_overlap
        self.grads = precision.weight_grads(config)
        self.wide = precision.takes_wide(config)
        self.fused = c.fused_projections  # jaxscale/models/fusion.py
        if self.fused:
            self.w_gate_up = param(rngs, (c.embed, 2, f), W_GATE_UP, c.init_std, c.param_dtype)
        else:
            self.w_gate = param(rngs, (c.embed, f), ("embed", "mlp"), c.init_std, c.param_dtype)
            self.w_up = param(rngs, (c.embed, f), ("embed", "mlp"), c.init_std, c.param_dtype)
        self.w_down = param(rngs, (f, c.embed), ("mlp", "embed"), c.init_std, c.param_dtype)
        self.fp8 = make_fp8(config, ("x", "hidden"), {"w_gate": "gate", "w_up": "up", "w_down": "down"})

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = functools.partial(fp8_weight, self, dtype=self.dtype)
        if self.fused:  # one GEMM, split on its gate_up dimension
            w = self.w_gate_up[...] if self.wide else self.w_gate_up[...].astype(self.dtype)
            (both,) = sequence.column_parallel(
                x, RESIDUAL, [("bse,egf->bsgf", w, W_GATE_UP, GATE_UP_AXES)], overlap=self.overlap, grads=self.grads
            )
            gate, up = constrain(both[..., 0, :], MLP_AXES), constrain(both[..., 1, :], MLP_AXES)
        else:
            gate, up = sequence.column_parallel(
                fp8_input(self.fp8, "x", x),
                RESIDUAL,
                [
                    ("bse,ef->bsf", weight("w_gate"), ("embed", "mlp"), MLP_AXES),
                    ("bse,ef->bsf", weight("w_up"), ("embed", "mlp"), MLP_AXES),
                ],
                overlap=self.overlap,
                grads=self.grads,
            )
        hidden = checkpoint_name(constrain(swiglu(gate, up), MLP_AXES), "mlp_hidden")
        y = sequence.row_parallel(
            "bsf,fe->bse", fp8_input(self.fp8, "hidden", hidden), MLP_AXES, weight("w_down"), ("mlp", "embed"),
            RESIDUAL, overlap=self.overlap, grads=self.grads,
        )
        return checkpoint_name(y, "mlp_out")


class Block(nnx.Module):
    """Pre-norm decoder block: attention and MLP (or mixture of experts), each on a residual branch."""

    def __init__(self, config: Config, rngs: nnx.Rngs, moe_layer: bool = False):
        self.attn_norm = RMSNorm(config, rngs)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config, rngs)
        self.moe_layer = moe_layer
        if moe_layer:
            width = config.model.moe.shared_experts * moe.expert_width(config.model)
            shared = MLP(config, rngs, width) if width else None
            self.mlp = moe.MoE(config, rngs, shared)
        else:
            self.mlp = MLP(config, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The block's output and its MoE metrics (none for a dense block; ``train.qk_clip``: ``qk_logits``)."""
        out, most = self.attn.forward(self.attn_norm(x), positions)
        x = constrain(x + out, RESIDUAL)
        y, aux = self.mlp(self.mlp_norm(x)) if self.moe_layer else (self.mlp(self.mlp_norm(x)), {})
        return constrain(x + y, RESIDUAL), aux if most is None else {**aux, QK_LOGITS: most}


class Group(nnx.Module):
    """``model.moe.every_n_layers`` blocks, the last with a mixture of experts: the unit the layer scan repeats."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        n = config.model.moe.every_n_layers
        self.blocks = nnx.List([Block(config, rngs, i == n - 1) for i in range(n)])

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        most = []  # every block's qk_logits (train.qk_clip), stacked [blocks, heads]; the last block's MoE metrics
        for block in self.blocks:
            x, aux = block(x, positions)
            most.append(aux.pop(QK_LOGITS, None))
        return x, aux if most[0] is None else {**aux, QK_LOGITS: jnp.stack(most)}


class Llama(nnx.Module):
    """Token ids [batch, length] and positions [batch, length] -> logits [batch, length, vocab].

    The richer form of the model contract (:class:`jaxscale.models.contract.Staged`): the trainer,
    the loss and the pipeline reach it through that contract only.

    Built from the whole experiment config (every submodule takes it too): ``model`` shapes it, ``precision`` turns on
    fp8 projections (:mod:`jaxscale.precision.fp8`); its projections are :mod:`jaxscale.parallel.sequence`'s.
    """

    explicit_tp = True

    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config.model
        self.config = c
        self.grads = precision.weight_grads(config)
        self.embedding = param(rngs, (c.vocab_size, c.embed), ("vocab", "embed"), c.init_std, c.param_dtype)

        steps = c.layers // stage_layers.unit(c)  # the canonical stack: the trainer places it for a pipeline

        @nnx.split_rngs(splits=steps)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block | Group:
            return Group(config, rngs) if c.moe else Block(config, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(config, rngs)
        if not c.tie_embeddings:
            self.lm_head = param(rngs, (c.embed, c.vocab_size), ("embed", "vocab"), c.init_std, c.param_dtype)
        self.head_fp8 = Fp8(config.precision, ("x",), {"head": "logits"}) if config.precision.fp8_head else None
        self.fp8_plain = None if config.precision.fp8 == "off" else stage_layers.plain_units(config)  # fp8.scan_stack's
        self.host_params = config.precision.offload_params  # each layer fetched from host memory in the scan

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.forward(tokens, positions)[0]

    def forward(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits and the MoE metrics (:func:`jaxscale.models.moe.over_layers`; none when dense)."""
        x, aux = self.hidden(tokens, positions)
        return self.logits(x), aux

    def embed(self, tokens: jax.Array) -> jax.Array:
        """The residual stream's input: the embedding rows of ``tokens`` in the compute dtype."""
        return lookup(self.embedding[...], tokens, jnp.dtype(self.config.dtype), self.grads)

    def logits(self, x: jax.Array) -> jax.Array:
        """The output head on the final-normed hidden states ``x`` (``RESIDUAL`` axes): logits [b, s, vocab]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.tie_embeddings:
            head = ("bse,ve->bsv", self.embedding[...].astype(dt), ("vocab", "embed"), LOGITS)
        else:
            head = ("bse,ev->bsv", self.lm_head[...].astype(dt), ("embed", "vocab"), LOGITS)
        if self.head_fp8 is not None:  # precision.fp8_head
            x, head = self.head_fp8.input("x", x), (head[0], self.head_fp8.weight("head", head[1]), *head[2:])
        (logits,) = sequence.column_parallel(x, RESIDUAL, [head], overlap=c.tp_overlap, grads=self.grads)
        return logits

    def aux_loss(self, metrics: dict[str, jax.Array]) -> jax.Array | float:
        """The weighted MoE auxiliary losses of the metrics :meth:`hidden` returns (0 for a dense model)."""
        return 0.0 if self.config.moe is None else moe.aux_objective(metrics, self.config)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (:func:`jaxscale.config.flops.flops_per_token`)."""
        return flops.flops_per_token(self.config, seq_len)

    def head_weight(self) -> jax.Array:
        """The output projection [embed, vocab] in the compute dtype (the embedding transposed when tied)."""
        dt = jnp.dtype(self.config.dtype)
        return self.embedding[...].astype(dt).T if self.config.tie_embeddings else self.lm_head[...].astype(dt)

    def hidden(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The final-normed hidden states [batch, length, embed] (``RESIDUAL`` axes) and the MoE metrics."""
        c = self.config
        x = self.embed(tokens)

        def body(x: jax.Array, block: Block | Group, copies: fp8.Copies) -> tuple[jax.Array, dict[str, jax.Array]]:
            block = offload.layer_to_device(block) if self.host_params else block  # precision.offload_params
            with fp8.using(block, copies) if self.fp8_plain is not None else contextlib.nullcontext():
                return block(x, positions)

        policy = offload.fetching(remat_policy(c)) if self.host_params else remat_policy(c)
        if policy is not None:
            body = nnx.remat(body, policy=policy, prevent_cse=False)
        scan = nnx.scan(
            body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"}
        )
        # fp8: its weights made once (fp8.prepare) outside the remat; precision.nvfp4.bf16_last's units plain.
        off = self.fp8_plain is None
        x, aux = scan(x, self.blocks, {}) if off else fp8.scan_stack(scan, x, self.blocks, self.fp8_plain)
        return self.final_norm(x), self.stack_metrics(aux)

    def stack_metrics(self, stacked: dict[str, jax.Array]) -> dict[str, Any]:
        """The blocks' metrics [layers, ...] as :meth:`hidden` returns them (:func:`jaxscale.models.moe.over_layers`;
        none when dense; ``train.qk_clip``: ``qk_logits`` [layers, heads])."""
        most = stacked.pop(QK_LOGITS, None)
        out = moe.over_layers(stacked) if self.config.moe else {}
        return out if most is None else {**out, QK_LOGITS: most.reshape(-1, most.shape[-1])}
