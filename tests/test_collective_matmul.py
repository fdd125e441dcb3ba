"""model.tp_overlap: the collective matmul gives sequence parallelism's results with the same bytes, as ring steps.

Function level: ``all_gather_matmul`` / ``matmul_reduce_scatter`` against ``lax.all_gather`` + einsum and
einsum + ``lax.psum_scatter``, on one SP axis and on a ring over two. Model level, for t = 2, 4, 8 (tp_sp
with the rest of the 8 devices on data; at t = 2 fsdp_tp_sp, data 2 x fsdp 2): the loss and gradients with
tp_overlap=true equal those with tp_overlap=false and those of one device (fp32, 1e-5); in the compiled HLO
every all-gather and reduce-scatter of the layer body over 'tensor' is gone, 8·(t−1) collective-permutes of
one chunk (b·s/t·h) stand in their place (4 decomposed collectives forward, 4 backward), and the wire bytes
per mesh axis are unchanged. The compiled train step (t = 4) shows the same per pass.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, assert_trees_close, tiny_config
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxscale.analysis import hlo, xla
from jaxscale.analysis.predict import predict_trainer
from jaxscale.config.read import ConfigError
from jaxscale.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jaxscale.training.trainer import Trainer

KV8 = "model.kv_heads=8"  # kv heads divisible by t = 8


# -- the two functions -------------------------------------------------------------------------------------


def _sp_pair(mesh, axis, decomposed: bool):
    """Column-parallel entry then row-parallel exit of a Megatron SP region, as a shard_map over ``mesh``."""

    def body(x, w1, w2):
        if decomposed:
            (h,) = all_gather_matmul(x, [("bse,ehd->bshd", w1)], axis, 1)
        else:
            h = jnp.einsum("bse,ehd->bshd", lax.all_gather(x, axis, axis=1, tiled=True), w1)
        h = jnp.tanh(h).reshape(*h.shape[:2], -1)
        if decomposed:
            return matmul_reduce_scatter("bsf,fe->bse", h, w2, axis, 1)
        return lax.psum_scatter(jnp.einsum("bsf,fe->bse", h, w2), axis, scatter_dimension=1, tiled=True)

    x_spec = P("data", axis, None)
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P(None, axis, None), P(axis, None)), out_specs=x_spec)


@pytest.mark.parametrize(
    ("shape", "axis"), [((2, 4), "tensor"), ((2, 2, 2), ("context", "tensor"))], ids=["tensor", "context+tensor"]
)
def test_functions_equal_the_plain_collectives(shape, axis):
    names = ("data", "tensor") if len(shape) == 2 else ("data", "context", "tensor")
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (4, 16, 8))  # [batch, sequence, embed]
    w1 = jax.random.normal(keys[1], (8, 4, 3))  # [embed, heads, head_dim], heads over the ring
    w2 = jax.random.normal(keys[2], (12, 8))  # [heads·head_dim, embed]

    def loss(fn):
        return lambda *args: jnp.sum(fn(*args) ** 2)

    plain, decomposed = _sp_pair(mesh, axis, False), _sp_pair(mesh, axis, True)
    np.testing.assert_allclose(jax.jit(decomposed)(x, w1, w2), jax.jit(plain)(x, w1, w2), rtol=RTOL, atol=1e-5)
    grad = jax.jit(jax.grad(loss(decomposed), argnums=(0, 1, 2)))
    assert_trees_close(grad(x, w1, w2), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w1, w2))
    # Forward and backward: 4 decomposed collectives of t − 1 = 3 permutes of one chunk [batch/2, sequence/4,
    # embed] each; besides them only the weight gradients' one all-reduce over data.
    found = hlo.collectives(grad.lower(x, w1, w2).compile().as_text(), mesh)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert len(permutes) == 12 and all(c.operand_bytes == 2 * 4 * 8 * 4 for c in permutes)
    assert [(c.kind, c.axes) for c in found if c not in permutes] == [("all-reduce", ("data",))]


# -- the whole model -----------------------------------------------------------------------------------------


class Run(NamedTuple):
    trainer: Trainer
    loss: float
    grads: dict
    found: list[hlo.Collective]


@pytest.fixture(scope="module")
def reference():
    """Parameters, batch, loss and gradients of one device."""
    trainer = Trainer.build(tiny_config(KV8, rules="dp"), jax.devices()[:1])
    state, batch = trainer.init_state(), trainer.batch(0)
    loss, grads = trainer.loss_and_grads(state.params, batch)
    return jax.device_get(state.params), jax.device_get(batch), float(loss), jax.device_get(grads)


# t = 2 with FSDP too: the weights' gather inside the shard_map and their gradients' reduce-scatter.
LAYOUTS = {2: ("fsdp_tp_sp", {"data": 2, "fsdp": 2, "tensor": 2}), 4: ("tp_sp", {"data": 2, "tensor": 4}),
           8: ("tp_sp", {"tensor": 8})}


def tp_sp(t: int, overlap: bool, reference) -> Run:
    """Loss and gradients of the reference's parameters and batch with ``t`` tensor devices (:data:`LAYOUTS`)."""
    params, batch, _, _ = reference
    rules, mesh = LAYOUTS[t]
    config = tiny_config(KV8, f"model.tp_overlap={str(overlap).lower()}", rules=rules, mesh=mesh)
    trainer = Trainer.build(config)
    params = jax.device_put(params, trainer.param_shardings())
    batch = jax.device_put(batch, trainer.batch_sharding)
    compiled = trainer.jit_loss_and_grads.lower(params, batch).compile()  # one compile: numbers and HLO
    loss, grads = compiled(params, batch)
    return Run(trainer, float(loss), grads, hlo.collectives(compiled.as_text(), trainer.mesh))


