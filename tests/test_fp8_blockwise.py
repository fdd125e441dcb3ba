"""Blockwise FP8 (jaxscale/precision/fp8/blockwise.py): per-tile and per-block scales and one projection, forward and
backward, against a NumPy reference of DeepSeek-V3's recipe written here."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import tiny_config
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_fp8 import equations

from jaxscale.config.read import ConfigError
from jaxscale.precision import fp8
from jaxscale.precision.fp8 import blockwise as fp8_blockwise
from jaxscale.precision.fp8 import blockwise_collective as fp8_blockwise_collective
from jaxscale.precision.fp8 import blockwise_grouped as fp8_blockwise_grouped

B = 4  # the tile and block size of these tests (128 in DeepSeek-V3)
RECIPE = fp8.Recipe("blockwise", margin=0, block=B)
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
TOP = {E4M3: 448.0, E5M2: 57344.0}


def np_tiles(a: np.ndarray, fmt) -> tuple[np.ndarray, np.ndarray]:
    """1 x B tiles of a [M, K] matrix: scale[m, j] = max |a[m, jB:(j+1)B]| / max(fmt); a dequantized."""
    m, k = a.shape
    s = np.abs(a).reshape(m, k // B, B).max(axis=-1) / TOP[fmt]
    full = np.repeat(s, B, axis=1)
    q = np.clip(a / full.astype(np.float32), -TOP[fmt], TOP[fmt]).astype(fmt).astype(np.float64)
    return s, q * full


def np_blocks(w: np.ndarray, fmt) -> tuple[np.ndarray, np.ndarray]:
    """B x B blocks of a [K, N] matrix: scale[i, j] = max |w[iB:(i+1)B, jB:(j+1)B]| / max(fmt); w dequantized."""
    k, n = w.shape
    s = np.abs(w).reshape(k // B, B, n // B, B).max(axis=(1, 3)) / TOP[fmt]
    full = np.repeat(np.repeat(s, B, axis=0), B, axis=1)
    q = np.clip(w / full.astype(np.float32), -TOP[fmt], TOP[fmt]).astype(fmt).astype(np.float64)
    return s, q * full


def test_tile_and_block_scales_match_numpy():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 12)) * np.exp(rng.standard_normal((3, 12)))).astype(np.float32)
    w = (rng.standard_normal((8, 12)) * np.exp(rng.standard_normal((8, 12)))).astype(np.float32)
    for got, (scale, values) in (
        (fp8_blockwise.tiles(jnp.asarray(a), B, fp8.E4M3, 0), np_tiles(a, E4M3)),
        (fp8_blockwise.blocks(jnp.asarray(w), B, fp8.E4M3, 0), np_blocks(w, E4M3)),
    ):
        np.testing.assert_allclose(got.scale, scale, rtol=1e-6)
        expand = np.repeat(np.asarray(got.scale), B, axis=1)
        if expand.shape != got.q.shape:
            expand = np.repeat(expand, B, axis=0)
        np.testing.assert_allclose(np.asarray(got.q.astype(jnp.float32)) * expand, values, rtol=1e-6)
    assert got.scale.shape == (2, 3) and float(got.amax) == float(np.abs(w).max())


def test_blockwise_projection_matches_numpy_recipe():
    """``bse,ehd->bshd``: x [2, 4, 8] read as 8 tokens x 8, w [8, 2, 4] as 8 x 8. Forward: x in 1 x B tiles, w in
    B x B blocks (e4m3); dx: the output gradient in 1 x B tiles along the output (e5m2) against w's blocks;
    dw: x and the output gradient in B x 1 tiles along the tokens."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 4, 8), jnp.float32)
    w = jax.random.normal(kw, (8, 2, 4), jnp.float32) * 0.2
    g = jax.random.normal(kg, (2, 4, 2, 4), jnp.float32) * 1e-2
    h = jnp.zeros(3)

    def project(x, w, hx, hw, hg):
        x_op, w_op = fp8.Operand(x, fp8.Deferred(), hx, None, RECIPE), fp8.Operand(w, fp8.Deferred(), hw, hg, RECIPE)
        return fp8_blockwise.einsum("bse,ehd->bshd", x_op, w_op)

    y, vjp = jax.vjp(project, x, w, h, h, h)
    dx, dw, hx, hw, hg = vjp(g)
    x2, w2, g2 = np.asarray(x).reshape(8, 8), np.asarray(w).reshape(8, 8), np.asarray(g).reshape(8, 8)
    _, xq = np_tiles(x2, E4M3)
    _, wq = np_blocks(w2, E4M3)
    _, gq = np_tiles(g2, E5M2)
    _, xq_t = np_tiles(x2.T.copy(), E4M3)  # x^T [K, M]: tiles along the tokens
    _, gq_t = np_tiles(g2.T.copy(), E5M2)  # g^T [N, M]
    np.testing.assert_allclose(np.asarray(y).reshape(8, 8), xq @ wq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx).reshape(8, 8), gq @ wq.T, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dw).reshape(8, 8), xq_t @ gq_t.T, rtol=1e-5, atol=1e-7)
    for got, tensor in ((hx, x), (hw, w), (hg, g)):
        np.testing.assert_array_equal(got, [float(jnp.max(jnp.abs(tensor))), 0.0, 0.0])
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(project, *a)[1](g))(x, w, h, h, h).jaxpr
    dots = [tuple(v.aval.dtype.name for v in e.invars) for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert sorted(dots) == [(e4m3, e4m3), (e4m3, e5m2), (e5m2, e4m3)]


def np_row_tiles(a: np.ndarray, fmt) -> np.ndarray:
    """B x 1 tiles of a [rows, N] matrix from its first row (the last tile short where rows % B): a dequantized."""
    out = np.zeros(a.shape)
    for start in range(0, a.shape[0], B):
        tile = a[start : start + B]
        s = np.abs(tile).max(axis=0, keepdims=True) / TOP[fmt]
        s = np.where(s > 0, s, 1.0)
        q = np.clip(tile / s.astype(np.float32), -TOP[fmt], TOP[fmt]).astype(fmt).astype(np.float64)
        out[start : start + B] = q * s
    return out


def test_blockwise_grouped_matmul_matches_numpy_recipe():
    """Dropless rows sorted by expert, boundaries off the tiles: rows 0-4 to expert 0, none to expert 1, rows 5-10
    to expert 2, row 11 to no local expert; the experts' weights 1000x apart. Forward: each row in 1 x B tiles
    along K, each expert's weight in its own B x B blocks; dx: the output gradient in 1 x B tiles along N
    against the blocks; dw[e]: expert e's rows of x and of the gradient in B x 1 tiles counted from its first
    row (5 rows: a tile of 4 and one of 1; 6 rows: 4 and 2), so no tile holds two experts' rows."""
    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (12, 8), jnp.float32)
    w = jax.random.normal(kw, (3, 8, 12), jnp.float32) * jnp.array([1.0, 10.0, 0.01])[:, None, None]
    g = jax.random.normal(kg, (12, 12), jnp.float32) * 1e-3
    sizes = jnp.array([5, 0, 6], jnp.int32)
    hx, hw, hg = jnp.zeros(2), jnp.zeros((3, 2)), jnp.zeros(2)

    def project(x, w, hx, hw, hg):
        x_op, w_op = fp8.Operand(x, fp8.Deferred(), hx, None, RECIPE), fp8.Operand(w, fp8.Deferred(), hw, hg, RECIPE)
        return fp8_blockwise_grouped.ragged(x_op, w_op, sizes)

    @jax.jit
    def forward_backward(*args):
        y, vjp = jax.vjp(project, *args)
        return y, vjp(g)

    y, (dx, dw, new_hx, new_hw, new_hg) = forward_backward(x, w, hx, hw, hg)
    x_, w_, g_ = np.asarray(x), np.asarray(w), np.asarray(g)
    _, xq = np_tiles(x_, E4M3)
    _, gq = np_tiles(g_, E5M2)
    want_y, want_dx, want_dw = np.zeros((12, 12)), np.zeros((12, 8)), np.zeros((3, 8, 12))
    for e, rows in ((0, slice(0, 5)), (2, slice(5, 11))):
        _, wq = np_blocks(w_[e], E4M3)
        want_y[rows] = xq[rows] @ wq
        want_dx[rows] = gq[rows] @ wq.T
        want_dw[e] = np_row_tiles(x_[rows], E4M3).T @ np_row_tiles(g_[rows], E5M2)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(new_hx[0], np.abs(x_).max())
    np.testing.assert_array_equal(new_hw[:, 0], np.abs(w_).max(axis=(1, 2)))
    np.testing.assert_array_equal(new_hg[0], np.abs(g_).max())
    # The expert tiles' scales differ from whole-matrix tiles: tiling rows 4-7 across experts 0 and 2 would not match.
    straddled = np_row_tiles(x_[:11], E4M3)[5:11].T @ np_row_tiles(g_[:11], E5M2)[5:11]
    assert not np.allclose(want_dw[2], straddled, rtol=1e-5)


