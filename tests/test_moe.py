"""Mixture of experts and expert parallelism: every layout against a per-token reference and one device (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import RTOL, assert_trees_close, fails_early, rel_err, run_steps, tiny_config

from jaxscale.analysis import hlo
from jaxscale.config.flops import param_count
from jaxscale.config.read import CONFIG_DIR, ConfigError, load_config
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models import moe
from jaxscale.ops import routing as kernels
from jaxscale.parallel import expert
from jaxscale.training.trainer import Trainer

EXPERTS, TOP_K, WIDTH = 8, 2, 32
MOE = ["model.moe={}", f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", f"model.moe.mlp={WIDTH}"]
# The layer under every expert-parallel size, with FSDP and tensor parallelism on the other devices.
LAYER_LAYOUTS = {
    1: ("ep_fsdp_tp", {"fsdp": 2, "tensor": 4}),
    2: ("ep_fsdp_tp", {"expert": 2, "fsdp": 2, "tensor": 2}),
    4: ("ep_fsdp", {"expert": 4, "fsdp": 2}),
    8: ("ep", {"expert": 8}),
}
BATCH, SEQ = 16, 32


def per_token_reference(x, params, top_k):
    """Each token through its top-k experts (softmax router), weighted by its renormalised gate."""
    logits = jnp.einsum("bsd,de->bse", x, params["router"])
    top, index = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    gate = top / top.sum(-1, keepdims=True)
    return expert_outputs(x, params, index, gate)


def expert_outputs(x, params, index, gate):
    """``sum_j gate[t, j] * SwiGLU_{index[t, j]}(x[t])`` token by token, each expert's weights gathered."""
    w_gate, w_up, w_down = (params[k][index] for k in ("w_gate", "w_up", "w_down"))  # [b, s, k, ...]
    hidden = jax.nn.silu(jnp.einsum("bsd,bskdf->bskf", x, w_gate)) * jnp.einsum("bsd,bskdf->bskf", x, w_up)
    return jnp.einsum("bskf,bskfd,bsk->bsd", hidden, w_down, gate)


def make_layer(config):
    with nnx.use_eager_sharding(False):
        layer = moe.MoE(config, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    return graphdef, nnx.to_pure_dict(state)


def layer_fn(graphdef, mesh=None, rules=None):
    """Jitted (output, metrics) and gradients of ``sum(output * probe)`` w.r.t. parameters and input."""

    def apply(params, x):
        layer = nnx.merge(graphdef, params)
        if mesh is None:
            return layer(x)
        with use_rules(mesh, rules):
            return layer(x)

    def loss(params, x, probe):
        y, aux = apply(params, x)
        return jnp.sum(y * probe), (y, aux)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def layer_case():
    """A layer, its input, a probe for the gradients, and the per-token reference's output and gradients."""
    config = tiny_config(*MOE, "model.moe.dispatch=dropless")
    _, params = make_layer(config)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, config.model.embed))
    probe = jax.random.normal(jax.random.key(2), x.shape)

    def ref_loss(params, x):
        return jnp.sum(per_token_reference(x, params, TOP_K) * probe)

    ref_y = per_token_reference(x, params, TOP_K)
    ref_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
    return params, x, probe, ref_y, ref_grads


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("ep", list(LAYER_LAYOUTS))
def test_layer_matches_per_token_reference(ep, dispatch, layer_case):
    params, x, probe, ref_y, ref_grads = layer_case
    rules, mesh = LAYER_LAYOUTS[ep]
    # capacity_factor = experts / top_k gives every expert a slot for every token: nothing can drop.
    config = tiny_config(*MOE, f"model.moe.dispatch={dispatch}", "model.moe.capacity_factor=4", rules=rules, mesh=mesh)
    graphdef, _ = make_layer(config)
    mesh = make_mesh(config.mesh)
    assert mesh.shape["expert"] == ep
    grads, (y, aux) = layer_fn(graphdef, mesh, Rules.load(rules))(params, x, probe)
    assert float(aux["moe_dropped"]) == 0.0
    assert rel_err(y, ref_y) <= RTOL
    assert_trees_close(grads, ref_grads)
    # The experts' weights stay split over the expert axis in the gradients.
    assert grads[0]["w_up"].sharding.shard_shape(grads[0]["w_up"].shape)[0] == EXPERTS // ep


