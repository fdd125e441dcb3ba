"""Model FLOPs and parameter counts of a model config, and the peak FLOP/s of a device (jax-free).

Model FLOPs per token (docs/formulas.md): ``6 * Ψ_matmul + 6 * L * s * heads * head_dim``,
the second term being attention scores and values, forward and backward,
halved for the causal mask. Ψ_matmul counts the weights used in matmuls (the
embedding table only when tied to the output head); for a mixture of experts,
only the active ones: the router, ``top_k`` experts and the shared experts of
each MoE layer. MFU divides achieved model FLOP/s by the device's peak;
recomputation is not counted. A DeepSeek-V3-style model (``model.deepseek``) counts multi-head latent
attention's projections, its dense and MoE layers and its multi-token prediction depths (each one MoE
block, the projection joining its inputs, the shared head), its attention term ``(qk + v) / 2`` wide per
head. A model without a formula (docs/models.md) is counted from its compiled step instead
(:func:`compiled_flops`).
"""

from __future__ import annotations

from typing import Any

from jaxscale.config.read import ModelConfig

# Peak dense bf16 FLOP/s per device, matched as a substring of ``device_kind``.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
    "cpu": 1e11,  # nominal: a simulated CPU device has no published peak; override with train.peak_flops
}


def _mla(c: ModelConfig) -> tuple[int, int]:
    """Multi-head latent attention's weights of one layer: (matmul weights, norm scales)."""
    d, e, h = c.deepseek, c.embed, c.heads
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    q = e * d.q_lora_rank + d.q_lora_rank * h * qk if d.q_lora_rank else e * h * qk
    kv = e * (d.kv_lora_rank + d.qk_rope_head_dim) + d.kv_lora_rank * h * (d.qk_nope_head_dim + d.v_head_dim)
    return q + kv + h * d.v_head_dim * e, (d.q_lora_rank or 0) + d.kv_lora_rank


def _deepseek_count(c: ModelConfig) -> dict[str, int]:
    """:func:`param_count` of a DeepSeek-V3-style model (``model.deepseek``); ``mtp`` counts its prediction depths."""
    d, moe, e = c.deepseek, c.moe, c.embed
    f = moe.mlp or c.mlp
    attn, latent_norms = _mla(c)
    block = attn + latent_norms + 2 * e  # attention, its latents' norms, the two block norms
    routed = 3 * e * f * moe.experts + e * moe.experts
    shared = 3 * e * f * moe.shared_experts
    moe_block = block + routed + shared
    mtp = d.mtp_depth * (moe_block + 2 * e * e + 3 * e)  # the block, the projection, three norms
    head = 0 if c.tie_embeddings else e * c.vocab_size
    total = d.dense_layers * (block + 3 * e * c.mlp) + (c.layers - d.dense_layers) * moe_block
    total += c.vocab_size * e + head + e + mtp
    active = attn + e * moe.experts + 3 * e * f * (moe.top_k + moe.shared_experts)
    matmul = c.layers * attn + d.dense_layers * 3 * e * c.mlp + (c.layers - d.dense_layers) * (active - attn)
    matmul += d.mtp_depth * (active + 2 * e * e + e * c.vocab_size) + e * c.vocab_size
    return {"total": total, "matmul": matmul, "embedding": c.vocab_size * e, "mtp": mtp}


def param_count(config: ModelConfig) -> dict[str, int]:
    """Parameters by role, from the shapes the model creates; ``matmul`` counts only active experts (and, with
    multi-token prediction, the head once per depth more)."""
    c = config
    if c.deepseek is not None:
        return _deepseek_count(c)
    attn = c.embed * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
    mlp = 3 * c.embed * c.mlp
    norms = 2 * c.embed + (2 * c.head_dim if c.qk_norm else 0)
    mlp_total = mlp_active = c.layers * mlp
    if c.moe is not None:
        f = c.moe.mlp or c.mlp
        moe_layers = c.layers // c.moe.every_n_layers
        expert, shared, router = 3 * c.embed * f, 3 * c.embed * f * c.moe.shared_experts, c.embed * c.moe.experts
        mlp_total += moe_layers * (c.moe.experts * expert + shared + router - mlp)
        mlp_active += moe_layers * (c.moe.top_k * expert + shared + router - mlp)
    blocks = c.layers * (attn + norms) + mlp_total
    embedding = c.vocab_size * c.embed
    head = 0 if c.tie_embeddings else c.embed * c.vocab_size
    total = blocks + embedding + head + c.embed
    matmul = c.layers * attn + mlp_active + c.embed * c.vocab_size
    return {"total": total, "matmul": matmul, "embedding": embedding}


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + causal attention (scores and values, every layer run)."""
    c, d = config, config.deepseek
    if d is None:
        return 6.0 * param_count(c)["matmul"] + 6.0 * c.layers * seq_len * c.heads * c.head_dim
    width = (d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim) / 2
    return 6.0 * param_count(c)["matmul"] + 6.0 * (c.layers + d.mtp_depth) * seq_len * c.heads * width


def compiled_flops(compiled: Any) -> float:
    """FLOPs of one device's program of a compiled jax function, as XLA counts them (``cost_analysis``):
    every operation it runs, recomputation and the optimizer's update included."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def peak_flops(device: Any, override: float | None = None) -> float:
    """Peak FLOP/s of one device from the table (or the override)."""
    if override:
        return override
    kind = f"{device.device_kind} {device.platform}"
    for name, value in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return value
    return PEAK_FLOPS["cpu"]