def test_blockwise_expert_einsum_matches_numpy_recipe():
    """Capacity dispatch's ``becd,edf->becf``, the expert ``e`` a batch letter: each expert's 2 x 3 = 6 buffer rows
    in 1 x B tiles, its weight in its own B x B blocks (the experts' 1000x apart) and its own history entry; dw's
    tiles along the tokens are the expert's (6 rows: a tile of 4 and one of 2, the buffer padded with zero rows)."""
    kx, kw, kg = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(kx, (2, 2, 3, 8), jnp.float32)
    w = jax.random.normal(kw, (2, 8, 8), jnp.float32) * jnp.array([1.0, 1e-3])[:, None, None]
    g = jax.random.normal(kg, (2, 2, 3, 8), jnp.float32) * 1e-2
    hx, hw, hg = jnp.zeros(2), jnp.zeros((2, 2)), jnp.zeros(2)

    def project(x, w, hx, hw, hg):
        x_op, w_op = fp8.Operand(x, fp8.Deferred(), hx, None, RECIPE), fp8.Operand(w, fp8.Deferred(), hw, hg, RECIPE)
        return fp8_blockwise.einsum("becd,edf->becf", x_op, w_op)

    @jax.jit
    def forward_backward(*args):
        y, vjp = jax.vjp(project, *args)
        return y, vjp(g)

    y, (dx, dw, new_hx, new_hw, new_hg) = forward_backward(x, w, hx, hw, hg)
    for e in range(2):
        xe, ge = (np.asarray(a[:, e]).reshape(6, 8) for a in (x, g))
        _, wq = np_blocks(np.asarray(w[e]), E4M3)
        want = {"y": np_tiles(xe, E4M3)[1] @ wq, "dx": np_tiles(ge, E5M2)[1] @ wq.T,
                "dw": np_row_tiles(xe, E4M3).T @ np_row_tiles(ge, E5M2)}
        got = {"y": np.asarray(y[:, e]).reshape(6, 8), "dx": np.asarray(dx[:, e]).reshape(6, 8), "dw": dw[e]}
        for name, value in want.items():  # fp32 sums against float64: 1e-6 of the largest where terms cancel
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6 * np.abs(value).max(), err_msg=name)
    np.testing.assert_array_equal(new_hw[:, 0], np.abs(np.asarray(w)).max(axis=(1, 2)))
    np.testing.assert_array_equal([new_hx[0], new_hg[0]], [np.abs(np.asarray(x)).max(), np.abs(np.asarray(g)).max()])