@pytest.mark.parametrize(
    "rules, mesh, overrides",
    [
        # Sequence parallelism: the sequence is all-gathered on entry, reduce-scattered on exit.
        ("fsdp_tp_sp", {"fsdp": 2, "tensor": 4}, []),
        # GShard's einsum dispatch, the collectives left to the partitioner.
        ("ep_fsdp", {"expert": 4, "fsdp": 2}, ["model.moe.impl=partitioner"]),
    ],
)
def test_layer_other_layouts(rules, mesh, overrides, layer_case):
    params, x, probe, ref_y, ref_grads = layer_case
    config = tiny_config(*MOE, "model.moe.capacity_factor=4", *overrides, rules=rules, mesh=mesh)
    graphdef, _ = make_layer(config)
    grads, (y, _) = layer_fn(graphdef, make_mesh(config.mesh), Rules.load(rules))(params, x, probe)
    assert rel_err(y, ref_y) <= RTOL
    assert_trees_close(grads, ref_grads)


def hand_logits(choices: list[list[int]], experts: int) -> jax.Array:
    """Router logits [1, tokens, experts] ranking each token's listed experts first, in order."""
    logits = np.zeros((1, len(choices), experts), np.float32)
    for t, ranked in enumerate(choices):
        for rank, e in enumerate(ranked):
            logits[0, t, e] = 3.0 - rank
    return jnp.asarray(logits)


@pytest.mark.parametrize(
    "choices, top_k, dropped",
    [
        # top-1, capacity 2 per expert: expert 0 is chosen by tokens 0, 1, 3, 5; tokens 3 and 5 overflow.
        ([[0], [0], [1], [0], [2], [0], [3], [1]], 1, {(3, 0), (5, 0)}),
        # top-2, capacity 2: expert 0 gets the first choices of tokens 0 and 2, then the second choices
        # of tokens 1 and 3, which drop (first choices go first, whatever the token order).
        ([[0, 1], [1, 0], [0, 2], [3, 0]], 2, {(1, 1), (3, 1)}),
    ],
)
def test_overflow_drops_exactly_the_expected_choices(choices, top_k, dropped):
    experts = 4
    config = tiny_config("model.moe={experts: 4}", f"model.moe.top_k={top_k}", "model.moe.capacity_factor=1.0",
                         "model.moe.mlp=16", rules="ep", mesh={"expert": 4, "data": 2})
    moe_config = config.model.moe
    seq = len(choices)
    assert kernels.capacity(moe_config, seq) == 2
    routing, aux = jax.jit(lambda logits: kernels.route(logits, moe_config, 2))(hand_logits(choices, experts))
    assert {(t, j) for t in range(seq) for j in range(top_k) if routing.slot[0, t, j] >= 2} == dropped
    assert float(aux["moe_dropped"]) == pytest.approx(len(dropped) / (seq * top_k))

    # The same sequence 8 times (one per device), through the all-to-all path on 4 expert shards.
    routing = kernels.Routing(*(jnp.tile(a, (8, 1, 1)) for a in routing))
    _, params = make_layer(config)
    weights = tuple(params[k] for k in ("w_gate", "w_up", "w_down"))
    x = jax.random.normal(jax.random.key(3), (8, seq, config.model.embed))
    mesh = make_mesh(config.mesh)

    @jax.jit
    def run(x, routing, weights):
        with use_rules(mesh, Rules.load("ep")):
            return expert.experts(x, routing, weights, moe_config, 2)

    y = run(x, routing, weights)
    kept_gate = jnp.where(routing.slot < 2, routing.gate, 0.0)
    want = expert_outputs(x, params, routing.index, kept_gate)
    assert rel_err(y, want) <= RTOL
    if top_k == 1:  # a dropped token's expert output is exactly zero
        for t, _ in dropped:
            assert not np.any(np.asarray(y[:, t]))