def chunk_bytes(trainer: Trainer) -> int:
    """b·(s/t)·h·4: one device's sequence chunk of the residual stream, fp32."""
    c, mesh = trainer.config, trainer.mesh
    b = c.train.global_batch // (mesh.shape["data"] * mesh.shape["fsdp"])
    return b * c.train.seq_len // mesh.shape["tensor"] * c.model.embed * 4


def layer_body(run: Run, kind: str) -> list[hlo.Collective]:
    """Collectives of ``kind`` over 'tensor' in the layer scans (forward and backward), at least a chunk big."""
    scan = hlo.in_loop(run.found, trips=run.trainer.config.model.layers)
    return [c for c in scan if c.kind == kind and c.axes == ("tensor",) and c.size >= chunk_bytes(run.trainer)]


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_overlap_gives_the_loss_and_gradients_of_plain_sp_and_one_device(t, reference):
    _, _, ref_loss, ref_grads = reference
    plain, overlap = tp_sp(t, False, reference), tp_sp(t, True, reference)
    for other_loss, other_grads in ((ref_loss, ref_grads), (plain.loss, plain.grads)):
        assert abs(overlap.loss - other_loss) <= RTOL * abs(other_loss)
        assert_trees_close(overlap.grads, other_grads)

    layers, chunk = overlap.trainer.config.model.layers, chunk_bytes(overlap.trainer)
    # Plain SP: per layer 2 all-gathers + 2 reduce-scatters of b·s·h forward, as many backward.
    assert len(layer_body(plain, "all-gather")) == len(layer_body(plain, "reduce-scatter")) == 4
    # Collective matmul: none left; 8 decomposed collectives of t − 1 permutes of one chunk each.
    assert not layer_body(overlap, "all-gather") and not layer_body(overlap, "reduce-scatter")
    permutes = layer_body(overlap, "collective-permute")
    assert len(permutes) == 8 * (t - 1) and all(c.size == chunk and c.runs == layers for c in permutes)
    # Their bytes: (t − 1)/t·b·s·h per decomposed collective, as the all-gathers and reduce-scatters moved;
    # and no mesh axis carries a byte more or less over the whole program (the weight gradients included).
    gathers_scatters = layer_body(plain, "all-gather") + layer_body(plain, "reduce-scatter")
    assert sum(c.wire_bytes for c in permutes) == sum(c.wire_bytes for c in gathers_scatters)
    assert sum(c.wire_bytes for c in permutes) == 8 * layers * (t - 1) * chunk
    by_axes = {k: v["wire_bytes"] for k, v in hlo.summarize(overlap.found)["by_axes"].items()}
    assert by_axes == {k: v["wire_bytes"] for k, v in hlo.summarize(plain.found)["by_axes"].items()}


def test_compiled_step_decomposes_both_passes():
    t = 4
    trainer = Trainer.build(tiny_config(KV8, "model.tp_overlap=true", rules="tp_sp", mesh={"data": 2, "tensor": t}))
    run = Run(trainer, 0.0, {}, hlo.collectives(xla.compile_step(trainer).as_text(), trainer.mesh))
    assert not layer_body(run, "all-gather") and not layer_body(run, "reduce-scatter")
    permutes = layer_body(run, "collective-permute")
    # Forward: qkv and gate/up entries, attention and MLP exits; backward: their transposes.
    assert sorted(c.phase for c in permutes) == ["backward"] * 4 * (t - 1) + ["forward"] * 4 * (t - 1)
    # The analytic model counts them so too (with the output head's): the same permute bytes.
    compiled = hlo.summarize(run.found)["by_kind"]["collective-permute"]["wire_bytes"]
    assert predict_trainer(trainer).comm["by_kind"]["collective-permute"] == compiled


def test_tp_overlap_without_sequence_parallelism_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.tp_overlap needs sequence parallelism: rules 'tp'"):
        Trainer.build(tiny_config("model.tp_overlap=true", rules="tp", mesh={"data": 2, "tensor": 4}))
