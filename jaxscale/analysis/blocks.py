"""The shapes of a decoder layer that the analytic model reads: Llama-style, or DeepSeek-V3-style (MLA).

The memory, communication and time of :mod:`jaxscale.analysis` are written per token of one layer; what differs
between the built-in models is here, read off the model config (no jax):

* **attention** (:class:`Attention`): a Llama layer's queries are ``heads x head_dim`` wide, its keys and values
  ``kv_heads x head_dim`` (grouped: logical ``kv_heads``); multi-head latent attention's
  (:mod:`jaxscale.models.deepseek`) queries and keys are ``heads x (nope + rope)`` wide, its values and the
  attention output ``heads x v_head_dim``, every head its own keys (logical ``heads``), and the layer computes two
  latents first (``q_lora``, ``kv_lora`` + the rotated key); the attention output is ``heads`` x the values' width;
* **projections** (:func:`projections`): the attention's weight matmuls, as (count, N, its logical name, K, its
  logical name), so a layout's ways divide each as it shards it;
* **layers**: the MLP hidden per token averaged over the layers (:func:`mlp_per_token`: dense layers and MoE
  layers of ``top_k`` routed experts at the capacity factor plus the shared ones) and the layers a step runs
  (:func:`layers_run`: ``model.layers`` and the multi-token prediction depths, each one MoE block).
"""

from __future__ import annotations

import dataclasses

from jaxscale.config.axes import KV_AXES, Q_AXES
from jaxscale.config.read import ModelConfig

Projection = tuple[float, int, str | None, int, str | None]  # (count, N, N's logical name, K, K's logical name)


@dataclasses.dataclass(frozen=True)
class Attention:
    """One layer's attention, per token: widths in elements over all heads."""

    q: int  # queries
    k: int  # keys
    v: int  # values
    out: int  # the attention output, before its projection (the queries' heads x the values' width)
    qk_dim: int  # a head's query and key width
    v_dim: int  # a head's value width
    kv_name: str  # the logical name that splits keys and values: kv_heads (grouped), heads (MLA)
    latents: int  # MLA's latents: q_lora + kv_lora (each normed); 0 without
    latent_names: tuple[str, ...]  # their logical names

    @property
    def kv_axes(self) -> tuple[str, ...]:
        return KV_AXES if self.kv_name == "kv_heads" else Q_AXES

    @property
    def score_dim(self) -> float:
        """A head's width for the scores' and values' FLOPs: (qk + v) / 2 (``head_dim`` for Llama)."""
        return (self.qk_dim + self.v_dim) / 2


def attention(m: ModelConfig) -> Attention:
    """The layer's attention widths (see the module docstring)."""
    d = m.deepseek
    if d is None:
        ad, gd = m.heads * m.head_dim, m.kv_heads * m.head_dim
        return Attention(ad, gd, gd, ad, m.head_dim, m.head_dim, "kv_heads", 0, ())
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    latents, names = d.kv_lora_rank, ("kv_lora",)
    if d.q_lora_rank:
        latents, names = latents + d.q_lora_rank, ("q_lora", "kv_lora")
    v = m.heads * d.v_head_dim
    return Attention(m.heads * qk, m.heads * qk, v, v, qk, d.v_head_dim, "heads", latents, names)


def projections(m: ModelConfig) -> list[Projection]:
    """The attention's weight matmuls of one layer: (count, N, N's logical name, K, K's logical name)."""
    h, a, d = m.embed, attention(m), m.deepseek
    if d is None:
        return [(1, a.q, "heads", h, None), (2, a.k, "kv_heads", h, None), (1, h, None, a.out, "heads")]
    nope_v = m.heads * (d.qk_nope_head_dim + d.v_head_dim)
    queries: list[Projection] = [(1, a.q, "heads", h, None)]
    if d.q_lora_rank:
        queries = [(1, d.q_lora_rank, "q_lora", h, None), (1, a.q, "heads", d.q_lora_rank, "q_lora")]
    return [*queries, (1, d.kv_lora_rank + d.qk_rope_head_dim, "kv_lora", h, None),
            (1, nope_v, "heads", d.kv_lora_rank, "kv_lora"), (1, h, None, a.out, "heads")]


def moe_layers(m: ModelConfig) -> int:
    """Layers with routed experts among ``model.layers``."""
    if m.moe is None:
        return 0
    return m.layers - m.deepseek.dense_layers if m.deepseek else m.layers // m.moe.every_n_layers


def layers_run(m: ModelConfig) -> int:
    """Layers a step runs: ``model.layers`` and each multi-token prediction depth's MoE block."""
    return m.layers + (m.deepseek.mtp_depth if m.deepseek else 0)


def routed_per_token(m: ModelConfig) -> float:
    """A MoE layer's routed hidden elements per token: ``top_k`` experts' at the capacity factor (0 dense)."""
    moe = m.moe
    if moe is None:
        return 0.0
    return moe.top_k * (moe.mlp or m.mlp) * (moe.capacity_factor if moe.dispatch == "capacity" else 1.0)


def mlp_per_token(m: ModelConfig) -> int:
    """SwiGLU hidden elements per token a layer computes, averaged over ``model.layers``: dense layers ``mlp``,
    MoE layers the routed experts' (:func:`routed_per_token`) and the shared ones'."""
    moe = m.moe
    if moe is None:
        return m.mlp
    share = moe_layers(m) / m.layers
    per_moe = routed_per_token(m) + moe.shared_experts * (moe.mlp or m.mlp)
    return round(share * per_moe + (1 - share) * m.mlp)


def dense_per_token(m: ModelConfig) -> int:
    """The part of :func:`mlp_per_token` that plain matmuls compute: the dense layers' and the shared experts'
    (the routed experts run batched or grouped matmuls, which ``save_dots`` does not keep)."""
    if m.moe is None:
        return m.mlp
    share = moe_layers(m) / m.layers
    return round(share * m.moe.shared_experts * (m.moe.mlp or m.mlp) + (1 - share) * m.mlp)
