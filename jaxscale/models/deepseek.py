"""A DeepSeek-V3-style decoder, written as an ordinary user of the model contract (docs/models.md).

Built from :mod:`jaxscale.nn` alone (attention kernel, rotary embeddings, RMSNorm, SwiGLU, the MoE layer,
layouts by logical name), in the contract's richer form; ``model.deepseek`` selects it as the built-in model.

* **Multi-head latent attention** (:class:`MLA`, the cache-free training form): the queries come from a
  ``q_lora_rank`` latent of the input, RMS-normed (``wq_a``, ``q_norm``, ``wq_b``; with ``q_lora_rank: null`` one
  full-rank ``wq``); keys and values from one ``kv_lora_rank`` latent, RMS-normed, expanded per head into a
  ``qk_nope_head_dim`` key part and a ``v_head_dim`` value (``wkv_a``, ``kv_norm``, ``wkv_b``). The rotary part
  is decoupled: ``qk_rope_head_dim`` more query columns per head, and one rotated key of that width computed
  from the input beside the latent (``wkv_a``'s last columns) and shared by every head. Scores are scaled by
  ``1/sqrt(nope + rope)``; the values are narrower than the queries, which every kernel takes.
* **Blocks**: the first ``dense_layers`` with a dense SwiGLU of ``model.mlp`` (``dense``, the contract's ``prefix``:
  under a pipeline they run on the first stage after the embedding, their stack's leading axis unnamed, never
  split), the rest with ``model.moe``'s routed experts (group-limited with ``moe.groups``, sigmoid router in
  DeepSeek-V3), their output scaled by ``routed_scale``, plus a dense SwiGLU of ``shared_experts x moe.mlp``
  (``blocks``, the pipelined stack): two stacks, each scanned. With ``data.documents`` attention stays within
  each packed document.
* **Multi-token prediction** (:class:`MTP`, ``mtp_depth`` modules in sequence; the contract's ``ahead``: under
  a pipeline it runs on the last stage with the head): depth k joins the previous depth's hidden state of token
  i (the stack's output before the final norm for k = 1), RMS-normed, with the embedding of token i+k,
  RMS-normed, by a projection of their concatenation (embedding first, as DeepSeek-V3's checkpoints), runs one
  MoE block, RMS-norms its output and predicts token i+k+1 with the shared head; embedding and head are the
  model's. The objective adds ``mtp_loss_weight`` times the mean of the depths' cross-entropies, each over its
  trained targets: those of the loss mask (the target of token i+k+1 is the batch's at i+k, with its mask),
  within the sequence, and with packed documents (``data.documents``) within the document of token i. The MTP
  blocks route with the balance bias (``model.moe.balance``) as the main ones; their per-layer loads follow the
  main blocks' (``moe_layers``, which the bias update reads), their load-balance and z losses join the
  objective with the MoE weights.

Not here: YaRN rope scaling (DeepSeek-V3's long-context extension; jaxscale has no such option). Refused in one
line when the trainer is built (a row of :mod:`jaxscale.config.refusals`, on the rules' layout): MTP with documents
under ring attention over a ring of 2 or more (the zig-zag row's logical order is read from positions, which
restart at each document); Ulysses alone keeps the rows in order, and runs it.

Recomputation (``model.remat``) as the built-in models': the layer policies of :func:`jaxscale.nn.remat_policy`,
``selective`` recomputing the attention core, ``save_named`` keeping the named ``query``, ``key``, ``value``,
``attention``, ``attention_out``, ``mlp_hidden`` (and the MoE layer's ``mlp_out``).

Logical axes: the latents are ``q_lora`` and ``kv_lora`` (the activations, the down projections' outputs and the
latent norms); the up projections' (``wq_b``, ``wkv_b``) latent input is ``q_lora_up`` and ``kv_lora_up``, a
parameter's own name, so that FSDP shards those weights there (the down projections' ``embed`` holds its mesh
axes already); a head's widths are ``head_dim``; MLA has no grouped keys, so keys and values are laid out as
queries (``Q_AXES``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale import nn
from jaxscale.config import flops, refusals
from jaxscale.config.read import Config, ModelConfig
from jaxscale.layout import offload

Q_LATENT = ("batch", "length", "q_lora")
KV_LATENT = ("batch", "length", "kv_lora")
Metrics = dict[str, Any]


def param(rngs: nnx.Rngs, c: ModelConfig, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter drawn from a normal of deviation ``model.init_std``, named ``axes``."""
    value = c.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(c.param_dtype), out_sharding=axes)


