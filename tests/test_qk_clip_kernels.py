"""QK-clip's statistic (jaxscale/parallel/logit_max.py): every attention kernel's largest pre-softmax logit per
query head against the scores' maximum written here in numpy, on one device and on context meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.config.read import MeshConfig, ModelConfig
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models.attention import attention_with_max
from jaxscale.parallel import ring_schedule

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 32, 4, 2, 8


def packed_positions() -> np.ndarray:
    """Rows packed with documents of 5, 11, 3 and 13 tokens (row 0) and 20 and 12 (row 1)."""
    rows = [[5, 11, 3, 13], [20, 12]]
    return np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]).astype(np.int32)


def numpy_head_max(q: np.ndarray, k: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    """max over batch, query i and key j <= i (in one document) of q_i . k_j / sqrt(d), per query head."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, HEADS // KV_HEADS, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
    keep = np.tril(np.ones((SEQ, SEQ), bool))[None]
    if positions is not None:
        doc = np.cumsum(positions == 0, axis=1)
        keep = keep & (doc[:, :, None] == doc[:, None, :])
    return np.where(keep[:, None], scores, -np.inf).max(axis=(0, 2, 3))


def qkv() -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    shapes = [(BATCH, SEQ, HEADS, HEAD_DIM), (BATCH, SEQ, KV_HEADS, HEAD_DIM), (BATCH, SEQ, KV_HEADS, HEAD_DIM)]
    # scaled per head, so that each head's maximum is its own
    scale = jnp.asarray([1.0, 2.0, 3.0, 0.5])[:, None]
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True))
    return [q * scale, k, v]


# name -> (model.attention, rules, mesh sizes, the ring's size for the data's order)
CASES = {
    "dot": ("dot", None, None, 1),
    "blockwise": ("blockwise", None, None, 1),
    "ring_cp4": ("ring", "cp", {"context": 4}, 4),
    "dot_fsdp_tp": ("dot", "fsdp_tp", {"fsdp": 2, "tensor": 2}, 1),
    "ulysses_dot": ("dot", "ulysses", {"context": 2}, 1),
    "usp_ring": ("ring", "usp", {"context": 2, "expert": 2}, 2),
}


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("name", CASES)
def test_head_max_is_the_largest_masked_score(name, documents):
    kind, rules, sizes, ring = CASES[name]
    model = ModelConfig(attention=kind, attention_block=4, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    q, k, v = qkv()
    positions = packed_positions() if documents else None
    order = ring_schedule.sequence_order(SEQ, ring) if ring > 1 else np.arange(SEQ)

    def run(q, k, v):
        docs = None if positions is None else jnp.asarray(positions[:, order])
        if rules is None:
            return attention_with_max(q, k, v, docs, Q_AXES, KV_AXES, model)
        mesh = make_mesh(MeshConfig(data=1, **sizes), jax.devices()[: int(np.prod(list(sizes.values())))])
        with use_rules(mesh, Rules.load(rules)):
            return attention_with_max(q, k, v, docs, Q_AXES, KV_AXES, model)

    _, got = jax.jit(run)(*(x[:, order] for x in (q, k, v)))
    want = numpy_head_max(q, k, positions)
    assert len(set(np.round(want, 3))) == HEADS  # the heads' maxima differ: a head mixed up would show
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_head_max_has_no_gradient_and_leaves_the_output():
    model = ModelConfig(attention="blockwise", attention_block=4, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    q, k, v = qkv()

    def loss(q, k, v, with_max: bool):
        out, most = attention_with_max(q, k, v, None, Q_AXES, KV_AXES, model)
        return out.sum() + (most.sum() if with_max else 0.0)

    plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    both = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, True)
    for a, b in zip(plain, both, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
