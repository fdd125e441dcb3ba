"""Dropless expert parallelism by exchanging the routed rows: one device's numbers, and its wire bytes."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import RTOL, assert_trees_close, rel_err, tiny_config
from jax import lax

from jaxscale.analysis import hlo
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models import moe
from jaxscale.parallel import exchange
from jaxscale.training.trainer import Trainer

EXPERTS, TOP_K = 8, 2
MOE = ["model.moe={}", f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", "model.moe.mlp=32",
       "model.moe.dispatch=dropless"]
BATCH, SEQ = 16, 32
LAYOUTS = {4: {"expert": 4, "data": 2}, 8: {"expert": 8}}


def uneven_input(params, embed, pull):
    """Random tokens pulled towards expert 0's router column, more in later sequences: each device's
    tokens are routed unevenly, and differently from its neighbours'."""
    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, SEQ, embed)), np.float32)
    toward = np.asarray(params["router"][:, 0])
    scale = pull * np.linspace(0, 1, BATCH)[:, None, None] / np.linalg.norm(toward)
    return jnp.asarray(x + scale * toward, jnp.float32)


def layer_and_grads(config, rules=None):
    """The MoE layer's jitted output, metrics and gradients of ``sum(out * probe)`` (params and input)."""
    with nnx.use_eager_sharding(False):
        layer = moe.MoE(config, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    params["router"] = params["router"] * 30

    def loss(params, x, probe):
        layer = nnx.merge(graphdef, params)
        if rules is None:
            y, aux = layer(x)
        else:
            with use_rules(make_mesh(config.mesh), Rules.load(rules)):
                y, aux = layer(x)
        return jnp.sum(y * probe), (y, aux)

    return params, jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def one_device():
    params, fn = layer_and_grads(tiny_config(*MOE))
    x = uneven_input(params, params["router"].shape[0], 12.0)
    probe = jax.random.normal(jax.random.key(2), x.shape)
    return params, x, probe, fn(params, x, probe)


@pytest.mark.parametrize("ep", list(LAYOUTS))
def test_rows_exchange_matches_one_device(ep, one_device):
    params, x, probe, (ref_grads, (ref_y, ref_aux)) = one_device
    load = np.asarray(ref_aux["moe_load"])
    assert load.max() / load.mean() > 2  # uneven on purpose
    config = tiny_config(*MOE, rules="ep", mesh=LAYOUTS[ep])
    _, fn = layer_and_grads(config, "ep")
    grads, (y, _) = fn(params, x, probe)
    assert rel_err(y, ref_y) <= RTOL
    assert_trees_close(grads, ref_grads)


def routed_counts(x, params, ep, mesh):
    """The largest number of choices any device sends any expert shard, counted in NumPy from the
    routing decisions (softmax, top-k) of each device's own rows of ``x``."""
    logits = np.einsum("bsd,de->bse", np.asarray(x, np.float64), np.asarray(params["router"], np.float64))
    index = np.argsort(-logits, axis=-1, kind="stable")[..., :TOP_K]  # softmax is monotone
    rows_per_device = BATCH // mesh.size
    shard = index // (EXPERTS // ep)
    return max(np.bincount(shard[d * rows_per_device:(d + 1) * rows_per_device].ravel(), minlength=ep).max()
               for d in range(mesh.size))


def emulated_ragged_all_to_all(shards):
    """``lax.ragged_all_to_all`` as its docstring defines it, from an all-gather (XLA:CPU cannot compile the
    collective): received slice ``i`` (from source ``i // per``) is written at ``all_to_all(output_offsets)[i]``,
    ``recv_sizes[i]`` rows read from the source's operand at its ``input_offsets`` for this device."""

    def exchange_(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
        # The result has the type of ``output``: it must vary over every axis the operand does.
        varying = jax.typeof(output).manual_axis_type.varying
        assert varying >= jax.typeof(operand).manual_axis_type.varying, varying
        per = input_offsets.shape[0] // shards
        me = lax.axis_index(axis_name)
        everyone, offsets = (lax.all_gather(a, axis_name) for a in (operand, input_offsets))
        dest = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
        p = jnp.arange(output.shape[0])
        for i in range(shards * per):
            source, e = divmod(i, per)
            inside = (p >= dest[i]) & (p < dest[i] + recv_sizes[i])
            row = jnp.clip(offsets[source, me * per + e] + p - dest[i], 0, operand.shape[0] - 1)
            output = jnp.where(inside[:, None], everyone[source][row], output)
        return output

    return exchange_


@pytest.mark.parametrize("ep", list(LAYOUTS))
def test_ragged_exchange_matches_one_device(ep, one_device, monkeypatch):
    # The GPU/TPU path's offsets and sizes, run on CPU through the collective's documented semantics.
    params, x, probe, (ref_grads, (ref_y, _)) = one_device
    monkeypatch.setattr(exchange, "RAGGED_PLATFORMS", ("cpu",))
    monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all(ep))
    _, fn = layer_and_grads(tiny_config(*MOE, rules="ep", mesh=LAYOUTS[ep]), "ep")
    grads, (y, _) = fn(params, x, probe)
    assert rel_err(y, ref_y) <= RTOL
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize("ep", list(LAYOUTS))
def test_ragged_exchange_lowers_and_cpu_cannot_compile_it(ep, one_device, monkeypatch):
    params, x, probe, _ = one_device
    config = tiny_config(*MOE, rules="ep", mesh=LAYOUTS[ep])
    assert not exchange.ragged_compiles(make_mesh(config.mesh))  # on CPU: the chunked all-to-alls
    monkeypatch.setattr(exchange, "RAGGED_PLATFORMS", ("cpu",))
    _, fn = layer_and_grads(config, "ep")
    lowered = fn.lower(params, x, probe)
    text = lowered.as_text()
    # There and back, forward and backward (the transposes); no chunk loop, no all-gather of the tokens.
    assert text.count("@ragged_all_to_all") == 4
    assert "all_gather" not in text and "reduce_scatter" not in text
    # The rows' cotangents are not summed over the data axis (the weights' gradients are: [E/ep, ...]).
    found = hlo.collectives(lowered.as_text(dialect="hlo"), make_mesh(config.mesh))
    assert not any(c.kind == "all-reduce" and c.shapes[0][1][0] == ep * BATCH // 8 * SEQ * TOP_K for c in found)
    # inspect counts each exchange at equal load, k·b·s·h·bytes·(ep−1)/ep, and says so
    counted, line = hlo.exchange_counted(lowered.as_text(dialect="hlo"), found)
    ragged = [c.wire_bytes for c in counted if c.kind == "ragged-all-to-all"]
    assert ragged == [TOP_K * BATCH // 8 * SEQ * config.model.embed * 4 * (ep - 1) / ep] * 4
    assert line.startswith("the dropless exchange's 4 collectives counted at equal load") and f"at most {ep}x" in line
    alltoall = [line for line in text.splitlines() if '"stablehlo.all_to_all"' in line]
    assert alltoall and all("xi32>" in line and "xf32>" not in line for line in alltoall)  # counts, offsets
    with pytest.raises(Exception, match="ragged-all-to-all"):
        lowered.compile()


@pytest.mark.parametrize("ep", list(LAYOUTS))
def test_rows_exchange_wire_bytes(ep):
    config = tiny_config(*MOE, rules="ep", mesh=LAYOUTS[ep])
    params, _ = layer_and_grads(config)
    x = uneven_input(params, config.model.embed, 2.0)
    probe = jax.random.normal(jax.random.key(2), x.shape)
    mesh = make_mesh(config.mesh)
    sent, text = {}, {}
    for way in ("rows", "all_gather"):
        _, fn = layer_and_grads(tiny_config(*MOE, f"model.moe.dropless_exchange={way}", rules="ep",
                                            mesh=LAYOUTS[ep]), "ep")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exchange loop's trip count is the routing's
            text[way] = fn.lower(params, x, probe).compile().as_text()
            found = hlo.collectives(text[way], mesh)
        # The layer's own: over the expert axis, inside its shard_map (not the weights' gradient sums).
        sent[way] = [c for c in found if c.axes == ("expert",) and "shard_map" in c.op_name]
    b, h, nbytes = BATCH // mesh.size, config.model.embed, 4
    n = b * SEQ * TOP_K
    most = routed_counts(x, params, ep, mesh)
    imbalance = most / (n / ep)
    assert imbalance > 1.2
    trips = math.ceil(most / exchange.chunk_rows(n, ep))
    looped = [c for c in sent["rows"] if c.kind == "all-to-all" and c.loops and c.loops[-1].trips is None]
    assert len(looped) == 4  # there and back, forward and backward
    rows_bytes = sum(c.wire_bytes * trips for c in looped)
    formula = 2 * TOP_K * b * SEQ * h * nbytes * (ep - 1) / ep * imbalance  # each way
    assert rows_bytes == pytest.approx(2 * formula, rel=0.05)
    # inspect's count: the loops at equal load (the formula's imbalance 1), within a chunk's rounding
    counted, _ = hlo.exchange_counted(text["rows"], sent["rows"])
    at_equal_load = sum(c.wire_bytes for c in counted if c.loops and c.loops[-1].trips is None)
    assert at_equal_load == pytest.approx(2 * formula / imbalance, rel=0.05)
    # Besides: the counts' all-to-all (E int32 per device) and the trip count's pmax.
    rest = [c for c in sent["rows"] if c not in looped]
    assert sum(c.wire_bytes for c in rest) <= 2 * EXPERTS * 4
    gathered = sum(c.wire_bytes for c in sent["all_gather"])
    assert gathered >= 4 * (ep - 1) * b * SEQ * h * nbytes  # the tokens there and back, each way
    assert rows_bytes < gathered


@pytest.mark.slow
def test_train_step_with_the_rows_exchange_matches_one_device():
    # The exchange's loops inside the layer scan, rematerialised, under the microbatch scan.
    step = [*MOE, "model.layers=2", "train.microbatches=2", "model.remat=full"]
    ref = Trainer.build(tiny_config(*step), jax.devices()[:1])
    trainer = Trainer.build(tiny_config(*step, rules="ep_fsdp", mesh={"expert": 4, "fsdp": 2}))
    ref_loss, ref_grads = ref.loss_and_grads(ref.init_state().params, ref.batch(0))
    loss, grads = trainer.loss_and_grads(trainer.init_state().params, trainer.batch(0))
    assert abs(float(loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)
