"""JAX's own sharding idioms inside a user model: the trainer's mesh is the context mesh while the model runs
(``jax.sharding.get_abstract_mesh()``, bare ``PartitionSpec``s in ``with_sharding_constraint``), and with
``mesh.axis_types: explicit`` the model's ``out_sharding=`` and ``jax.sharding.reshard`` work. The model is
written here as a user writes it from JAX's and Flax's docs: its mesh axis names read from the context mesh.
Auto axes equal one device (fp32, 1e-5); explicit axes equal auto axes (1e-6), size-1 mesh axes named in
its specs, and so does the built-in model; what explicit axes do not serve yet is refused in one line naming
both settings."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_trees_close, rel_err, tiny_config
from jax.sharding import PartitionSpec as P

import jaxscale
from jaxscale import nn
from jaxscale.config.read import ConfigError
from jaxscale.training.trainer import Trainer

SEEN: list[tuple[tuple[str, ...], bool, P | None]] = []  # per trace: the context mesh's axes, explicit, x's type


def pin(x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out as ``spec``: a constraint on auto axes, a reshard on explicit ones (JAX's two idioms)."""
    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


class Idiomatic(nnx.Module):
    """A two-layer transformer whose activations are pinned by bare PartitionSpecs of mesh axis names: the batch
    over ``data`` x ``fsdp``, heads and the MLP over ``tensor`` (whatever their sizes, 1 included); the MLP's
    projections through ``jaxscale.nn.einsum``, the embedding and the logits laid out by ``jaxscale.nn.constrain``."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        c = config.model
        e, h, d, m = c.embed, c.heads, c.head_dim, c.mlp
        init = nnx.initializers.normal(0.02)

        def param(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
            return nnx.Param(init(rngs.params(), shape), out_sharding=axes)

        self.table = param((c.vocab_size, e), ("vocab", "embed"))
        self.layers = nnx.List([
            nnx.Dict(wq=param((e, h, d), ("embed", "heads", "head_dim")),
                     wo=param((h, d, e), ("heads", "head_dim", "embed")),
                     up=param((e, m), ("embed", "mlp")), down=param((m, e), ("mlp", "embed")),
                     scale=nnx.Param(jnp.ones((e,)), out_sharding=("embed",)))
            for _ in range(c.layers)
        ])
        self.head = param((e, c.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        explicit = mesh.are_all_axes_explicit
        batch = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
        res, heads, hidden = P(batch, None, None), P(batch, None, "tensor", None), P(batch, None, "tensor")

        def out(spec: P) -> dict[str, P]:  # explicit axes: the contraction's output layout, as the docs teach
            return {"out_sharding": spec} if explicit else {}

        table = self.table[...]
        x = nn.constrain(table.at[tokens].get(out_sharding=res) if explicit else table[tokens], nn.RESIDUAL)
        SEEN.append((mesh.axis_names, explicit, jax.typeof(x).sharding.spec if explicit else None))
        for layer in self.layers:
            scale = jax.sharding.reshard(layer["scale"][...], P()) if explicit else layer["scale"][...]
            y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
            q = pin(jnp.einsum("ble,ehd->blhd", y, layer["wq"][...], **out(heads)), heads)
            mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
            scores = jnp.einsum("blhd,bmhd->bhlm", q, q, **out(P(batch, "tensor", None, None)))
            att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
            o = jnp.einsum("bhlm,bmhd->blhd", att, q, **out(heads))
            x = pin(x + jnp.einsum("blhd,hde->ble", o, layer["wo"][...], **out(res)), res)
            # jaxscale's own contraction: its output layout, on explicit axes, from the operands' (the rules').
            h = pin(jax.nn.gelu(nn.einsum("ble,em->blm", x, layer["up"][...])), hidden)
            x = pin(x + nn.einsum("blm,me->ble", h, layer["down"][...]), res)
        return nn.constrain(jnp.einsum("ble,ev->blv", x, self.head[...], **out(hidden)), nn.LOGITS)


def factory(config: jaxscale.Config, rngs: nnx.Rngs) -> nnx.Module:
    return Idiomatic(config, rngs)


LAYOUTS = {"dp": {"data": 8}, "zero3": {"fsdp": 8}, "fsdp_tp": {"fsdp": 4, "tensor": 2}}
RUNS: dict[tuple[str, str], tuple] = {}


@functools.cache
def one_device() -> tuple[float, Any]:
    """The model's loss and gradients at the initial parameters on batch 0 on one device: the reference (its
    train step is compiled for no test)."""
    trainer = Trainer.build(tiny_config("mesh.axis_types=auto", rules="dp"), jax.devices()[:1], model=factory)
    loss, grads = trainer.loss_and_grads(trainer.init_state().params, trainer.batch(0))
    return float(loss), jax.device_get(grads)


def run(rules: str, axis_types: str = "auto") -> tuple:
    """The model's trainer under ``rules``, its loss and gradients at the initial parameters on batch 0 and the
    state after one step (cached: each layout is built and compiled once)."""
    key = (rules, axis_types)
    if key not in RUNS:
        config = tiny_config(f"mesh.axis_types={axis_types}", rules=rules, mesh=LAYOUTS[rules])
        trainer = Trainer.build(config, model=factory)
        state = trainer.init_state()
        loss, grads = trainer.loss_and_grads(state.params, trainer.batch(0))
        new, metrics = trainer.step(state, trainer.batch(0))
        RUNS[key] = trainer, float(loss), jax.device_get(grads), jax.device_get(new.params), float(metrics["loss"])
    return RUNS[key]


@pytest.mark.parametrize("rules", LAYOUTS)
def test_bare_partition_specs_of_the_context_mesh_train_as_on_one_device(rules):
    ref_loss, ref_grads = one_device()
    SEEN.clear()
    trainer, loss, grads, _, step_loss = run(rules)
    assert rel_err(loss, ref_loss) <= 1e-5 and rel_err(step_loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)
    # auto stays the default
    assert trainer.mesh.axis_types == (jax.sharding.AxisType.Auto,) * len(trainer.mesh.axis_names)
    # The model read the trainer's mesh from the context, in every trace of it (init, gradients, the step).
    assert SEEN and {(names, explicit) for names, explicit, _ in SEEN} == {(trainer.mesh.axis_names, False)}


@pytest.mark.parametrize("rules", ["zero3", "fsdp_tp"])
def test_explicit_axes_equal_auto_axes(rules):
    _, auto_loss, auto_grads, auto_params, _ = run(rules)
    SEEN.clear()
    trainer, loss, grads, params, step_loss = run(rules, "explicit")
    assert trainer.mesh.axis_types == (jax.sharding.AxisType.Explicit,) * len(trainer.mesh.axis_names)
    assert 1 in trainer.mesh.shape.values()  # data (and tensor under zero3) of size 1, named in the specs
    # The sharding is the array's type: the residual stream's is the spec the model pinned.
    assert SEEN and {spec for _, explicit, spec in SEEN if explicit} == {P(("data", "fsdp"), None, None)}
    assert rel_err(loss, auto_loss) <= 1e-6 and rel_err(step_loss, auto_loss) <= 1e-6
    assert_trees_close(grads, auto_grads, 1e-6)
    assert_trees_close(params, auto_params, 1e-6)  # one optimizer step on explicit axes
    state = trainer.init_state()
    assert state.params["table"].sharding.spec == trainer.rules.spec(("vocab", "embed"))


@pytest.mark.parametrize("rules, mesh, overrides", [
    ("zero3", {"fsdp": 8}, ("model.loss_chunk=8",)),
    ("fsdp_tp_sp", {"fsdp": 4, "tensor": 2}, ()),
])
def test_the_built_in_model_on_explicit_axes_equals_auto_axes(rules, mesh, overrides):
    """jaxscale's own layers state the layouts jax's rules leave open: the projections, the embedding lookup, the
    norms' scales, the chunked loss; sequence parallelism's shard_maps run as they are."""
    runs = []
    for axis_types in ("auto", "explicit"):
        trainer = Trainer.build(tiny_config(f"mesh.axis_types={axis_types}", *overrides, rules=rules, mesh=mesh))
        assert trainer.mesh.axis_types == (jax.sharding.AxisType.Explicit if axis_types == "explicit" else
                                           jax.sharding.AxisType.Auto,) * len(trainer.mesh.axis_names)
        runs.append(trainer.loss_and_grads(trainer.init_state().params, trainer.batch(0)))
    (auto_loss, auto_grads), (loss, grads) = runs
    assert rel_err(loss, auto_loss) <= 1e-6
    assert_trees_close(grads, auto_grads, 1e-6)


REFUSED = {
    "pipeline stages": ((), "pp", {"stage": 2, "data": 4}),
    "context parallelism": ((), "cp", {"context": 2, "data": 4}),
    "experts": (("model.moe={}",), "dp", {"data": 8}),
    "fp8": (("precision.fp8=delayed",), "dp", {"data": 8}),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_explicit_axes_do_not_serve_is_refused_in_one_line_naming_both_settings(case):
    overrides, rules, mesh = REFUSED[case]
    config = tiny_config("mesh.axis_types=explicit", *overrides, rules=rules, mesh=mesh)
    with pytest.raises(ConfigError) as e:
        Trainer.build(config)
    line = str(e.value)
    assert "\n" not in line and line.startswith("mesh.axis_types=explicit with ") and "mesh.axis_types=auto" in line
    other = {"experts": "model.moe", "fp8": "precision.fp8=delayed"}
    assert other.get(case, f"rules '{rules}'") in line
