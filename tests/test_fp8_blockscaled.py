"""Block-scaled formats (jaxscale/precision/fp8/microscaling.py, block_scaled.py): MXFP8 and NVFP4 quantisation and
one projection's three GEMMs, against NumPy references written here from the published definitions.

- MXFP8: OCP Microscaling Formats (MX) v1.0 (32-element blocks, an E8M0 power-of-two scale, E4M3 elements) with
  the scale NVIDIA's MXFP8 recipe takes, ``2^ceil(log2(amax / 448))`` (rounded up: no element saturates);
- NVFP4: NVIDIA, "Pretraining Large Language Models with NVFP4" (2025), its quantisation appendix: a tensor's
  encode scale ``6·448 / amax``, each 16-block's E4M3 decode scale ``e4m3(amax_b / 6 · s_enc)``, E2M1 elements
  rounded to nearest even (the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6), 16 x 16 blocks for weights, the 16 x 16 random
  Hadamard transform on the weight gradient's inputs, stochastic rounding of gradients.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxscale.precision import fp8
from jaxscale.precision.fp8 import block_scaled
from jaxscale.precision.fp8 import microscaling as mx

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_e4m3(a: np.ndarray) -> np.ndarray:
    """Round to nearest even on E4M3's grid (ml_dtypes' cast), as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def np_e2m1(a: np.ndarray) -> np.ndarray:
    """Round to the nearest E2M1 value, ties to the even code (an even index on the grid), saturating at 6."""
    mag = np.minimum(np.abs(a), 6.0)
    dist = np.abs(mag[..., None] - E2M1_GRID)
    best = dist.min(axis=-1, keepdims=True)
    ties = np.isclose(dist, best, rtol=0, atol=1e-12)
    even = ties & (np.arange(8) % 2 == 0)
    index = np.where(even.any(-1), even.argmax(-1), ties.argmax(-1))
    return np.sign(a) * E2M1_GRID[index]


def np_mxfp8(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's 32-blocks: (scales 2^ceil(log2(amax/448)), the values dequantized)."""
    blocks = a.reshape(*a.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448.0)), 2.0**-126)
    return scale[..., 0], (np_e4m3(blocks / scale) * scale).reshape(a.shape)


def np_nvfp4(a: np.ndarray, amax: float, rows: int = 1) -> np.ndarray:
    """``a`` [R, K] dequantized from NVFP4: blocks of ``rows`` x 16 (1: activations, 16: 2-D weight blocks)."""
    r, k = a.shape
    enc = 6.0 * 448.0 / amax
    x = a.astype(np.float64).reshape(r // rows, rows, k // 16, 16)
    block_amax = np.abs(x).max(axis=(1, 3), keepdims=True)
    scale = np_e4m3(np.minimum(block_amax / 6.0 * enc, 448.0))
    q = np_e2m1(np.where(scale > 0, x * enc / np.where(scale > 0, scale, 1), 0.0))
    return (q * scale / enc).reshape(r, k)


def sylvester_hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1, 1], [1, -1]]), h)
    return h


