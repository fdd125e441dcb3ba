"""MoE balance without an auxiliary loss: the routing bias selects only, its updates against NumPy, its state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, assert_trees_close, fails_early, tiny_config

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.models import balance
from jaxscale.ops import routing as kernels
from jaxscale.training.trainer import Trainer

EXPERTS, TOP_K = 8, 2
MOE = ["model.moe={}", f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", "model.moe.mlp=32"]


def moe_config(*overrides):
    return tiny_config(*MOE, *overrides).model.moe


def random_logits(seed=0, shape=(2, 16, EXPERTS)):
    return jax.random.normal(jax.random.key(seed), shape) * 2.0


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_bias_changes_the_choice_and_not_the_gates(router):
    cfg = moe_config(f"model.moe.router={router}", "model.moe.balance=sign", "model.moe.dispatch=dropless")
    logits = random_logits()
    bias = jnp.asarray([5.0, 0, 0, 0, 0, 0, 0, -5.0])  # expert 0 always chosen, expert 7 never
    route = jax.jit(lambda lg, b: kernels.route(lg, cfg, 16, b))
    plain, plain_aux = route(logits, jnp.zeros(EXPERTS))
    biased, aux = route(logits, bias)
    idx = np.asarray(biased.index)
    assert np.all(idx[..., 0] == 0) and not np.any(idx == 7)
    # The gates: the chosen experts' unbiased scores, renormalised (NumPy from the logits).
    lg = np.asarray(logits, np.float64)
    scores = np.exp(lg - lg.max(-1, keepdims=True))
    scores = scores / scores.sum(-1, keepdims=True) if router == "softmax" else 1 / (1 + np.exp(-lg))
    top = np.take_along_axis(scores, idx, -1)
    np.testing.assert_allclose(biased.gate, top / top.sum(-1, keepdims=True), rtol=1e-5)
    # The loss terms do not see the bias except through the choice: the z-loss not at all.
    assert float(aux["moe_z_loss"]) == float(plain_aux["moe_z_loss"])
    assert not np.array_equal(idx, np.asarray(plain.index))
    np.testing.assert_array_equal(aux["moe_load"], np.bincount(idx.ravel(), minlength=EXPERTS))


def numpy_quantile_target(scores, bias, k):
    """The quantile-balanced bias, written out: each token's (k+1)-th biased score minus its scores, the
    k/E quantile of that over the tokens for each expert, centred."""
    flat = scores.reshape(-1, scores.shape[-1]).astype(np.float64)
    cutoff = np.sort(flat + bias, axis=-1)[:, ::-1][:, k]
    need = cutoff[:, None] - flat
    target = np.quantile(need, k / flat.shape[-1], axis=0)
    return target - target.mean()


def test_sign_update_against_numpy():
    cfg = moe_config("model.moe.balance=sign", "model.moe.bias_rate=0.01")
    bias = {"blocks": {"b": jnp.asarray(np.random.default_rng(0).normal(size=(3, EXPERTS)), jnp.float32)}}
    load = np.array([[4, 4, 4, 4, 4, 4, 4, 4], [9, 1, 4, 4, 5, 3, 2, 4], [0, 0, 0, 32, 0, 0, 0, 0]], np.float32)
    new = balance.updated(bias, {"moe_load": jnp.asarray(load)}, cfg)
    # b += rate * sign(mean - load): mean load 4 in every layer; equal load moves nothing.
    want = np.asarray(bias["blocks"]["b"]) + 0.01 * np.sign(4.0 - load)
    np.testing.assert_allclose(new["blocks"]["b"], want, rtol=0, atol=1e-7)


def test_quantile_update_against_numpy():
    cfg = moe_config("model.moe.balance=quantile", "model.moe.bias_ema=0.25", "model.moe.dispatch=dropless")
    logits = random_logits(1, (4, 64, EXPERTS))
    old = jnp.asarray(np.random.default_rng(1).normal(scale=0.1, size=EXPERTS), jnp.float32)
    _, aux = jax.jit(lambda lg: kernels.route(lg, cfg, 64, old))(logits)
    lg = np.asarray(logits, np.float64)
    scores = np.exp(lg - lg.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    target = numpy_quantile_target(scores, np.asarray(old, np.float64), TOP_K)
    np.testing.assert_allclose(aux["moe_bias_target"], target, rtol=0, atol=1e-6)
    new = balance.updated({"b": old[None]}, {"moe_bias_target": aux["moe_bias_target"][None]}, cfg)
    np.testing.assert_allclose(new["b"][0], 0.25 * np.asarray(old) + 0.75 * target, rtol=0, atol=1e-6)
    # On these scores the target bias balances the load: every expert near tokens * k / E choices.
    routing, _ = jax.jit(lambda lg, b: kernels.route(lg, cfg, 64, b))(logits, jnp.asarray(target, jnp.float32))
    load = np.bincount(np.asarray(routing.index).ravel(), minlength=EXPERTS)
    plain = np.bincount(np.asarray(jax.lax.top_k(logits, TOP_K)[1]).ravel(), minlength=EXPERTS)
    assert load.max() / load.mean() < plain.max() / plain.mean()
    assert load.max() / load.mean() <= 1.2


STEP = [*MOE, "model.layers=4", "model.moe.every_n_layers=2", "model.moe.capacity_factor=1.0",
        "model.moe.bias_rate=0.05", "train.microbatches=2"]


def train(trainer, state, steps=3):
    for step in range(steps):
        state, out = trainer.step(state, trainer.batch(step))
    return state, out


@pytest.fixture(scope="module")
def one_device():
    trainer = Trainer.build(tiny_config(*STEP, "model.moe.balance=sign", rules="dp"), jax.devices()[:1])
    return trainer, *train(trainer, trainer.init_state())


def test_sign_bias_in_the_train_state(one_device):
    _, state, out = one_device
    (bias,) = jax.tree.leaves(state.balance)
    assert bias.shape == (2, EXPERTS) and bias.dtype == jnp.float32  # [moe layers, experts]
    # Three sign steps of 0.05 (or none where a load equals the mean): multiples of 0.05 up to 0.15.
    steps = np.asarray(bias) / 0.05
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert np.abs(steps).max() <= 3 and np.any(steps != 0)
    # Not a parameter: nowhere in the parameters or the optimizer state.
    for tree in (state.params, state.opt_state):
        assert not any("bias" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    assert out["moe_load_max"].shape == (2,)


@pytest.mark.slow
@pytest.mark.parametrize("rules, mesh", [("ep_fsdp", {"expert": 4, "fsdp": 2}), ("zero3", {"fsdp": 8})])
def test_layouts_with_the_bias_match_one_device(rules, mesh, one_device):
    ref_trainer, ref_state, ref_out = one_device
    trainer = Trainer.build(tiny_config(*STEP, "model.moe.balance=sign", rules=rules, mesh=mesh))
    # Loss and gradients under a bias that changes the choices (that of the trained state), from one device's
    # initial state laid out (not initialised again under the layout: one compile fewer).
    bias = jax.device_get(ref_state.balance)
    start = jax.device_get(ref_trainer.init_state())
    ref_loss, ref_grads = ref_trainer.loss_and_grads(start.params, ref_trainer.batch(0), None, bias)
    start = jax.device_put(start, trainer.state_shardings)
    laid_out = jax.device_put(bias, trainer.state_shardings.balance)
    loss, grads = trainer.loss_and_grads(start.params, trainer.batch(0), None, laid_out)
    assert abs(float(loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)
    state, out = train(trainer, start)
    assert_trees_close(state.balance, ref_state.balance, rtol=0)
    assert_trees_close(state.params, ref_state.params)
    for key in ("moe_load_max", "moe_load_cv", "moe_entropy"):
        np.testing.assert_allclose(out[key], ref_out[key], rtol=RTOL)


def test_bias_saved_and_restored_bit_for_bit(one_device, tmp_path):
    trainer, state, _ = one_device
    checkpointer = Checkpointer(tmp_path / "ckpt")
    checkpointer.save(3, state, {}, {}, {})
    checkpointer.wait()
    restored = checkpointer.restore_state(trainer.abstract_state(), 3)
    checkpointer.close()
    assert jax.tree.leaves(state.balance)
    for got, want in zip(jax.tree.leaves(restored.balance), jax.tree.leaves(state.balance), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_balance_configs_refused():
    with fails_early(r"^model\.moe\.bias_ema must be in \[0, 1\), got 1\.0$"):
        tiny_config(*MOE, "model.moe.bias_ema=1.0")
    with fails_early(r"^model\.moe\.balance=quantile needs model\.moe\.top_k < model\.moe\.experts"):
        tiny_config(*MOE, "model.moe.top_k=8", "model.moe.balance=quantile")


def test_group_limited_routing_against_numpy():
    cfg = moe_config("model.moe.groups=4", "model.moe.top_groups=2", "model.moe.router=sigmoid",
                     "model.moe.dispatch=dropless")
    logits = random_logits(3, (2, 16, EXPERTS))
    bias = jnp.asarray(np.linspace(-0.2, 0.2, EXPERTS), jnp.float32)
    routing, _ = jax.jit(lambda lg: kernels.route(lg, cfg, 16, bias))(logits)
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    limited = 0
    for token, score in zip(np.asarray(routing.index).reshape(-1, TOP_K), scores.reshape(-1, EXPERTS), strict=True):
        biased = score + np.asarray(bias, np.float64)
        # Groups of 2 experts, scored by the sum of both; the best 2 groups' experts compete.
        group_score = biased.reshape(4, 2).sum(-1)
        allowed = np.concatenate([[2 * g, 2 * g + 1] for g in np.argsort(-group_score, kind="stable")[:2]])
        best = sorted(allowed, key=lambda e: -biased[e])[:TOP_K]
        assert list(token) == best
        limited += best != list(np.argsort(-biased, kind="stable")[:TOP_K])
    assert limited > 0  # the groups changed some tokens' choices
    with fails_early(r"^model\.moe\.groups \(3\) must divide model\.moe\.experts \(8\)$"):
        tiny_config(*MOE, "model.moe.groups=3")
    with fails_early(r"^model\.moe\.top_groups \(1\) must be in \[1, model\.moe\.groups\] and hold model\.moe\.top_k "
                     r"\(2\) experts"):
        tiny_config(*MOE, "model.moe.groups=8", "model.moe.top_groups=1")


def test_quantile_target_the_same_with_tokens_split_over_devices():
    cfg = moe_config("model.moe.balance=quantile", "model.moe.dispatch=dropless")
    logits = random_logits(4, (8, 16, EXPERTS))
    bias = jnp.asarray(np.linspace(-0.1, 0.1, EXPERTS), jnp.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def target(lg):
        return kernels.route(lg, cfg, 16, bias)[1]["moe_bias_target"]

    whole = jax.jit(target)(logits)
    sharded = jax.jit(target, in_shardings=split)(jax.device_put(logits, split))
    np.testing.assert_allclose(sharded, whole, rtol=0, atol=1e-7)
