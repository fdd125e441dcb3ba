"""The attention kernel, chosen by ``model.attention``.

* ``dot``: ``jax.nn.dot_product_attention`` (XLA); the whole ``s x s`` scores.
  With ``data.documents`` (packed documents) one boolean ``[batch, s, s]`` mask
  from the document ids (:func:`document_ids`) keeps attention within each.
  With the sequence sharded (a ``cp`` rules preset) the partitioner all-gathers
  keys and values.
* ``blockwise``: flash-style attention on each device's whole sequence, one
  ``model.attention_block`` tile of scores at a time, fully masked tiles
  skipped (the ring kernel with a ring of one). With ``data.documents`` the
  tiles across documents are skipped too and the rest masked tile by tile.
* ``ring``: context parallelism, :mod:`jaxscale.parallel.ring_attention`:
  the sequence's mesh axes (the rules' ``length``) form a ring that passes
  key/value blocks (with their document starts under ``data.documents``); the
  data path orders each sequence in zig-zag chunks (:func:`sequence_order`).
  With ``length`` unsharded it is ``blockwise``.
* ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, GPU only
  (cuDNN's fused flash attention; bf16/fp16, head_dim a multiple of 8 up to 128,
  256 on Hopper). It takes the same ``[batch, length, heads, head_dim]`` layout
  and grouped-query k/v (``kv_heads`` dividing ``heads``) directly, as the XLA
  path does. Untested here: the tests run on CPU. Not with ``data.documents``
  (:data:`CUDNN_DOCUMENTS`; docs/attention.md).
* **Ulysses / USP**: where the rules map ``ulysses`` (trailing mesh axes of ``length``), all-to-alls trade
  the sequence for the heads around the kernel above (:mod:`jaxscale.parallel.ulysses`): ``dot``,
  ``blockwise`` or ``cudnn`` on whole sequences, or ``ring`` over the rest of ``length``'s axes (USP).
* ``auto``: one of the above, chosen once when the trainer is built
  (:func:`resolve_attention`), so the step, ``inspect`` and the analytic model
  all see the concrete kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxscale.config import refusals
from jaxscale.config.read import Config, ConfigError, ModelConfig
from jaxscale.layout.rules import Rules
from jaxscale.layout.sharding import Axes, active, layout_of, platform, stage
from jaxscale.parallel import logit_max, ring_attention, ring_schedule, ulysses


def document_ids(positions: jax.Array) -> jax.Array:
    """Which packed document each token of ``positions`` [batch, length] is in: a new one where a position is 0
    (``data.documents``: positions restart at each document; a row begun inside a document has id 0 there)."""
    return jnp.cumsum(positions == 0, axis=1, dtype=jnp.int32)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, documents: jax.Array | None, q_axes: Axes, kv_axes: Axes,
    config: ModelConfig,
) -> jax.Array:
    """Causal attention of q [batch, length, heads, head_dim] over k [batch, length, kv_heads, head_dim] and
    v [batch, length, kv_heads, v_head_dim]; with ``documents``, the positions [batch, length] of packed documents
    (restarting at 0 at each), a token attends only within its document. The values' width may differ from the
    queries' (multi-head latent attention): the tiled kernels take it as it is, XLA's and cuDNN's see both padded
    with zeros to the wider (exact: zero columns of the values give zero outputs, cut off; zero query and key
    columns add nothing to the scores, scaled by the true ``1/sqrt(head_dim)``)."""
    return _attention(q, k, v, documents, q_axes, kv_axes, config, head_max=False)


def attention_with_max(
    q: jax.Array, k: jax.Array, v: jax.Array, documents: jax.Array | None, q_axes: Axes, kv_axes: Axes,
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array]:
    """:func:`attention` and each query head's largest pre-softmax logit over the batch [heads] (fp32, no
    gradient: ``train.qk_clip``'s statistic, :mod:`jaxscale.parallel.logit_max`); not from ``cudnn`` (refused:
    the fused kernel hands out no scores) nor inside a pipeline stage (refused)."""
    return _attention(q, k, v, documents, q_axes, kv_axes, config, head_max=True)


def core(config: ModelConfig, q_axes: Axes, kv_axes: Axes, head_max: bool, recompute: bool
         ) -> Callable[..., tuple[jax.Array, jax.Array | None]]:
    """A layer's attention core ``(q, k, v, documents) -> (out, heads' largest logits or None)``: with
    ``head_max`` :func:`attention_with_max`, else :func:`attention`; ``recompute``: checkpointed, nothing saved
    (``model.remat: selective``: q, k, v kept, the core recomputed in the backward)."""

    def run(q: jax.Array, k: jax.Array, v: jax.Array, documents: jax.Array | None) -> tuple:
        if head_max:
            return attention_with_max(q, k, v, documents, q_axes, kv_axes, config)
        return attention(q, k, v, documents, q_axes, kv_axes, config), None

    if recompute:
        return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    return run


def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, documents: jax.Array | None, q_axes: Axes, kv_axes: Axes,
    config: ModelConfig, head_max: bool,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    kind = config.attention
    if kind == "auto":  # a model used outside a Trainer (whose build resolves it); no ring: the data is not reordered
        kind = resolve_attention(config, platform(), q.shape[1], documents=documents is not None)
    if documents is not None and kind == "cudnn":
        raise ConfigError(CUDNN_DOCUMENTS)
    if kind == "cudnn" and platform() != "gpu":
        raise ConfigError(f"model.attention: 'cudnn' needs GPU devices, these are {platform()}")
    inside, current = stage(), active()
    if inside is not None and inside.ulysses:  # a pipeline stage's loop, manual over the context axes already
        ring = tuple(a for a in inside.ring if a not in inside.ulysses)
        kernel = _manual_kernel(kind, config, ring, gathered=True, head_max=head_max)
        return ulysses.manual(q, k, v, documents, inside.ulysses, kernel, head_max=head_max)
    if inside is None and current is not None and current[1].ulysses_axes:
        kernel = _manual_kernel(kind, config, current[1].ring_axes, gathered=False, head_max=head_max)
        return ulysses.attention(q, k, v, documents, q_axes, kv_axes, kernel, head_max=head_max)
    if kind in ("blockwise", "ring"):
        return ring_attention.attention(
            q, k, v, q_axes, kv_axes, positions=documents, causal=True, block=config.attention_block,
            ring=kind == "ring", head_max=head_max,
        )
    return _xla(kind, q, k, v, documents, head_max=head_max)


def _manual_kernel(kind: str, config: ModelConfig, ring: tuple[str, ...], gathered: bool, head_max: bool = False
                   ) -> ulysses.Kernel:
    """The kernel ``kind`` on each device's blocks inside Ulysses' all-to-alls: the tiled ones over the ``ring``
    axes (``ring`` only; none under Ulysses alone: blockwise; ``gathered`` in a pipeline stage), XLA's or
    cuDNN's on whole sequences; with ``head_max`` it returns its local heads' largest logits too."""
    if kind in ("blockwise", "ring"):
        ring = ring if kind == "ring" else ()
        return partial(ring_attention.manual, axes=ring, causal=True, block=config.attention_block, gathered=gathered,
                       head_max=head_max)
    return partial(_xla, kind, head_max=head_max)


def _xla(kind: str, q: jax.Array, k: jax.Array, v: jax.Array, documents: jax.Array | None, head_max: bool = False
         ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``dot`` or ``cudnn``: ``jax.nn.dot_product_attention`` on whole sequences, masked across documents; with
    ``head_max`` (``dot``) the heads' largest logits too (:func:`jaxscale.parallel.logit_max.dot_head_max`)."""
    unpadded = q, k
    scale, d_v = 1.0 / math.sqrt(q.shape[-1]), v.shape[-1]
    width = max(q.shape[-1], d_v)
    q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])]) for x in (q, k, v))
    mask = None
    if documents is not None:
        segments = document_ids(documents)
        mask = segments[:, None, :, None] == segments[:, None, None, :]  # [batch, 1, q, k]
    implementation = "cudnn" if kind == "cudnn" else None
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True, implementation=implementation)
    if head_max:
        return out[..., :d_v], logit_max.dot_head_max(*unpadded, None if documents is None else segments)
    return out[..., :d_v]