def norm(c: ModelConfig, features: int, axis: str) -> nn.RMSNorm:
    return nn.RMSNorm(features, eps=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, axis=axis)


class MLA(nnx.Module):
    """Multi-head latent attention: [batch, length, embed] -> the same."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = self.config = config.model
        d = c.deepseek
        refusals.check(refusals.Context(config), about="model.")  # the config's rows naming the model
        self.grads = nn.weight_grads(config)
        self.documents = config.data.documents  # packed documents: attention masked across them
        h, qk = c.heads, d.qk_nope_head_dim + d.qk_rope_head_dim
        if d.q_lora_rank:
            self.wq_a = param(rngs, c, (c.embed, d.q_lora_rank), ("embed", "q_lora"))
            self.q_norm = norm(c, d.q_lora_rank, "q_lora")
            self.wq_b = param(rngs, c, (d.q_lora_rank, h, qk), ("q_lora_up", "heads", "head_dim"))
        else:
            self.wq = param(rngs, c, (c.embed, h, qk), ("embed", "heads", "head_dim"))
        self.wkv_a = param(rngs, c, (c.embed, d.kv_lora_rank + d.qk_rope_head_dim), ("embed", "kv_lora"))
        self.kv_norm = norm(c, d.kv_lora_rank, "kv_lora")
        self.wkv_b = param(rngs, c, (d.kv_lora_rank, h, d.qk_nope_head_dim + d.v_head_dim),
                           ("kv_lora_up", "heads", "head_dim"))
        self.wo = param(rngs, c, (h, d.v_head_dim, c.embed), ("heads", "head_dim", "embed"))
        self.head_max = config.train.qk_clip is not None  # QK-clip's statistic (jaxscale/training/qk_clip.py)

    def _w(self, p: nnx.Param) -> jax.Array:
        return p[...].astype(self.config.dtype)

    def queries(self, x: jax.Array) -> jax.Array:
        """[batch, length, heads, nope + rope], before the rotation."""
        if not self.config.deepseek.q_lora_rank:
            return nn.einsum("bse,ehd->bshd", x, self._w(self.wq), self.grads)
        latent = nn.constrain(nn.einsum("bse,er->bsr", x, self._w(self.wq_a), self.grads), Q_LATENT)
        return nn.einsum("bsr,rhd->bshd", self.q_norm(latent), self._w(self.wq_b), self.grads)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.forward(x, positions)[0]

    def forward(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The output and, under ``train.qk_clip``, each head's largest pre-softmax logit [heads] (or None)."""
        c, d = self.config, self.config.deepseek
        nope, rank = d.qk_nope_head_dim, d.kv_lora_rank
        rope = functools.partial(nn.rope, positions=positions, theta=c.rope_theta, scaling=c.rope_scaling)
        q = self.queries(x)
        q = nn.constrain(jnp.concatenate([q[..., :nope], rope(q[..., nope:])], -1), nn.Q_AXES)
        kv = nn.constrain(nn.einsum("bse,er->bsr", x, self._w(self.wkv_a), self.grads), KV_LATENT)
        k_rope = rope(kv[..., None, rank:])  # [batch, length, 1, rope]: one rotated key for every head
        kv = nn.einsum("bsr,rhd->bshd", self.kv_norm(kv[..., :rank]), self._w(self.wkv_b), self.grads)
        k_nope, v = kv[..., :nope], nn.constrain(kv[..., nope:], nn.Q_AXES)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], -1)
        q, k, v = (checkpoint_name(a, name) for a, name in ((q, "query"), (nn.constrain(k, nn.Q_AXES), "key"),
                                                              (v, "value")))
        documents = positions if self.documents else None
        core = functools.partial(nn.attention, config=c, kv_axes=nn.Q_AXES, documents=documents,
                                 head_max=self.head_max)
        if c.remat == "selective":  # keep q, k, v; recompute the attention core in the backward
            core = jax.checkpoint(core, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
        out, most = core(q, k, v) if self.head_max else (core(q, k, v), None)
        out = checkpoint_name(nn.constrain(out, nn.Q_AXES), "attention")
        y = nn.einsum("bshd,hde->bse", out, self._w(self.wo), self.grads)
        return checkpoint_name(nn.constrain(y, nn.RESIDUAL), "attention_out"), most


class MLP(nnx.Module):
    """SwiGLU of hidden size ``width``: a dense block's MLP, or the shared experts."""

    def __init__(self, config: Config, rngs: nnx.Rngs, width: int):
        c = self.config = config.model
        self.grads = nn.weight_grads(config)
        self.w_gate = param(rngs, c, (c.embed, width), ("embed", "mlp"))
        self.w_up = param(rngs, c, (c.embed, width), ("embed", "mlp"))
        self.w_down = param(rngs, c, (width, c.embed), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.config.dtype
        gate, up = (nn.constrain(nn.einsum("bse,ef->bsf", x, w[...].astype(dt), self.grads), nn.MLP_AXES)
                    for w in (self.w_gate, self.w_up))
        hidden = checkpoint_name(nn.swiglu(gate, up), "mlp_hidden")
        return nn.constrain(nn.einsum("bsf,fe->bse", hidden, self.w_down[...].astype(dt), self.grads), nn.RESIDUAL)


class Block(nnx.Module):
    """Pre-norm block: MLA, then a dense SwiGLU or (``moe``) the routed experts scaled plus the shared ones."""

    def __init__(self, config: Config, rngs: nnx.Rngs, moe: bool):
        c = config.model
        self.attn_norm, self.mlp_norm = norm(c, c.embed, "embed"), norm(c, c.embed, "embed")
        self.attn = MLA(config, rngs)
        self.routed = nn.MoE(config, rngs) if moe else None
        width = c.moe.shared_experts * (c.moe.mlp or c.mlp) if moe else c.mlp
        self.mlp = MLP(config, rngs, width) if width else None
        self.routed_scale = c.deepseek.routed_scale

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
        """The block's output and its MoE metrics (none for a dense block; ``train.qk_clip``: ``QK_LOGITS``)."""
        out, most = self.attn.forward(self.attn_norm(x), positions)
        x = nn.constrain(x + out, nn.RESIDUAL)
        h = self.mlp_norm(x)
        y, metrics = jnp.zeros_like(x), {} if most is None else {nn.QK_LOGITS: most}
        if self.routed is not None:
            routed, routing = self.routed(h)
            y, metrics = self.routed_scale * routed, {**metrics, **routing}
        if self.mlp is not None:
            y = y + self.mlp(h)
        return nn.constrain(x + y, nn.RESIDUAL), metrics


class MTP(nnx.Module):
    """One multi-token prediction depth: (hidden state of token i, embedding of token i+k) -> its hidden state
    and the normed one the head reads."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config.model
        self.embed_norm, self.hidden_norm, self.out_norm = (norm(c, c.embed, "embed") for _ in range(3))
        self.proj = param(rngs, c, (2, c.embed, c.embed), (None, "embed", None))  # [embedding; hidden] -> embed
        self.block = Block(config, rngs, True)
        self.dtype = c.dtype

    def __call__(self, h: jax.Array, emb: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, Metrics]:
        w = self.proj[...].astype(self.dtype)
        x = (jnp.einsum("bse,ef->bsf", self.embed_norm(emb), w[0])
             + jnp.einsum("bse,ef->bsf", self.hidden_norm(h), w[1]))
        x, metrics = self.block(nn.constrain(x, nn.RESIDUAL), positions)
        return x, self.out_norm(x), metrics


def stack(config: Config, rngs: nnx.Rngs, n: int, moe: bool, axis: str | None) -> Block:
    """``n`` blocks stacked on a leading axis named ``axis``."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs, moe)

    return make(rngs)


class DeepSeek(nnx.Module):
    """Token ids and positions [batch, length] -> logits [batch, length, vocab]; the richer form of the contract
    with its optional parts: the dense blocks are the ``prefix``, MTP is ``ahead``."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = self.config = config.model
        d = c.deepseek
        self.grads = nn.weight_grads(config)
        self.documents = config.data.documents
        self.host_params = config.precision.offload_params  # each block fetched from host memory in the scan
        self.embedding = param(rngs, c, (c.vocab_size, c.embed), ("vocab", "embed"))
        # The dense stack's leading axis is never split: under a pipeline it runs with the embedding.
        self.dense = stack(config, rngs, d.dense_layers, False, None) if d.dense_layers else None
        self.blocks = stack(config, rngs, c.layers - d.dense_layers, True, "layers")
        self.final_norm = norm(c, c.embed, "embed")
        self.mtp = nnx.List([MTP(config, rngs) for _ in range(d.mtp_depth)])
        if not c.tie_embeddings:
            self.lm_head = param(rngs, c, (c.embed, c.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.logits(self.hidden(tokens, positions)[0])

    def embed(self, tokens: jax.Array) -> jax.Array:
        """The embedding rows of ``tokens`` in the compute dtype (a lookup, nothing else: the pipeline's contract)."""
        return nn.constrain(jnp.take(self.embedding[...], tokens, axis=0).astype(self.config.dtype), nn.RESIDUAL)

    def head_weight(self) -> jax.Array:
        """The output projection [embed, vocab] in the compute dtype (the embedding transposed when tied)."""
        w = self.embedding[...].T if self.config.tie_embeddings else self.lm_head[...]
        return w.astype(self.config.dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        return nn.constrain(nn.einsum("bse,ev->bsv", x, self.head_weight(), self.grads), nn.LOGITS)

    def run(self, blocks: Block, x: jax.Array, positions: jax.Array, axis: str | None) -> tuple[jax.Array, Metrics]:
        """A stack of blocks (leading axis ``axis``) scanned over ``x``, each recomputed by ``model.remat``'s policy."""

        def body(x: jax.Array, block: Block) -> tuple[jax.Array, Metrics]:
            return (offload.layer_to_device(block) if self.host_params else block)(x, positions)

        policy = nn.remat_policy(self.config)
        policy = offload.fetching(policy) if self.host_params else policy  # precision.offload_params
        if policy is not None:
            body = nnx.remat(body, policy=policy, prevent_cse=False)
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                        transform_metadata={nnx.PARTITION_NAME: axis})
        return scan(x, blocks)

    def prefix(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """The dense blocks on the embedded tokens ``x`` (none: ``x``)."""
        return x if self.dense is None else self.run(self.dense, x, positions, None)[0]

    def trunk(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
        """The MoE stack's output (before the final norm) and its metrics (:func:`jaxscale.nn.moe_metrics`; under
        ``train.qk_clip`` ``QK_LOGITS`` [layers, heads] of the dense blocks then the MoE ones)."""
        x, dense = self.embed(tokens), {}
        if self.dense is not None:  # the prefix, its QK-clip statistic kept
            x, dense = self.run(self.dense, x, positions, None)
        x, stats = self.run(self.blocks, x, positions, "layers")
        metrics = self.stack_metrics(stats)
        if nn.QK_LOGITS in dense:
            metrics[nn.QK_LOGITS] = jnp.concatenate([dense[nn.QK_LOGITS], metrics[nn.QK_LOGITS]])
        return x, metrics

    def stack_metrics(self, stacked: Metrics) -> Metrics:
        """The MoE blocks' metrics [layers, ...] as :meth:`trunk` returns them (:func:`jaxscale.nn.moe_metrics`)."""
        most = stacked.pop(nn.QK_LOGITS, None)
        return nn.moe_metrics(stacked) if most is None else {**nn.moe_metrics(stacked), nn.QK_LOGITS: most}

    def hidden(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Metrics]:
        """The final-normed hidden states and the MoE metrics (MTP is :meth:`ahead`, which needs the targets)."""
        x, metrics = self.trunk(tokens, positions)
        return self.final_norm(x), metrics

    def cross_entropy(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        """The head's mean cross-entropy on final-normed ``x`` (chunked with ``model.loss_chunk``)."""
        chunk = self.config.loss_chunk
        if chunk:
            return nn.chunked_cross_entropy(x, self.head_weight(), targets, chunk)
        return nn.cross_entropy(self.logits(x), targets)

    def ahead(self, y: jax.Array, batch: dict[str, jax.Array]) -> Metrics:
        """The MTP depths on the stack's output ``y``: their mean cross-entropy (``mtp_loss``), their MoE blocks'
        mean load-balance and z losses and per-layer statistics (``moe_layers``, one row per depth).

        In logical order (ring attention's zig-zag rows are read through the positions), depth k predicts at
        token t the token t+k+1, the target at t+k with its loss mask (``targets`` [t+k] < 0: not trained),
        from the embedding of token t+k; with ``data.documents`` nothing is predicted across a document
        boundary (token t+k+1 in another document than t's: a position restarts at 0 between them; at the
        row's end the target's mask tells, as the data path masks a document's first token)."""
        if not len(self.mtp):
            return {}
        tokens, positions, targets = batch["inputs"], batch["positions"], batch["targets"]
        s = tokens.shape[1]
        # The logical index of each place in the row, and the place of each logical index.
        logical = jnp.broadcast_to(jnp.arange(s), tokens.shape) if self.documents else positions
        order = jnp.argsort(logical, axis=1)

        def at(a: jax.Array, k: int) -> jax.Array:
            """``a`` at the token k ahead of each (logically; the last token where none is)."""
            return jnp.take_along_axis(a, jnp.take_along_axis(order, jnp.minimum(logical + k, s - 1), axis=1), axis=1)

        losses, stats = [], []
        for k, module in enumerate(self.mtp, start=1):
            same = (at(positions, k) == positions + k) & ((logical + k + 1 >= s) | (at(positions, k + 1) != 0))
            trained = jnp.where((logical + k < s) & same, at(targets, k), -1)
            y, normed, aux = module(y, self.embed(at(tokens, k)), positions)
            losses.append(self.cross_entropy(normed, trained))
            stats.append(aux)
        metrics = nn.moe_metrics(jax.tree.map(lambda *a: jnp.stack(a), *stats))
        return {"mtp_loss": sum(losses) / len(losses), "mtp_moe_aux_loss": metrics["moe_aux_loss"],
                "mtp_moe_z_loss": metrics["moe_z_loss"], "moe_layers": metrics["moe_layers"]}

    def aux_loss(self, metrics: Metrics) -> jax.Array:
        """The MoE layers' weighted auxiliary losses, plus ``mtp_loss_weight`` times the MTP loss and the MTP
        blocks' MoE losses, where ``metrics`` has them (a pipeline stage's have the MoE ones, its head's the MTP's)."""
        total = nn.moe_objective(metrics, self.config) if "moe_aux_loss" in metrics else 0.0
        if "mtp_loss" in metrics:
            mtp = {"moe_aux_loss": metrics["mtp_moe_aux_loss"], "moe_z_loss": metrics["mtp_moe_z_loss"]}
            total = total + self.config.deepseek.mtp_loss_weight * metrics["mtp_loss"]
            total = total + nn.moe_objective(mtp, self.config)
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (:func:`jaxscale.config.flops.flops_per_token`: the matmul weights a
        token goes through, its top_k routed experts only, and causal attention, the MTP depths included)."""
        return flops.flops_per_token(self.config, seq_len)