def test_mxfp8_scales_are_powers_of_two_rounded_up():
    """Random blocks over 12 octaves, plus: a block whose amax is exactly 448·2^3 (scale 2^3, no rounding up), one
    of amax 449 (scale 2: the OCP spec's floor(log2 amax) - 8 would take 1 and clip 449 to 448), and zeros (any
    scale serves them: 2^-126, E8M0's smallest but one, the smallest normal fp32)."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((4, 128)) * np.exp2(rng.integers(-6, 6, (4, 128)))).astype(np.float32)
    a[1, :32] = np.linspace(-448 * 8, 448 * 8, 32)
    a[2, 32:64] = np.linspace(-1, 449, 32)
    a[3, 64:96] = 0
    got = jax.jit(mx.mxfp8)(jnp.asarray(a))
    scale, values = np_mxfp8(a)
    np.testing.assert_array_equal(np.asarray(got.scale.astype(jnp.float32)), scale)
    assert got.q.dtype == jnp.float8_e4m3fn and got.scale.dtype == jnp.float8_e8m0fnu
    assert (scale[1, 0], scale[2, 1], scale[3, 2]) == (8.0, 2.0, 2.0**-126)
    np.testing.assert_array_equal(np.asarray(got.dequantized()), values)
    assert values[2, 63] == 448.0  # 449 at scale 2: 224.5, to nearest E4M3 (224): not clipped


def test_nvfp4_blocks_match_the_recipe():
    """1 x 16 blocks and 16 x 16 weight blocks: E4M3 block scales under the tensor scale 6·448/amax, E2M1
    elements to nearest even; a block 2^12 below the tensor's amax keeps E2M1's precision (the tensor scale lifts
    its E4M3 scale into E4M3's normal range)."""
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((32, 64)) * np.exp(rng.standard_normal((32, 64)))).astype(np.float32)
    a[3, 16:32] *= 2.0**-12
    amax = float(np.abs(a).max())
    got = jax.jit(mx.nvfp4)(jnp.asarray(a), jnp.full((1, 1), amax))
    assert got.q.dtype == jnp.float4_e2m1fn and got.scale.dtype == jnp.float8_e4m3fn
    want = np_nvfp4(a, amax)
    np.testing.assert_allclose(np.asarray(got.dequantized()), want, rtol=1e-6, atol=0)
    assert np.abs(want[3, 16:32] - a[3, 16:32]).max() < 0.35 * np.abs(a[3, 16:32]).max()
    along_k, along_n = jax.jit(mx.nvfp4_2d)(jnp.asarray(a), jnp.full((1, 1), amax))
    want = np_nvfp4(a, amax, rows=16)
    np.testing.assert_allclose(np.asarray(along_n.dequantized()), want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(along_k.dequantized()), want.T, rtol=1e-6, atol=0)


def test_e2m1_rounding_nearest_even_saturating_and_stochastic():
    """Nearest even on the grid (1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 5 -> 4), ±6 beyond it; stochastic: 200k values
    spread over [2, 2.5) go up to 3 a quarter of the time and keep their mean (nearest: all to 2, 0.25 low)."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -9.0, -2.5], np.float32)
    got = np.asarray(jax.jit(mx.e2m1, static_argnums=1)(jnp.asarray(ties), False).astype(jnp.float32))
    np.testing.assert_array_equal(got, np_e2m1(ties))
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, 6, -6, -2])
    x = np.random.default_rng(4).uniform(2.0, 2.5, 200_000).astype(np.float32)
    sr = np.asarray(jax.jit(mx.e2m1, static_argnums=1)(jnp.asarray(x), True).astype(jnp.float32))
    assert set(np.unique(sr)) == {2.0, 3.0}
    assert abs(np.mean(sr == 3.0) - np.mean(x - 2)) < 0.01
    assert abs(np.mean(sr) - np.mean(x)) < 0.01


def test_hadamard_transform_is_orthogonal_and_blockwise():
    """Each 16 consecutive elements times ``diag(s) · H_16 / 4`` (Sylvester's H_16, random signs s = ±1)."""
    h = mx.hadamard_matrix()
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    signs = np.diag(h @ sylvester_hadamard(16).T) / 4.0
    assert set(np.abs(signs).round(6)) == {1.0} and len(set(signs)) == 2
    np.testing.assert_allclose(h, signs[:, None] * sylvester_hadamard(16) / 4.0, atol=1e-7)
    a = np.random.default_rng(2).standard_normal((3, 48)).astype(np.float32)
    want = (a.reshape(3, 3, 16) @ h).reshape(3, 48)
    np.testing.assert_allclose(np.asarray(mx.hadamard(jnp.asarray(a))), want, rtol=1e-5, atol=1e-6)


def project(recipe: fp8.Recipe, x, w, g):
    """``bse,ehd->bshd`` (x [2, 16, 64] as 32 tokens x 64, w [64, 2, 16] as 64 x 32): y and the VJP's dx, dw."""
    h = jnp.zeros(2)

    def f(x, w):
        x_op, w_op = fp8.Operand(x, fp8.Deferred(), h, None, recipe), fp8.Operand(w, fp8.Deferred(), h, h, recipe)
        return block_scaled.einsum("bse,ehd->bshd", x_op, w_op)

    y, vjp = jax.vjp(jax.jit(f), x, w)
    dx, dw = vjp(g)
    return np.asarray(y).reshape(32, 32), np.asarray(dx).reshape(32, 64), np.asarray(dw).reshape(64, 32)


SHAPES = ((32, 64), (64, 32), (32, 32))  # x, w, g as matrices


@pytest.fixture(scope="module")
def operands():
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 16, 64)) * jnp.exp(jax.random.normal(kx, (2, 16, 64)))
    return x, jax.random.normal(kw, (64, 2, 16)) * 0.1, jax.random.normal(kg, (2, 16, 2, 16)) * 1e-2