CUDNN_DOCUMENTS = refusals.by_name("cudnn-documents").line  # (a row of the refusal table, no values in it)
CUDNN_HEAD_DIM = 128  # the largest head_dim cuDNN's flash attention takes on every GPU (256 from Hopper on)
BLOCKWISE_TILES = 4  # auto: blockwise once the sequence spans more than this many attention_block tiles


def resolve_attention(
    config: ModelConfig, platform: str, seq_len: int, context: int = 1, documents: bool = False,
    scores: bool = False,
) -> str:
    """The kernel ``model.attention`` runs on ``platform`` ("cpu", "gpu", "tpu") at ``seq_len`` tokens.

    Anything but ``auto`` is kept. ``auto`` is ``ring`` when the rules shard the sequence
    (``context`` > 1 devices); else ``cudnn`` on GPU for bf16/fp16 compute and a head_dim cuDNN
    takes, unless packed ``documents`` are masked (cuDNN cannot: :data:`CUDNN_DOCUMENTS`) or the step reads the
    heads' largest ``scores`` (``train.qk_clip``: cuDNN hands out none); else
    ``blockwise`` when ``seq_len > BLOCKWISE_TILES x attention_block`` (2048 tokens by default,
    where dot keeps fp32 ``s x s`` scores of 16 MiB per sequence and head in every layer, plus
    the probabilities, and the tiled kernel skips over 10 of its 25 or more tiles as fully
    masked); else ``dot``.
    """
    if config.attention != "auto":
        return config.attention
    if context > 1:
        return "ring"
    cudnn_dtype = config.dtype in ("bfloat16", "float16")
    cudnn_shape = config.head_dim <= CUDNN_HEAD_DIM and config.head_dim % 8 == 0
    if platform == "gpu" and cudnn_dtype and cudnn_shape and not documents and not scores:
        return "cudnn"
    if seq_len > BLOCKWISE_TILES * config.attention_block:
        return "blockwise"
    return "dot"


