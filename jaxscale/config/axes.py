"""The logical axes of the model's arrays (no jax: the analytic model reads them too).

Every array whose layout matters carries the logical names of its dimensions;
the rules table (:mod:`jaxscale.layout.rules`) maps them to mesh axes. Activations:
``batch``; ``length`` (the sequence inside attention and the MLP);
``norm_length`` (the sequence of the residual stream and the norms: Megatron
sequence parallelism shards it over ``tensor``); ``act_embed`` (the hidden size
of the residual stream, kept apart from the parameters' ``embed`` so FSDP can
shard one and not the other); ``heads``, ``kv_heads``, ``head_dim``, ``mlp``,
``vocab``; for the experts ``expert`` and ``expert_batch`` (the batch of
dispatched buffers). Parameters: ``vocab, embed, heads, kv_heads, head_dim,
mlp, expert, expert_mlp, layers``; multi-head latent attention's latent widths ``q_lora`` and
``kv_lora`` (the latents' activations, the down projections' outputs and the latent norms) and
``q_lora_up``, ``kv_lora_up`` (the up projections' latent input: parameters only, so FSDP can
shard them where the down projections' ``embed`` already holds its axes). ``ulysses`` names no array's
dimension: it names the trailing mesh axes of ``length`` over which attention trades the sequence for the heads
by all-to-all (Ulysses; the rest of ``length``'s axes form the ring: :mod:`jaxscale.parallel.ulysses`).
"""

from __future__ import annotations

# Every logical axis name a rules table may map (a key outside these is a typo, refused: jaxscale/layout/rules.py).
LOGICAL_AXES = (
    "batch", "length", "norm_length", "act_embed", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
    "expert", "expert_mlp", "expert_batch", "layers", "qkv", "gate_up", "q_lora", "kv_lora", "q_lora_up",
    "kv_lora_up", "ulysses",
)
RESIDUAL = ("batch", "norm_length", "act_embed")  # the residual stream, between the blocks
HIDDEN = ("batch", "length", "act_embed")  # the final hidden states, whole sequences (the chunked loss)
Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
MLP_AXES = ("batch", "length", "mlp")
LOGITS = ("batch", "length", "vocab")
# Fused projections (model.fused_projections, jaxscale/models/fusion.py): ``qkv`` and ``gate_up`` index the
# fused parts; MLA's up projections' latent inputs came after rules files were written: a rules table need not
# map these (unmapped: whole on every device).
WHOLE_AXES = ("qkv", "gate_up", "q_lora_up", "kv_lora_up", "ulysses")
W_QKV = ("embed", "kv_heads", "qkv", "head_dim")
QKV_AXES = ("batch", "length", "kv_heads", "qkv", "head_dim")
W_GATE_UP = ("embed", "gate_up", "mlp")
GATE_UP_AXES = ("batch", "length", "gate_up", "mlp")

ROUTING = ("batch", "norm_length", None)  # each token's top-k choices
BUFFER = ("expert_batch", "expert", None, "act_embed")  # dispatched tokens [sequences, experts, slots, embed]
BUFFER_HIDDEN = ("expert_batch", "expert", None, "expert_mlp")
W_IN = ("expert", "embed", "expert_mlp")  # the experts' gate and up projections
W_OUT = ("expert", "expert_mlp", "embed")  # the experts' down projection