def test_mxfp8_projection_scales_each_gemm_along_its_contraction(operands):
    """Forward x (along K) · w (along K); dx: g (along N) · w (along N); dw: x (along the tokens) · g (along the
    tokens): each operand quantized for each GEMM on its own 32-blocks."""
    x, w, g = operands
    y, dx, dw = project(fp8.Recipe("mxfp8", 0), x, w, g)
    x2, w2, g2 = (np.asarray(a, np.float64).reshape(shape) for a, shape in zip((x, w, g), SHAPES, strict=True))
    q = lambda a: np_mxfp8(a)[1]  # noqa: E731 (blocks along the last axis)
    np.testing.assert_allclose(y, q(x2) @ q(w2.T).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, q(g2) @ q(w2).T, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dw, q(x2.T) @ q(g2.T).T, rtol=1e-5, atol=1e-7)
    assert np.abs(y - x2 @ w2).max() < 0.1 * np.abs(x2 @ w2).max()


def test_nvfp4_projection_follows_the_recipe(operands):
    """Round to nearest (stochastic rounding off, tested above): forward x in 1 x 16 blocks · w in 16 x 16 blocks;
    dx: g in 1 x 16 blocks along N · the same E2M1 weight (its 2-D blocks read along N); dw: x and g along the
    tokens through the random Hadamard transform, each under its own tensor scale."""
    x, w, g = operands
    recipe = fp8.Recipe("nvfp4", 0, stochastic_rounding=False)
    y, dx, dw = project(recipe, x, w, g)
    x2, w2, g2 = (np.asarray(a, np.float64).reshape(shape) for a, shape in zip((x, w, g), SHAPES, strict=True))
    nv = lambda a, rows=1: np_nvfp4(a, np.abs(a).max(), rows)  # noqa: E731
    wq = nv(w2, 16)
    hx, hg = ((a.T.reshape(-1, 2, 16) @ mx.hadamard_matrix()).reshape(-1, 32) for a in (x2, g2))
    np.testing.assert_allclose(y, nv(x2) @ wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, nv(g2) @ wq.T, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dw, nv(hx) @ nv(hg).T, rtol=1e-4, atol=1e-7)
    sr, _, sr_dw = project(fp8.Recipe("nvfp4", 0), x, w, g)
    np.testing.assert_array_equal(sr, y)  # stochastic rounding touches only the gradients
    assert not np.array_equal(sr_dw, dw)


def test_gemm_holds_the_one_kernel_of_its_devices():
    """The kernel is chosen when traced, by the devices' platform: the dequantized product here, with no
    conditional around it (``lax.platform_dependent`` left one, and XLA:CPU deadlocked in 4 of 8 runs of the mxfp8
    fsdp_tp step read back from jax's cache, its all-gathers inside the conditional). test_compile_blockscaled.py
    shows cuDNN's on B200."""
    a = mx.mxfp8(jnp.ones((1, 8, 64)))
    b = mx.mxfp8(jnp.ones((1, 4, 64)))
    text = jax.jit(block_scaled.gemm).lower(a, b).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert "custom_call" not in text and "dot_general" in text
    np.testing.assert_array_equal(block_scaled.gemm(a, b), np.full((1, 8, 4), 64.0))
