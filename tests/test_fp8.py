"""FP8 projections (jaxscale/precision/fp8/): the quantizers, one projection against a NumPy reference of the recipe,
the config checks, and 200 steps against bf16."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import CURVE_SEEDS, loss_curves, tiny_config

from jaxscale.config.read import ConfigError
from jaxscale.precision import fp8
from jaxscale.training.trainer import Trainer

CURRENT, DELAYED = fp8.Recipe("current", margin=0), fp8.Recipe("delayed", margin=0)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DOT = "dot_general"


def dequantized(x, history, recipe, fmt=fp8.E4M3) -> np.ndarray:
    q = fp8.quantize(jnp.asarray(x, jnp.float32), jnp.asarray(history, jnp.float32), fmt, recipe)
    return np.asarray(q.q.astype(jnp.float32) * q.scale)


def on_grid(values: np.ndarray, fmt) -> bool:
    """Whether every value is representable in ``fmt`` (up to the fp32 rounding of dividing by the scale)."""
    values = np.asarray(values, np.float32)
    return bool(np.allclose(values.astype(fmt).astype(np.float32), values, rtol=1e-5, atol=1e-7))


def test_quantize_current_scaling_is_e4m3_with_amax_at_448():
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32) * 3.0
    q = fp8.quantize(x, jnp.zeros(4), fp8.E4M3, CURRENT)
    amax = float(jnp.max(jnp.abs(x)))
    assert q.q.dtype == jnp.float8_e4m3fn and q.scale.shape == () and float(q.amax) == amax
    np.testing.assert_allclose(float(q.scale), amax / E4M3_MAX, rtol=1e-7)
    y = np.asarray(q.q.astype(jnp.float32) * q.scale)
    np.testing.assert_allclose(float(np.max(np.abs(y))), amax, rtol=1e-6)
    s = amax / E4M3_MAX
    normal = np.abs(np.asarray(x)) > 2.0**-6 * s  # e4m3 normals: 3 mantissa bits, rounding error <= 2^-4
    assert np.all(np.abs(y - np.asarray(x))[normal] <= 2.0**-4 * np.abs(np.asarray(x))[normal])
    assert not np.array_equal(y, np.asarray(x))


def test_delayed_scaling_uses_history_and_saturates():
    x = np.array([0.5, -1.0, 4.0, 0.25], np.float32)
    history = [0.0, 2.0, 1.0, 0.0]  # the largest past amax is 2: 4.0 saturates at 2
    np.testing.assert_allclose(dequantized(x, history, DELAYED), [0.5, -1.0, 2.0, 0.25], rtol=1e-6)
    # Empty history (first step): the tensor's own amax, as current scaling.
    np.testing.assert_array_equal(dequantized(x, np.zeros(4), DELAYED), dequantized(x, np.zeros(4), CURRENT))
    # margin=1 halves the range: amax maps to 224, so 4.0 does not saturate.
    np.testing.assert_allclose(dequantized(x, history, fp8.Recipe("delayed", margin=1))[2], 4.0, rtol=1e-6)


def reference(values: np.ndarray, fmt, top: float) -> tuple[np.ndarray, float]:
    """The recipe in NumPy: per-tensor scale amax / top, values saturated and rounded to ``fmt``."""
    s = float(np.max(np.abs(values))) / top
    return np.clip(values / np.float32(s), -top, top).astype(fmt).astype(np.float32), s


def test_projection_runs_in_fp8_forward_and_backward():
    """``y = x · w``: e4m3 x e4m3 forward, e5m2 x e4m3 for dx and e4m3 x e5m2 for dw, against the recipe in
    NumPy; the histories' "gradients" are the histories with the three amaxes pushed in."""
    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (6, 16), jnp.float32)
    w = jax.random.normal(kw, (16, 8), jnp.float32) * 0.1
    g = jax.random.normal(kg, (6, 8), jnp.float32) * 1e-3
    history = jnp.zeros(3)  # empty: the tensors' own amaxes

    def project(x, w, hx, hw, hg):
        x_op = fp8.Operand(x, fp8.quantize(x, hx, fp8.E4M3, DELAYED), hx, None, DELAYED)
        w_op = fp8.Operand(w, fp8.quantize(w, hw, fp8.E4M3, DELAYED), hw, hg, DELAYED)
        return fp8.kernels(DELAYED).einsum("mk,kn->mn", x_op, w_op)

    y, vjp = jax.vjp(project, x, w, history, history, history)
    dx, dw, hx, hw, hg = vjp(g)
    qx, sx = reference(np.asarray(x), ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qw, sw = reference(np.asarray(w), ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qg, sg = reference(np.asarray(g), ml_dtypes.float8_e5m2, E5M2_MAX)
    np.testing.assert_allclose(y, (qx @ qw) * (sx * sw), rtol=1e-5)
    np.testing.assert_allclose(dx, (qg @ qw.T) * (sg * sw), rtol=1e-5)
    np.testing.assert_allclose(dw, (qx.T @ qg) * (sx * sg), rtol=1e-5)
    for got, tensor in ((hx, x), (hw, w), (hg, g)):
        np.testing.assert_array_equal(got, [float(jnp.max(jnp.abs(tensor))), 0.0, 0.0])

    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(project, *a)[1](g))(x, w, history, history, history)
    dots = [tuple(v.aval.dtype.name for v in e.invars) for e in equations(jaxpr.jaxpr) if e.primitive.name == DOT]
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert sorted(dots) == [(e4m3, e4m3), (e4m3, e5m2), (e5m2, e4m3)]
    assert not any(e.primitive.name == "cond" for e in equations(jaxpr.jaxpr))


def equations(jaxpr) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    found = []
    for e in jaxpr.eqns:
        found.append(e)
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += equations(inner)
    return found


def test_precision_config_errors():
    choices = r"off, delayed, current, blockwise"
    with pytest.raises(ConfigError, match=rf"precision\.fp8: 'e4m3' is not one of {choices}"):
        tiny_config("precision.fp8=e4m3")
    with pytest.raises(ConfigError, match=r"precision\.amax_history must be at least 1"):
        tiny_config("precision.amax_history=0")
    with pytest.raises(ConfigError, match=r"precision\.fp8_head needs precision\.fp8 on"):
        tiny_config("precision.fp8_head=true")
    with pytest.raises(ConfigError, match=r"blockwise: model\.embed \(64\) is not divisible by precision\.fp8_block"):
        tiny_config("precision.fp8=blockwise")
    with pytest.raises(ConfigError, match=r"blockwise: model\.moe\.mlp \(24\) is not divisible by"):
        tiny_config("precision.fp8=blockwise", "precision.fp8_block=16", "model.moe={}", "model.moe.mlp=24")
    assert tiny_config("precision.fp8=off").precision.fp8 == "off"  # YAML reads off as false
    with pytest.raises(ConfigError, match=r"tp_overlap: each device.s part of the sequence \(16 tokens"):
        overlap = tiny_config("precision.fp8=blockwise", "precision.fp8_block=32", "model.tp_overlap=true",
                              rules="fsdp_tp_sp", mesh={"tensor": 2})
        Trainer.build(overlap, jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"precision\.fp8_head: not supported with model\.loss_chunk"):
        chunked = tiny_config("precision.fp8=current", "precision.fp8_head=true", "model.loss_chunk=8")
        Trainer.build(chunked, jax.devices()[:1])
    # Resuming needs the saved fp8 state's shape: fp8 on or off, amax_history.
    saved = {"precision": {"fp8": "current", "amax_history": 16, "margin": 0}}
    fp8.check_resume(saved, tiny_config("precision.fp8=delayed").precision, 5)
    with pytest.raises(ConfigError, match=r"resume: checkpoint step 5 has precision\.fp8=current"):
        fp8.check_resume(saved, tiny_config("precision.amax_history=8", "precision.fp8=delayed").precision, 5)
    with pytest.raises(ConfigError, match=r"resume: checkpoint step 5 has precision\.fp8=off"):
        fp8.check_resume({}, tiny_config("precision.fp8=delayed").precision, 5)


def test_fp8_state_is_replicated_and_not_optimized(trainers):
    off = trainers.get(devices=1).abstract_state()
    trainer = Trainer.build(tiny_config("precision.fp8=delayed", "precision.amax_history=8"), jax.devices()[:1])
    state = trainer.abstract_state()
    assert off.fp8 == {}
    assert jax.tree.structure(state.params) == jax.tree.structure(off.params)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(off.opt_state)
    attn = state.fp8["blocks"]["attn"]["fp8"]
    assert sorted(attn) == ["k", "o", "out", "q", "v", "wk", "wo", "wq", "wv", "x"]
    mlp = state.fp8["blocks"]["mlp"]["fp8"]
    assert sorted(mlp) == ["down", "gate", "hidden", "up", "w_down", "w_gate", "w_up", "x"]
    assert all(a.shape == (2, 8) and a.dtype == jnp.float32 for a in jax.tree.leaves(state.fp8))
    assert all(s.spec == jax.sharding.PartitionSpec() for s in jax.tree.leaves(trainer.state_shardings.fp8))


# -- 200 steps of the tiny model: fp8 follows bf16 --------------------------------------------

WINDOW = 20
# One run's curve is a noisy witness: over seeds 0-5 the largest gap of a run's 20-step means to bf16's is up
# to 0.083 / 0.085 for fp32 (jax 0.10.2 / 0.12.0.1), 0.051 / 0.051 delayed, 0.048 / 0.087 current, 0.054 / 0.068
# blockwise (16-element tiles), and differs from seed to seed (0.005 to 0.051 delayed on jax 0.12.0.1). The
# mean over those 6 seeds of the difference stays within 0.012 / 0.009 (fp32), 0.008 / 0.015 (delayed),
# 0.011 / 0.012 (current), 0.013 / 0.016 (blockwise), its last 50 steps between -0.009 and +0.006 on average:
# no bias of fp8 shows, the gaps are the trajectories' noise (its spread over seeds at step 200: 0.02 to 0.035).
# Over the CURVE_SEEDS = 4 seeds held here: 0.009 / 0.018 (delayed), 0.014 / 0.019 (current), 0.020 / 0.032
# (blockwise), 0.031 (mxfp8 on jax 0.10.2, at step 91; its mean gap over the steps +0.011:
# benchmarks/blockscaled_curves.py, which measures NVFP4's too).
SMOOTHED_TOL = 0.05
MODES = {"delayed": (), "current": (), "blockwise": ("precision.fp8_block=16",), "mxfp8": ()}


def smooth(losses: np.ndarray) -> np.ndarray:
    return np.convolve(losses, np.ones(WINDOW) / WINDOW, mode="valid")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fp8_follows_bf16_loss_curve(mode, bf16_curves):
    """200 steps with fp8 against the same steps in bf16 (conftest.py's ``bf16_curves``) from each of
    :data:`helpers.CURVE_SEEDS` seeds (the same initial weights and batches): the mean over the seeds of the
    two 20-step-mean curves' difference within 0.05 nats at every step."""
    curves = loss_curves(f"precision.fp8={mode}", *MODES[mode], seeds=CURVE_SEEDS)
    differences = []
    for bf16, (low, fp8_state) in zip(bf16_curves, curves, strict=True):
        assert bf16.losses[0] - smooth(bf16.losses)[-1] > 2.0  # it learns
        assert not np.array_equal(low, bf16.losses)  # fp8 changes the numerics
        differences.append(smooth(low) - smooth(bf16.losses))
        # The histories hold the amaxes of the last steps: nonzero, finite.
        assert all(np.all(np.isfinite(h)) and np.all(np.asarray(h) > 0) for h in jax.tree.leaves(fp8_state.fp8))
    gap = np.abs(np.mean(differences, axis=0))
    assert gap.max() <= SMOOTHED_TOL, f"{mode}: smoothed loss {gap.max():.3f} from bf16 at step {gap.argmax()}"


# -- tracing sets nothing on a module --------------------------------------------------------


def attributes(model) -> dict[str, dict[str, int]]:
    """Each module of ``model`` by path: its attributes' names and the identity of their values (less nnx's own
    bookkeeping, ``_pytree__*``, which its transforms replace)."""
    from flax import nnx

    return {"/".join(map(str, p)): {k: id(v) for k, v in vars(m).items() if not k.startswith("_pytree__")}
            for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


@pytest.mark.parametrize("mode", [("precision.fp8=delayed", "precision.fp8_head=true"),
                                  ("precision.fp8=blockwise", "precision.fp8_block=16"),
                                  ("precision.fp8=nvfp4", "precision.nvfp4.bf16_last=0.5", "model.head_dim=16")])
def test_tracing_the_fp8_forward_sets_nothing_on_its_modules(mode):
    """The weights' copies made once before the layers reach them as scanned inputs (``fp8.using``): tracing the
    forward of an fp8 model (the one the train step's forward runs) and its decode step leaves every module's
    attributes as they were, compared inside the trace (no copy attached, as ``setattr`` did)."""
    from flax import nnx

    from jaxscale.models import decode
    from jaxscale.training.trainer import make_model

    with nnx.use_eager_sharding(False):
        model = make_model(tiny_config(*mode))
    tokens = jnp.zeros((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    cache = decode.empty(model.config, 2, 8)
    unchanged = []

    def traced(run):
        def fn(m, *args):
            before = attributes(m)
            run(m, *args)
            unchanged.append(attributes(m) == before)

        return fn

    nnx.eval_shape(traced(lambda m, t, p: m(t, p)), model, tokens, positions)
    nnx.eval_shape(traced(lambda m, t, p: decode.step(m, t, p, cache, 0)), model, tokens[:, :1], positions[:, :1])
    assert unchanged == [True, True]