def test_aux_and_z_loss_on_a_hand_computed_case():
    # Two experts, top-1. Token probabilities (softmax of the logits) and logsumexp c_t of each token:
    probs = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]])
    lse = np.array([0.0, 1.0, -1.0, 2.0])
    logits = jnp.asarray((np.log(probs) + lse[:, None])[None], jnp.float32)
    config = tiny_config("model.moe={}", "model.moe.experts=2", "model.moe.top_k=1").model.moe
    _, aux = jax.jit(lambda logits: kernels.route(logits, config, kernels.capacity(config, 4)))(logits)
    # Choices: experts 0, 0, 1, 0, so f = (3/4, 1/4); mean probabilities P = (0.65, 0.35).
    # Load balance: 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15. z-loss: (0 + 1 + 1 + 4) / 4 = 1.5.
    assert float(aux["moe_aux_loss"]) == pytest.approx(1.15, rel=1e-6)
    assert float(aux["moe_z_loss"]) == pytest.approx(1.5, rel=1e-6)
    # Sigmoid router: scores sigmoid(logits) choose; P averages them normalised per token.
    scores = np.array([[0.8, 0.5], [0.2, 0.6], [0.9, 0.3], [0.5, 0.5]])
    config = tiny_config("model.moe={experts: 2, top_k: 1}", "model.moe.router=sigmoid",
                         "model.moe.normalize_gates=false").model.moe
    routing, sig = jax.jit(lambda x: kernels.route(x, config, 4))(jnp.asarray(np.log(scores / (1 - scores))[None]))
    assert routing.index[0, :, 0].tolist() == [0, 1, 0, 0]  # a tie goes to the lower index
    np.testing.assert_allclose(routing.gate[0, :, 0], [0.8, 0.6, 0.9, 0.5], rtol=1e-6)
    p0 = np.mean(scores[:, 0] / scores.sum(1))  # (8/13 + 1/4 + 3/4 + 1/2) / 4
    assert float(sig["moe_aux_loss"]) == pytest.approx(2 * (0.75 * p0 + 0.25 * (1 - p0)), rel=1e-6)
    # The objective adds them with their weights.
    model = tiny_config("model.moe={}", "model.moe.aux_loss_weight=0.1", "model.moe.z_loss_weight=0.01").model
    assert float(moe.aux_objective(aux, model)) == pytest.approx(0.1 * 1.15 + 0.01 * 1.5, rel=1e-6)


# -- the whole train step --------------------------------------------------------------

STEP = [*MOE, "train.microbatches=2", "model.layers=4", "model.moe.every_n_layers=2", "model.moe.shared_experts=1",
        "model.moe.capacity_factor=1.0", "model.moe.aux_loss_weight=0.1", "model.moe.z_loss_weight=0.01"]


@pytest.fixture(scope="module")
def single_device_step():
    return run_steps(Trainer.build(tiny_config(*STEP, rules="dp"), jax.devices()[:1]), steps=1)


@pytest.fixture(scope="module")
def ep_fsdp_step():
    # One step: its loss, gradients (1.8e-7 apart), update (bit-identical) and routing metrics. After a second
    # step the embedding stood 4.8e-5 apart on the builtin corpus: Adam's m / (sqrt(v) + eps) turns the
    # gradients' summation-order noise into whole updates for entries whose gradient is near eps.
    return run_steps(Trainer.build(tiny_config(*STEP, rules="ep_fsdp", mesh={"expert": 4, "fsdp": 2})), steps=1)


