"""What one decoder layer keeps for its backward and what its backward holds while it runs, per token, by remat policy.

Each :class:`Activation` is a width per token with the logical axes and dtype the model gives it, so the
memory model (:mod:`jaxscale.analysis.memory`) divides exactly what TP, SP and CP shard. The names are the
``checkpoint_name``s of models/llama.py and models/deepseek.py (:data:`REMAT_NAMES`). No jax.
"""

from __future__ import annotations

import dataclasses

from jaxscale.analysis.blocks import attention, dense_per_token, mlp_per_token, moe_layers, projections
from jaxscale.config.axes import HIDDEN, MLP_AXES, Q_AXES, RESIDUAL
from jaxscale.config.read import ModelConfig

SCORES = ("batch", "length", "heads")  # attention scores and probabilities (and their statistics)


REMAT_NAMES = {  # checkpoint_name in models/llama.py and deepseek.py -> (width per token, logical axes)
    "query": ("q", Q_AXES),
    "key": ("k", None),  # the keys' axes (grouped or per head: blocks.Attention.kv_axes)
    "value": ("v", None),
    "attention": ("out", Q_AXES),
    "attention_out": ("h", RESIDUAL),
    "mlp_hidden": ("f", MLP_AXES),
    "mlp_out": ("h", RESIDUAL),
}


FLASH_ATTENTION = ("blockwise", "ring", "cudnn")  # no s x s scores kept


