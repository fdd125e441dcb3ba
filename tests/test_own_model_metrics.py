"""A user model's own metrics through a pipeline (docs/models.md, the metrics channel): a richer-form model written
here, whose stacked unit has a learned per-layer residual scale ``alpha`` (a scalar per layer,
``nnx.Param(..., out_sharding=())``) and returns its own metrics, weighed into the loss by ``aux_loss``. Under
1F1B, interleaved 1F1B and ZB-H1 its loss, metrics and every gradient equal one device's (fp32, 1e-5), whether it
reduces its units' metrics by its own ``stack_metrics`` (a sum over the layers), its ``prefix`` returning a
metric of its own too, or by the default (each key's mean over the layers) and reads them with ``metrics.get``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, fails_early, rel_err, tiny_config

import jaxscale
from jaxscale import nn
from jaxscale.training.trainer import Trainer


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape), out_sharding=names)


class ScaledBlock(nnx.Module):
    """A pre-norm block whose attention and MLP branches are scaled by a learned per-layer ``alpha``; its metrics:
    ``alpha_sq`` (alpha²) and ``update_sq`` (the mean square of the scaled update, which depends on the rows)."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        c = self.c = config.model
        self.norm = nn.RMSNorm(c.embed, eps=c.norm_eps)
        self.wqkv = param(rngs, (3, c.embed, c.heads, c.head_dim), (None, "embed", "heads", "head_dim"))
        self.wo = param(rngs, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"))
        self.w_up = param(rngs, (c.embed, c.mlp), ("embed", "mlp"))
        self.w_down = param(rngs, (c.mlp, c.embed), ("mlp", "embed"))
        self.alpha = nnx.Param(0.5 + 0.2 * jax.random.normal(rngs.params(), ()), out_sharding=())

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        h = self.norm(x)
        q, k, v = (nn.constrain(nn.rope(jnp.einsum("bse,ehd->bshd", h, w), positions, self.c.rope_theta), nn.Q_AXES)
                   for w in self.wqkv[...])
        attn = jnp.einsum("bshd,hde->bse", nn.constrain(nn.attention(q, k, v, self.c), nn.Q_AXES), self.wo[...])
        mlp = jax.nn.gelu(nn.constrain(h @ self.w_up[...], nn.MLP_AXES)) @ self.w_down[...]
        update = self.alpha[...] * (attn + mlp)
        metrics = {"alpha_sq": self.alpha[...] ** 2, "update_sq": jnp.mean(jnp.square(update))}
        return nn.constrain(x + update, nn.RESIDUAL), metrics


class ScaledLM(nnx.Module):
    """The richer form; its units' metrics reduced by the default rule (each key's mean over the layers, no
    ``stack_metrics``), read with ``metrics.get``."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        c = self.config = config.model
        self.embedding = param(rngs, (c.vocab_size, c.embed), ("vocab", "embed"))

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> ScaledBlock:
            return ScaledBlock(config, rngs)

        self.blocks = stack(rngs)
        self.final_norm = nn.RMSNorm(c.embed, eps=c.norm_eps)
        self.lm_head = param(rngs, (c.embed, c.vocab_size), ("embed", "vocab"))

    def embed(self, tokens: jax.Array) -> jax.Array:
        return nn.constrain(jnp.take(self.embedding[...], tokens, axis=0), nn.RESIDUAL)

    def reduced(self, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: jnp.mean(a, axis=0) for k, a in stacked.items()}

    def hidden(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(x: jax.Array, block: ScaledBlock) -> tuple[jax.Array, dict[str, jax.Array]]:
            return block(x, positions)

        x, metrics = self.embed(tokens), {}
        if hasattr(self, "prefix"):
            x, metrics = self.prefix(x, positions)
        x, stacked = run(x, self.blocks)
        return self.final_norm(x), {**metrics, **self.reduced(stacked)}

    def head_weight(self) -> jax.Array:
        return self.lm_head[...]

    def logits(self, x: jax.Array) -> jax.Array:
        return nn.constrain(x @ self.head_weight(), nn.LOGITS)

    def aux_loss(self, metrics: dict[str, jax.Array]) -> jax.Array:
        return 0.1 * metrics.get("alpha_sq", 0.0) + 0.5 * metrics.get("update_sq", 0.0)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.logits(self.hidden(tokens, positions)[0])


class SummedLM(ScaledLM):
    """The same model with its own reduction, a sum over the layers (``stack_metrics``), a learned gain on the
    embedding in its ``prefix`` with its own metric, and an ``aux_loss`` that reads its keys as they are."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.beta = nnx.Param(jnp.asarray(1.2), out_sharding=())

    def prefix(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self.beta[...] * x, {"beta_sq": self.beta[...] ** 2}

    def stack_metrics(self, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: jnp.sum(a, axis=0) for k, a in stacked.items()}

    def reduced(self, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self.stack_metrics(stacked)

    def aux_loss(self, metrics: dict[str, jax.Array]) -> jax.Array:
        return 0.1 * metrics["alpha_sq"] + 0.5 * metrics["update_sq"] + 0.3 * metrics["beta_sq"]


MODELS = {"summed-prefix": SummedLM, "mean-get": ScaledLM}
SMALL = ("model.embed=32", "model.mlp=64", "model.heads=4", "model.kv_heads=4", "model.layers=8",
         "train.global_batch=16")
PIPELINES = {  # mesh, schedule, microbatches, repeats, more settings
    "1f1b-p4": ({"stage": 4, "data": 2}, "1f1b", 4, 1, ()),
    "interleaved-p2": ({"stage": 2, "data": 4}, "interleaved_1f1b", 4, 2, ()),
    "zb_h1-p2": ({"stage": 2, "data": 4}, "zb_h1", 4, 1, ()),
    "1f1b-uneven": ({"stage": 2, "data": 4}, "1f1b", 4, 1, ("pipeline.layers_per_stage=[3, 5]",)),  # unused slots
}


def placed(trainer: Trainer, params, batch) -> tuple:
    """Host parameters (the model's layer order) and a host batch in ``trainer``'s storage and layout."""
    stored = jax.device_put(trainer.storage.place_params(params), trainer.param_shardings())
    return stored, jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))


def measured(trainer: Trainer, params, batch) -> tuple:
    """Loss, gradients (the model's layer order) and metrics of one batch under ``trainer``'s layout."""
    loss, grads, metrics = trainer._jit(lambda p, b: trainer._grads(p, b)[:3])(*placed(trainer, params, batch))
    return float(loss), trainer.storage.canonical_params(jax.device_get(grads)), jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference():
    """Per model, one device: its parameters, batch 0, loss, gradients and metrics."""
    cache = {}

    def get(name: str) -> tuple:
        if name not in cache:
            trainer = Trainer.build(tiny_config(*SMALL), jax.devices()[:1], model=MODELS[name])
            params, batch = jax.device_get(trainer.init_state().params), jax.device_get(trainer.batch(0))
            cache[name] = (params, batch, *measured(trainer, params, batch))
        return cache[name]

    return get


@pytest.mark.parametrize("model", MODELS)
def test_one_device_reduces_and_weighs_the_units_metrics_as_the_model_says(model, reference):
    """The reference itself, against the formula: alpha² of every layer summed (or averaged), weighed into the loss."""
    params, batch, loss, _, metrics = reference(model)
    alpha = np.asarray(params["blocks"]["alpha"], np.float64)
    assert alpha.shape == (8,) and np.ptp(alpha) > 0.05  # a scalar per layer, each its own
    reduce = np.sum if model == "summed-prefix" else np.mean
    assert rel_err(metrics["alpha_sq"], reduce(alpha**2)) <= 1e-6
    beta_sq = 1.44 if model == "summed-prefix" else 0.0
    assert rel_err(metrics.get("beta_sq", 0.0), beta_sq) <= 1e-6
    trainer = Trainer.build(tiny_config(*SMALL), jax.devices()[:1], model=MODELS[model])
    plain = jax.jit(lambda p, b: nnx.merge(trainer.graphdef, p).hidden(b["inputs"], b["positions"]))
    _, own = plain(params, batch)
    assert rel_err(metrics["update_sq"], own["update_sq"]) <= 1e-6
    ce = loss - 0.1 * float(metrics["alpha_sq"]) - 0.5 * float(metrics["update_sq"]) - 0.3 * beta_sq
    assert 5.0 < ce < 6.0  # ln 256 = 5.55: the loss is the cross-entropy plus the weighed metrics


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("model", MODELS)
def test_a_models_own_metrics_pipeline_as_one_device(model, name, reference):
    params, batch, ref_loss, ref_grads, ref_metrics = reference(model)
    mesh, schedule, m, v, more = PIPELINES[name]
    pipe = [f"pipeline.schedule={schedule}", f"pipeline.microbatches={m}", f"pipeline.repeats={v}", *more]
    trainer = Trainer.build(tiny_config(*SMALL, *pipe, rules="pp", mesh=mesh), model=MODELS[model])
    assert trainer.rules.spec(trainer.axes["blocks"]["alpha"]) == jax.sharding.PartitionSpec("stage")
    loss, grads, metrics = measured(trainer, params, batch)
    assert set(metrics) == set(ref_metrics) >= {"alpha_sq", "update_sq"}
    for k in ref_metrics:
        assert rel_err(metrics[k], ref_metrics[k]) <= 1e-5, k
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)
    assert float(np.abs(grads["blocks"]["alpha"]).min()) > 0  # every layer's alpha trained, the penalty included
    if name == "1f1b-p4":  # evaluation: the forward table, the prefix's and units' shares in its forward slots
        assert rel_err(trainer.jit_eval_loss(*placed(trainer, params, batch)), ref_loss) <= 1e-5


class Unstacked(ScaledLM):
    """A scalar per layer written outside any stacked unit: ``out_sharding=()`` on a vector of its own."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.gains = nnx.Param(jnp.ones((config.model.layers,)), out_sharding=())


def test_a_scalar_per_layer_is_laid_out_on_layers_and_a_loose_one_refused():
    trainer = Trainer.build(tiny_config(*SMALL), jax.devices()[:1], model=ScaledLM)
    assert trainer.axes["blocks"]["alpha"] == ("layers",)
    model, batch = nnx.merge(trainer.graphdef, trainer.init_state().params), trainer.batch(0)
    for _ in range(2):  # nnx.scan over the stack takes the axis off and gives it back, each time
        model.hidden(batch["inputs"][:2], batch["positions"][:2])
        assert model.blocks.alpha.get_metadata()["out_sharding"] == ("layers",)
    with fails_early(r"^param gains \(8,\): logical axis names \(\) are not one name or None per dimension "
                     r"\(give out_sharding 1 entries"):
        Trainer.build(tiny_config(*SMALL), jax.devices()[:1], model=Unstacked)