@pytest.mark.slow
def test_ep_fsdp_train_step_matches_single_device(ep_fsdp_step, single_device_step):
    _, ref_loss, ref_grads, ref_params, ref_metrics, _ = single_device_step
    _, loss, grads, params, metrics, _ = ep_fsdp_step
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(grads, ref_grads)
    assert_trees_close(params, ref_params)
    for got, want in zip(metrics, ref_metrics, strict=True):
        for key in moe.METRICS:
            assert abs(got[key] - want[key]) <= RTOL * abs(want[key]), key
    # At capacity factor 1 some choices drop, identically on one device and on the mesh.
    assert metrics[0]["moe_dropped"] > 0
    w_up = params["blocks"]["blocks"][1]["mlp"]["w_up"]
    assert w_up.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", None)


@pytest.mark.slow
def test_ep_fsdp_all_to_all_bytes_match_the_formula(ep_fsdp_step):
    trainer, *_, text = ep_fsdp_step
    c, t, mesh = trainer.config.model, trainer.config.train, trainer.mesh
    found = [x for x in hlo.collectives(text, mesh) if "shard_map" in x.op_name]  # the MoE layers' own
    all_to_all = [x for x in found if x.kind == "all-to-all"]
    assert all_to_all and all(x.axes == ("expert",) for x in all_to_all)
    # Per MoE layer and microbatch: dispatch and combine forward, their transposes backward, each moving
    # (ep - 1) / ep of a [b, E, C, h] buffer.
    ep = mesh.shape["expert"]
    b = t.global_batch // (t.microbatches * mesh.shape["data"] * mesh.shape["fsdp"] * ep)  # sequences per device
    buffer = b * c.moe.experts * kernels.capacity(c.moe, t.seq_len) * c.embed * 4
    runs = t.microbatches * c.layers // c.moe.every_n_layers  # microbatches x MoE layers
    assert sum(x.wire_bytes for x in all_to_all) == pytest.approx(4 * runs * (ep - 1) / ep * buffer, rel=1e-12)
    # The fully manual shard_map gathers no activation over the batch axes (weights only, on fsdp).
    gathers = [x for x in found if x.kind == "all-gather"]
    assert gathers and all(x.axes == ("fsdp",) for x in gathers)


# -- configs -----------------------------------------------------------------------------

PRESET_MESHES = {
    "dp": {"data": 8}, "zero1": {"data": 8}, "zero2": {"data": 8}, "zero3": {"fsdp": 8},
    "tp": {"data": 2, "tensor": 4}, "tp_sp": {"data": 2, "tensor": 4}, "fsdp_tp": {"fsdp": 2, "tensor": 4},
    "fsdp_tp_sp": {"fsdp": 2, "tensor": 4}, "ep": {"expert": 8}, "ep_fsdp": {"expert": 4, "fsdp": 2},
    "ep_fsdp_tp": {"expert": 2, "fsdp": 2, "tensor": 2}, "cp": {"context": 8}, "fsdp_cp": {"fsdp": 2, "context": 4},
    "fsdp_tp_cp": {"fsdp": 2, "context": 2, "tensor": 2}, "ulysses": {"fsdp": 2, "context": 4},
    "usp": {"fsdp": 2, "context": 2, "ulysses": 2},
}
# A pipeline runs MoE blocks with the partitioner experts (idle slots masked) or explicit ones (the loop manual over
# every axis, idle slots skipped), but under sequence parallelism inside a stage (pp_tp_sp).
PIPELINE_MESHES = {"pp": {"stage": 2, "data": 4}, "pp_fsdp": {"stage": 2, "fsdp": 4},
                   "pp_fsdp_tp": {"stage": 2, "fsdp": 2, "tensor": 2}, "pp_tp_sp": {"stage": 2, "tensor": 2, "data": 2},
                   "pp_ep": {"stage": 2, "expert": 2, "data": 2}}
# Context parallelism inside a stage runs dense blocks only (the loop is manual over context).
CP_PIPELINE_MESHES = {"pp_tp_cp": {"stage": 2, "context": 2, "tensor": 2},
                      "pp_fsdp_tp_cp": {"stage": 2, "fsdp": 2, "context": 2}}


