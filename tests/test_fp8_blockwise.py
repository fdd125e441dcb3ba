"""Blockwise FP8 (jaxscale/fp8_blockwise.py): per-tile and per-block scales and one projection, forward and
backward, against a NumPy reference of DeepSeek-V3's recipe written here."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from test_fp8 import equations

from jaxscale import fp8, fp8_blockwise, fp8_blockwise_grouped

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
        x_op, w_op = fp8.Operand(x, None, hx, None, RECIPE), fp8.Operand(w, None, hw, hg, RECIPE)
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
        x_op, w_op = fp8.Operand(x, None, hx, None, RECIPE), fp8.Operand(w, None, hw, hg, RECIPE)
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