def resolved(config: Config, mesh: Mesh, rules: Rules) -> Config:
    """``config`` with ``model.attention`` resolved for the mesh's devices and the rules' sequence axes."""
    platform = mesh.devices.flat[0].platform
    ring = layout_of(mesh, rules).ring_size
    kind = resolve_attention(config.model, platform, config.train.seq_len, ring, config.data.documents,
                             config.train.qk_clip is not None)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention=kind))
    ulysses.check(layout_of(mesh, rules), config)
    ring_tiles(config, mesh, rules)  # data.ring_balance refused here, before anything is compiled
    return config


def sequence_order(config: ModelConfig, seq_len: int, mesh: Mesh, rules: Rules) -> np.ndarray | None:
    """The order the data path must give each sequence's tokens, targets and positions (None: as they come).

    Under ``model.attention: ring`` the devices of the sequence's mesh axes form the ring.
    """
    cp = layout_of(mesh, rules).ring_size if config.attention == "ring" else 1
    return ring_schedule.sequence_order(seq_len, cp) if cp > 1 else None


def ring_tiles(config: Config, mesh: Mesh, rules: Rules) -> tuple[int, int] | None:
    """``data.ring_balance``: the ring's size and its kernel's tile, for the data path to arrange each row's
    documents by (:mod:`jaxscale.parallel.ring_balance`); None without it."""
    if not config.data.ring_balance:
        return None
    ring = layout_of(mesh, rules).ring_size  # at least 2: refused by the table otherwise (ring-balance-ring)
    return ring, min(config.model.attention_block, config.train.seq_len // (2 * ring))