def _sp_pair(mesh, overlap: bool):
    """Blockwise fp8 column-parallel entry then row-parallel exit of an SP region over 'tensor' (t = 2): the
    collective matmuls or the plain all-gather / psum-scatter around :func:`fp8_blockwise.einsum`."""

    def body(x, w1, w2, hs):
        x_op = fp8.Operand(x, fp8.Deferred(), hs[0], None, RECIPE)
        w1_op, w2_op = (fp8.Operand(w, fp8.Deferred(), hs[i], hs[i + 1], RECIPE) for w, i in ((w1, 1), (w2, 3)))
        if overlap:
            (h,) = fp8_blockwise_collective.all_gather_matmul(x_op, [("bse,ehd->bshd", w1_op)], "tensor", 1)
        else:
            gathered = x_op.replace(value=lax.all_gather(x, "tensor", axis=1, tiled=True))
            h = fp8_blockwise.einsum("bse,ehd->bshd", gathered, w1_op)
        h = jnp.tanh(h).reshape(*h.shape[:2], -1)
        h_op = fp8.Operand(h, fp8.Deferred(), hs[5], None, RECIPE)
        if overlap:
            return fp8_blockwise_collective.matmul_reduce_scatter("bsf,fe->bse", h_op, w2_op, "tensor", 1)
        y = fp8_blockwise.einsum("bsf,fe->bse", h_op, w2_op)
        return lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True)

    x_spec = P(None, "tensor", None)
    specs = (x_spec, P(None, "tensor", None), P("tensor", None), P())
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=x_spec)


def test_collective_matmuls_quantize_as_the_plain_collectives():
    """``model.tp_overlap`` in blockwise fp8, function level: each device tiles its own 8-token chunk (whole
    tiles of B = 4 along the tokens too), the ring passes float8 chunks with their scales, and the output, the
    gradients and the histories' pushes are the plain collectives' (the tiles are the same; the input
    gradient's ring sums in another order)."""
    mesh = jax.make_mesh((2,), ("tensor",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (2, 16, 8))  # [batch, sequence, embed]
    w1 = jax.random.normal(keys[1], (8, 2, 4)) * 0.3  # [embed, heads, head_dim], heads over the ring
    w2 = jax.random.normal(keys[2], (8, 8)) * 0.3  # [heads·head_dim, embed]
    hs = tuple(jnp.zeros(3) for _ in range(6))

    def loss(overlap):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(_sp_pair(mesh, overlap)(*a) ** 2), argnums=(0, 1, 2, 3)))

    (got, grads), (want, want_grads) = loss(True)(x, w1, w2, hs), loss(False)(x, w1, w2, hs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    assert all(float(h[0]) > 0 for h in grads[3])


def test_a_stage_share_of_a_weight_short_of_whole_blocks_is_one_config_error():
    """Inside a pipeline stage the projections see each device's tensor-parallel share: wk's 4 key/value heads of
    8 over 2 devices are 16 columns, no whole 32 x 32 block (the config's sizes are; compiled for 8 x H100 this
    was a reshape error deep in the trace)."""
    from jaxscale.training.trainer import Trainer

    config = tiny_config("precision.fp8=blockwise", "precision.fp8_block=32", "train.microbatches=4",
                         rules="pp_fsdp_tp", mesh={"stage": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(ConfigError, match=r"holds a 64 x 16 weight on each device .* not whole 32 x 32 blocks"):
        Trainer.build(config)  # the build traces the stage