def test_every_rules_preset_lays_out_the_moe_model():
    presets = {p.stem for p in (CONFIG_DIR / "rules").glob("*.yaml")}
    assert set(PRESET_MESHES) | set(PIPELINE_MESHES) | set(CP_PIPELINE_MESHES) == presets
    for rules, mesh in PRESET_MESHES.items():
        ring = ("model.attention=ring",) if rules == "usp" else ()  # USP's ring part runs ring attention
        Trainer.build(tiny_config(*MOE, *ring, rules=rules, mesh=mesh))  # traces the whole step
    for rules, mesh in PIPELINE_MESHES.items():
        Trainer.build(tiny_config(*MOE, "model.moe.impl=partitioner", rules=rules, mesh=mesh))
        explicit = tiny_config(*MOE, "model.moe.impl=shard_map", rules=rules, mesh=mesh)
        if rules == "pp_tp_sp":  # SP would split the sequences an MoE layer routes whole
            with pytest.raises(ConfigError, match=r"model\.moe\.impl=shard_map inside a pipeline stage needs the "
                               r"stage's loop manual over every mesh axis, but \['tensor'\]"):
                Trainer.build(explicit)
        else:
            Trainer.build(explicit)
    for rules, mesh in CP_PIPELINE_MESHES.items():
        with pytest.raises(ConfigError, match=r"inside a pipeline stage needs a dense model"):
            Trainer.build(tiny_config(*MOE, "model.moe.impl=partitioner", rules=rules, mesh=mesh))


def test_experiment_and_full_size_configs():
    experiment = load_config(CONFIG_DIR / "experiments" / "moe-tiny.yaml")
    assert Trainer.build(experiment).mesh.shape["expert"] == 4
    mixtral = load_config(None, ["model=mixtral-8x7b"]).model
    counts = param_count(mixtral)
    assert round(counts["total"] / 1e9, 1) == 46.7
    assert round((counts["matmul"] + counts["embedding"]) / 1e9, 1) == 12.9  # active, with the embedding
    # Qwen3-30B-A3B's card: 30.5B, 3.3B activated (here 3.35B: the active matmuls, head and embedding).
    qwen = param_count(load_config(None, ["model=qwen3-30b-a3b"]).model)
    assert (round(qwen["total"] / 1e9, 1), round((qwen["matmul"] + qwen["embedding"]) / 1e9, 1)) == (30.5, 3.4)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.moe.dispatch=sometimes"], r"^model\.moe\.dispatch: 'sometimes' is not one of capacity, dropless$"),
        (["model.moe.router=relu"], r"^model\.moe\.router: 'relu' is not one of softmax, sigmoid$"),
        (["model.moe.top_k=9"], r"^model\.moe\.top_k \(9\) is more than model\.moe\.experts \(8\)$"),
        (["model.moe.every_n_layers=3"], r"^model\.layers \(2\) is not divisible by model\.moe\.every_n_layers \(3\)$"),
        (["model.moe.capacity_factor=0"], r"^model\.moe\.capacity_factor must be positive, got 0\.0$"),
        (["model.moe.expertz=4"], r"^unknown config key 'model\.moe\.expertz' \(known: "),
    ],
)
def test_bad_moe_config(overrides, match):
    with fails_early(match):
        tiny_config(*MOE, *overrides)


def test_expert_axis_must_shard_the_batch(tmp_path):
    path = tmp_path / "ep_no_batch.yaml"
    path.write_text((CONFIG_DIR / "rules" / "ep.yaml").read_text().replace("[data, fsdp, expert]", "[data, fsdp]"))
    with fails_early(r"^rules 'ep_no_batch': expert parallelism over \('expert',\) needs 'batch' sharded"):
        Trainer.build(tiny_config(*MOE, rules=str(path), mesh={"expert": 8}))


def test_experts_not_divisible_by_the_expert_axis():
    with fails_early(r"^param blocks\.blocks\.0\.mlp\.w_\w+: dimension 1 \('expert', size 6\) is not divisible by "):
        Trainer.build(tiny_config(*MOE, "model.moe.experts=6", rules="ep", mesh={"expert": 4, "data": 2}))