TILED_ATTENTION = ("blockwise", "ring")  # ... their score tiles in device memory (cudnn keeps them on chip)


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation kept for the backward: elements per token, logical axes, dtype ("fp32" or "compute")."""

    name: str
    per_token: int
    axes: tuple[str, ...]
    dtype: str = "compute"


def _latents(m: ModelConfig, normed: bool) -> list[Activation]:
    """Multi-head latent attention's latents per token (:func:`jaxscale.analysis.blocks.attention`): as its
    norms' inputs and statistics (``normed`` False) or as normed (the second projections' inputs)."""
    d = m.deepseek
    if d is None:
        return []
    widths = [("q_lora", d.q_lora_rank)] * bool(d.q_lora_rank) + [("kv_lora", d.kv_lora_rank)]
    if normed:
        return [Activation(f"normed {n} latent", w, ("batch", "length", n)) for n, w in widths]
    return [Activation(f"{n} latent", w, ("batch", "length", n)) for n, w in widths] + [
        Activation("latent norm statistics", len(widths), RESIDUAL[:2], "fp32")]


def split_kept(m: ModelConfig) -> list[Activation]:
    """What a split schedule's B keeps of one layer for its W (:mod:`jaxscale.parallel.weight_split`): each distinct
    weight matmul input (the normed input twice, the attention output, the MLP hidden) and each matmul's output
    gradient (the attention projections', gate's and up's, and the two partial sums of the residual's width).
    Routed experts' grouped matmuls take their gradients in B; MLA's latent inputs are not counted."""
    h, att, fe = m.embed, attention(m), dense_per_token(m)
    projected = sum(c * n for c, n, _, _, _ in projections(m))  # the attention projections' outputs, o's too
    return [
        Activation("normed inputs", 2 * h, HIDDEN),
        Activation("attention output", att.out, Q_AXES),
        Activation("hidden, gate's and up's gradients", 3 * fe, MLP_AXES),
        Activation("attention projections' gradients", projected - h, Q_AXES),
        Activation("o's and down's gradients", 2 * h, HIDDEN),
    ]


def layer_residuals(m: ModelConfig, policy: str, seq_len: int) -> list[Activation]:
    """What one decoder layer keeps for its backward under a remat policy (what jax's autodiff saves).

    ``none``: everything below (norms and SwiGLU as :mod:`jaxscale.ops.lean` keeps them; multi-head latent
    attention's latents, :func:`_latents`); ``selective``: ``none`` less the attention core's own residuals;
    ``full``: the layer input; ``save_dots``: the input and the outputs of the weight matmuls that the
    recomputation needs (q, k, v or MLA's four projections, attention out, gate, up); ``offload_dots``: on the
    device, the input (``save_dots``' rest in host memory); ``save_named``: the input and ``model.remat_names``
    (``model.remat_offload``'s in host memory). MoE layers' routers are counted by their share of the layers.
    """
    h, att = m.embed, attention(m)
    fe = mlp_per_token(m)
    sizes = {"h": h, "q": att.q, "k": att.k, "v": att.v, "out": att.out, "f": fe}
    x = Activation("layer input", h, RESIDUAL)
    if policy in ("full", "offload_dots"):  # offload_dots: save_dots' outputs in host memory
        return [x]
    if policy == "save_dots":
        projected = sum(c * n for c, n, _, _, _ in projections(m))  # the projections' outputs, the last's too
        return [
            x,
            Activation("query, key, value (MLA: its projections)", projected - h, Q_AXES),
            Activation("attention projection", h, HIDDEN),  # under SP: the partial sums, before the scatter
            Activation("gate, up (dense and shared experts')", 2 * dense_per_token(m), MLP_AXES),
        ]
    if policy == "save_named":
        named = [(n, *REMAT_NAMES[n]) for n in m.remat_names if n in REMAT_NAMES]
        return [x] + [Activation(n, sizes[w], axes or att.kv_axes) for n, w, axes in named]
    kept = [
        Activation("norm inputs", 2 * h, RESIDUAL),
        Activation("norm statistics", 2, RESIDUAL[:2], "fp32"),
        Activation("normed inputs", 2 * h, HIDDEN),
        *_latents(m, False),
        *_latents(m, True),
        Activation("query, attention out", att.q + att.out, Q_AXES),
        Activation("key, value", att.k + att.v, att.kv_axes),
        Activation("gate, up, hidden", 3 * fe, MLP_AXES),
    ]
    a = m.heads
    if policy == "selective":
        pass
    elif m.attention in FLASH_ATTENTION:
        kept += [Activation("kernel output", att.out, Q_AXES), Activation("softmax statistics", a, SCORES, "fp32")]
    else:
        kept += [
            Activation("scores", a * seq_len, SCORES, "fp32"),
            Activation("probabilities", a * seq_len, SCORES),
            Activation("softmax statistics", 2 * a, SCORES, "fp32"),
        ]
    if m.moe is not None:
        share = moe_layers(m) / m.layers
        kept.append(Activation("router", round(2 * m.moe.experts * share), RESIDUAL[:2], "fp32"))
        if m.moe.dispatch == "dropless":  # the grouped matmuls' rows, their outputs before the gates, the mask
            kept.append(Activation("routed rows, their outputs", round(2.25 * m.moe.top_k * h * share), RESIDUAL))
    return kept


def attention_accumulators(m: ModelConfig) -> list[Activation]:
    """Blockwise and ring attention's backward's zero-initialised fp32 accumulators, which XLA schedules
    early (before the MLP's backward; before the loss in a pipeline's last slot): ``dq`` and the per-tile
    ``dk``, ``dv`` it sums after the loop (per token)."""
    if m.attention not in TILED_ATTENTION:
        return []
    att = attention(m)
    return [Activation("dq accumulator", att.q, Q_AXES, "fp32"),
            Activation("per-tile dk, dv accumulators", att.k + att.v, att.kv_axes, "fp32")]


def mlp_backward_buffers(m: ModelConfig) -> list[Activation]:
    """The buffers a layer's backward holds at its MLP's peak besides the layer's residuals (per token).

    As compiled: each RMSNorm's backward recomputes its normalized input and materialises its statistic
    broadcast to the width (fp32, 2h per norm; the attention norm's are made at the layer backward's start,
    so both norms' are live: 4h); the block output's gradient and its copy transposed for the down
    projection's weight gradient (gathered whole under SP); SwiGLU's backward: the hidden's gradient, the
    gate's and the up's each in the layout of the matmul for the input's gradient and transposed for the
    weight's, and the sigmoid recomputed (6f); and with blockwise or ring attention the attention
    backward's accumulators (:func:`attention_accumulators`, a·d_h + 2·g·d_h).
    """
    h, fe = m.embed, mlp_per_token(m)
    held = [
        Activation("norms' normalized inputs and broadcast statistics", 4 * h, RESIDUAL, "fp32"),
        Activation("block output's gradient", h, RESIDUAL),
        Activation("block output's gradient, transposed (gathered under SP)", h, HIDDEN),
        Activation("hidden's, gate's and up's gradients, the latter two in two layouts", 5 * fe, MLP_AXES),
        Activation("sigmoid of the gate", fe, MLP_AXES, "fp32"),
    ]
    return held + attention_accumulators(m)


def sliced_backward(m: ModelConfig, seq_len: int) -> list[Activation]:
    """What the backward of a layer without remat (``model.remat: none``) holds at its MLP's peak beside
    the scan's stack of residuals: the residuals XLA copies out of the stack for the layer, which are the
    attention's own and the normed inputs (the norms' inputs and statistics, gate, up and hidden are read
    in place), and :func:`mlp_backward_buffers`.

    On the test model with blockwise attention (h = 64, f = 128, a·d_h = 64, g·d_h = 32, a = 8) that is
    2h + 3·a·d_h + 2·g·d_h + a + 4h + 2h + 6f + a·d_h + 2·g·d_h = 1672 elements per token, the
    compiled step's 1608 and a transposed gradient XLA:CPU frees before the peak (dp, seq_len 2048).
    """
    in_place = {"norm inputs", "norm statistics", "gate, up, hidden"}
    sliced = [r for r in layer_residuals(m, "none", seq_len) if r.name not in in_place]
    return sliced + mlp_backward_buffers(m)


def saved_dots_backward(m: ModelConfig, seq_len: int) -> list[Activation]:
    """What the backward of a layer under ``model.remat: save_dots`` holds at its MLP's peak beside the scan's
    stack: :func:`recomputed_backward`'s MLP peak less what the stack holds beyond the layer input (q, k, v,
    the attention projection, gate and up are read from it, not recomputed).

    On the test model with blockwise attention: 2122 − 448 = 1674 elements per token against 1616 compiled
    (dp, seq_len 2048: 6f of SwiGLU's, 10 buffers of h or a·d_h, 6 of g·d_h, the kernel's statistics)."""
    saved = [r for r in layer_residuals(m, "save_dots", seq_len) if r.name != "layer input"]
    return recomputed_backward(m, seq_len)[0] + [dataclasses.replace(r, per_token=-r.per_token) for r in saved]


def recomputed_backward(m: ModelConfig, seq_len: int) -> list[list[Activation]]:
    """What the backward of one fully recomputed layer (``model.remat: full``) holds at its two peaks,
    besides its weight gradients: the layer's residuals of ``none``, recomputed, and the gradient buffers.

    The backward runs the MLP first, then attention; a residual is freed after its last use. Per token:

    - the MLP's peak: every residual of ``none`` (:func:`layer_residuals`) is alive but the layer input
      (the remat stack's slice, read in place), with :func:`mlp_backward_buffers`:
      ``none − h + 4h + 2h + 6f (+ a·d_h + 2·g·d_h)``;
    - the attention's peak: the MLP's residuals are gone (its norm's input, normed input and
      statistic, gate, up, hidden: 2h + 1 + 3f); the gradients are the residual stream's (h), the
      attention output's (a·d_h) and, with ``dot`` attention, the probabilities' turned into the
      scores' in place (a·s, fp32): ``none − 2h − 1 − 3f + h + a·d_h (+ a·s)``.

    The larger of the two is the layer's backward transient (plus its weight gradients, counted by
    the caller). With blockwise attention on the tiny test model (h = 64, f = 128, a·d_h = 64,
    g·d_h = 32, a = 8: ``none`` = 906 elements) the MLP's peak is 906 − 64 + 256 + 128 + 768 + 128 =
    2122, against 2085 compiled (zero3, seq_len 2048: 9f of SwiGLU's, 12 buffers of h or a·d_h, 4 of
    g·d_h); at Llama 3 8B's widths (h = 4096, f = 14336, a·d_h = 4096, g·d_h = 1024) it is 2.4x ``none``
    (cudnn) to 2.5x (blockwise).
    """
    h = m.embed
    fe = mlp_per_token(m)
    residuals = layer_residuals(m, "none", seq_len)
    mlp = [*residuals, Activation("layer input (the stack's)", -h, RESIDUAL), *mlp_backward_buffers(m)]
    attn = [
        *residuals,
        Activation("MLP norm input (freed)", -h, RESIDUAL),
        Activation("MLP normed input (freed)", -h, HIDDEN),
        Activation("MLP norm statistic (freed)", -1, RESIDUAL[:2], "fp32"),
        Activation("gate, up, hidden (freed)", -3 * fe, MLP_AXES),
        Activation("residual gradient", h, RESIDUAL),
        Activation("attention output gradient", attention(m).out, Q_AXES),
    ]
    if m.attention not in FLASH_ATTENTION:
        # The probabilities' gradient (a dot's output) becomes the scores' in place: the softmax
        # backward is one elementwise fusion whose output XLA gives the dead operand's buffer.
        attn.append(Activation("probabilities' then scores' gradient", m.heads * seq_len, SCORES, "fp32"))
    return [mlp, attn]
