"""Research code brings its own model: a Flax NNX model written here, outside jaxscale, trained by the
rules tables (docs/models.md). Each layout gives the loss and every gradient of one device (fp32, 1e-5);
a user objective, a user optax optimizer laid out by ZeRO-1, checkpoints and bad input."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT, assert_trees_close, fails_early, rel_err, tiny_config

import jaxscale
from jaxscale import nn
from jaxscale.analysis.inspect import format_inspect, inspect_report
from jaxscale.checkpoint.store import Checkpointer
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer


class Block(nnx.Module):
    """Pre-norm block: LayerNorm with bias, attention through jaxscale.nn.attention, a GELU MLP."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        c = self.c = config.model
        e, h, d = c.embed, c.heads, c.head_dim
        self.norm1 = nnx.LayerNorm(e, scale_metadata={"out_sharding": ("embed",)},
                                   bias_metadata={"out_sharding": ("embed",)}, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.wqkv = nnx.Param(init(rngs.params(), (3, e, h, d)), out_sharding=(None, "embed", "heads", "head_dim"))
        self.wo = nnx.Param(init(rngs.params(), (h, d, e)), out_sharding=("heads", "head_dim", "embed"))
        self.norm2 = nnx.LayerNorm(e, scale_metadata={"out_sharding": ("embed",)},
                                   bias_metadata={"out_sharding": ("embed",)}, rngs=rngs)
        self.up = nnx.Linear(e, c.mlp, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_metadata={"out_sharding": ("mlp",)}, rngs=rngs)
        self.down = nnx.Linear(c.mlp, e, kernel_metadata={"out_sharding": ("mlp", "embed")},
                               bias_metadata={"out_sharding": ("embed",)}, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (nn.constrain(jnp.einsum("bse,ehd->bshd", self.norm1(x), w), nn.Q_AXES) for w in self.wqkv[...])
        out = nn.constrain(nn.attention(q, k, v, self.c), nn.Q_AXES)
        x = nn.constrain(x + jnp.einsum("bshd,hde->bse", out, self.wo[...]), nn.RESIDUAL)
        hidden = nn.constrain(jax.nn.gelu(self.up(self.norm2(x))), nn.MLP_AXES)
        return nn.constrain(x + self.down(hidden), nn.RESIDUAL)


class GPT(nnx.Module):
    """Plain form: learned positions, LayerNorms with bias, GELU MLPs, the head tied to the embedding."""

    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        c = config.model
        self.wte = nnx.Embed(c.vocab_size, c.embed, embedding_metadata={"out_sharding": ("vocab", "embed")},
                             rngs=rngs)
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.train.seq_len, c.embed)),
                             out_sharding=(None, "embed"))
        self.blocks = nnx.List([Block(config, rngs) for _ in range(c.layers)])
        self.norm = nnx.LayerNorm(c.embed, scale_metadata={"out_sharding": ("embed",)},
                                  bias_metadata={"out_sharding": ("embed",)}, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = nn.constrain(self.wte(tokens) + self.wpe[...][positions], nn.RESIDUAL)
        for block in self.blocks:
            x = block(x)
        return nn.constrain(self.wte.attend(self.norm(x)), nn.LOGITS)


def factory(config: jaxscale.Config, rngs: nnx.Rngs) -> nnx.Module:
    return GPT(config, rngs)


def build(*overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None, devices: int | None = None,
          **kwargs) -> Trainer:
    """The test model under ``rules`` (on all 8 devices as data parallelism unless ``mesh`` or ``devices``)."""
    chosen = None if devices is None else jax.devices()[:devices]
    mesh = mesh or ({"data": 8} if devices is None else None)
    return Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh), chosen, model=factory, **kwargs)


@pytest.fixture(scope="module")
def reference():
    """One device: the initial parameters, batch 0, its loss and gradients."""
    trainer = build(devices=1)
    params = jax.device_get(trainer.init_state().params)
    loss, grads = trainer.loss_and_grads(params, trainer.batch(0))
    return params, float(loss), jax.device_get(grads)


LAYOUTS = {
    "dp": ("dp", {"data": 8}, ()),
    "zero1": ("zero1", {"data": 8}, ()),
    "zero3": ("zero3", {"fsdp": 8}, ()),
    "fsdp_tp_sp": ("fsdp_tp_sp", {"fsdp": 4, "tensor": 2}, ()),
    "fsdp_cp": ("fsdp_cp", {"fsdp": 4, "context": 2}, ("model.attention=ring",)),
    # USP: jaxscale.nn.attention's all-to-alls over ulysses, the ring over context
    "usp": ("usp", {"fsdp": 2, "context": 2, "ulysses": 2}, ("model.attention=ring",)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_user_model_under_a_layout_gives_the_loss_and_gradients_of_one_device(name, reference):
    rules, mesh, overrides = LAYOUTS[name]
    trainer = build(*overrides, rules=rules, mesh=mesh)
    if name in ("fsdp_cp", "usp"):
        assert trainer.config.model.attention == "ring" and trainer.sequence_order is not None
    params, ref_loss, ref_grads = reference
    state = trainer.init_state()
    assert_trees_close(state.params, params)  # the same initial parameters, in this layout's shardings
    loss, grads = trainer.loss_and_grads(state.params, trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)
    table = state.params["wte"]["embedding"].sharding.spec
    assert table == trainer.rules.spec(("vocab", "embed"))  # the layout the rules give Flax's own metadata


def z_objective(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy plus a z-loss on the logits, the z-loss as a metric."""
    logits = model(batch["inputs"], batch["positions"]).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    ce = jnp.mean(lse - jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0])
    z = jnp.mean(lse**2)
    return ce + 1e-2 * z, {"z": z}


@pytest.mark.slow
def test_a_user_objective_gives_its_loss_gradients_and_metrics_under_zero3(reference):
    params, _, _ = reference
    trainer = build("train.microbatches=2", rules="zero3", mesh={"fsdp": 8}, objective=z_objective)
    batch = trainer.batch(0)
    host = jax.device_get(batch)
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(trainer.config, nnx.Rngs(0))))

    def expected(p):  # the objective by hand, on one device, no trainer
        return z_objective(nnx.merge(graphdef, p), host)

    (ref_loss, ref_metrics), ref_grads = jax.jit(jax.value_and_grad(expected, has_aux=True))(params)
    loss, grads = trainer.loss_and_grads(trainer.init_state().params, batch)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)
    _, metrics = jax.jit(trainer.loss_and_metrics)(params, host)
    assert rel_err(metrics["z"], ref_metrics["z"]) <= 1e-5


def test_a_user_optimizer_state_follows_the_zero1_rules(reference):
    params, _, ref_grads = reference
    lr = 0.1
    trainer = build(rules="zero1", mesh={"data": 8}, optimizer=optax.sgd(lr, momentum=0.9))
    state = trainer.init_state()
    momentum = state.opt_state[0].trace
    # zero1: the optimizer section puts 'embed' on data x fsdp (8 devices); the parameters stay whole.
    named = jax.tree_util.tree_flatten_with_path(trainer.axes, is_leaf=lambda a: isinstance(a, tuple))[0]
    sizes = [np.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(params)]
    want = sum(n // (8 if "embed" in axes else 1) for n, (_, axes) in zip(sizes, named, strict=True))
    have = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(momentum))
    assert have == want < sum(sizes)
    assert sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params)) == sum(sizes)
    new, metrics = trainer.step(state, trainer.batch(0))
    assert "lr" not in metrics  # the rate is the optimizer's own
    # SGD's first step with momentum: p - lr * g.
    assert_trees_close(new.params, jax.tree.map(lambda p, g: p - lr * g, params, ref_grads))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """Three steps straight, and the same run stopped after two and resumed; checkpoints every step."""
    run_dir = tmp_path_factory.mktemp("own")
    trainer = build("train.steps=3", "checkpoint.every=1", f"run_dir={run_dir}")
    step = trainer.compiled_guarded_step[0]
    straight = trainer.init_state()
    for i in range(3):
        straight, _ = step(straight, trainer.batch(i))
    fit(trainer, progress=False, stop_at=2)
    trainer.config.checkpoint.resume = "required"  # a loop-only setting: the same compiled trainer
    resumed, history = fit(trainer, progress=False)
    return trainer, run_dir, jax.device_get(straight), jax.device_get(resumed), history


@pytest.mark.slow
def test_a_user_model_resumes_bit_for_bit(checkpointed):
    trainer, _, straight, resumed, history = checkpointed
    assert int(resumed.step) == 3
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    # No formula for this model: MFU counts the compiled step's FLOPs, at least the 6·N·D of its matmuls.
    logged = [r for r in history if "mfu" in r]
    assert logged and logged[-1]["mfu"] > 0
    t = trainer.config.train
    matmul = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(straight.params) if leaf.ndim >= 2)
    assert trainer.flops_per_step >= 6 * (matmul - t.seq_len * trainer.config.model.embed) * t.global_batch * t.seq_len


@pytest.mark.slow
def test_inspect_reports_a_user_model(checkpointed):
    trainer = checkpointed[0]
    report = inspect_report(trainer, trainer.compiled_guarded_step[0])
    row = next(p for p in report["params"] if p["path"] == "wte.embedding")
    assert row["axes"] == ["vocab", "embed"] and report["model"]["builtin"] is False
    assert "note: a model of your own" in format_inspect(report)


@pytest.mark.slow
def test_a_user_model_checkpoint_restores_onto_another_layout(checkpointed):
    _, run_dir, _, resumed, _ = checkpointed
    other = build("train.steps=3", rules="fsdp_tp_sp", mesh={"fsdp": 2, "tensor": 2}, devices=4)
    restored = Checkpointer(str(run_dir / "checkpoints")).restore(other.abstract_state())
    assert restored.step == 3
    for a, b in zip(jax.tree.leaves(jax.device_get(restored.state.params)), jax.tree.leaves(resumed.params),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert restored.state.params["blocks"][0]["up"]["kernel"].sharding.spec == other.rules.spec(("embed", "mlp"))


def example(name: str):
    """A module of examples/ (outside the package), imported from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIPELINED = ("train.global_batch=32", "model.layers=8")
PIPELINES = {  # rules, mesh, schedule, microbatches, repeats
    "1f1b-p2": ("pp", {"stage": 2, "data": 4}, "1f1b", 4, 1),
    "1f1b-p4": ("pp", {"stage": 4, "data": 2}, "1f1b", 4, 1),
    "interleaved-p2": ("pp", {"stage": 2, "data": 4}, "interleaved_1f1b", 4, 2),
    "interleaved-p4": ("pp", {"stage": 4, "data": 2}, "interleaved_1f1b", 4, 2),
    "pp_fsdp_tp": ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, "1f1b", 2, 1),
}


@pytest.fixture(scope="module")
def richer():
    """examples/parallel_block.py's model (richer form) on one device: parameters, batch 0, loss, gradients."""
    model = example("parallel_block").ParallelLM
    trainer = Trainer.build(tiny_config(*PIPELINED), jax.devices()[:1], model=model)
    params = jax.device_get(trainer.init_state().params)
    batch = jax.device_get(trainer.batch(0))
    loss, grads = trainer.loss_and_grads(params, batch)
    return model, params, batch, float(loss), jax.device_get(grads)


@pytest.mark.parametrize("name", PIPELINES)
def test_a_user_model_in_the_richer_form_pipelines_as_one_device(name, richer):
    model, params, batch, ref_loss, ref_grads = richer
    rules, mesh, schedule, m, v = PIPELINES[name]
    pipe = [f"pipeline.schedule={schedule}", f"pipeline.microbatches={m}", f"pipeline.repeats={v}"]
    trainer = Trainer.build(tiny_config(*PIPELINED, *pipe, rules=rules, mesh=mesh), model=model)
    placed = jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))
    stored = jax.device_put(trainer.storage.place_params(params), trainer.param_shardings())  # chunks' order
    loss, grads = trainer.loss_and_grads(stored, placed)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(trainer.storage.canonical_params(jax.device_get(grads)), ref_grads)


def test_the_metrics_channel_adds_a_weighted_auxiliary_loss():
    """A richer-form model's ``hidden`` metrics are logged and ``aux_loss`` weighs them into the default objective."""
    base = example("parallel_block").ParallelLM

    class WithAux(base):
        def hidden(self, tokens, positions):
            h, _ = super().hidden(tokens, positions)
            return h, {"square": jnp.mean(h.astype(jnp.float32) ** 2)}

        def aux_loss(self, metrics):
            return 0.5 * metrics["square"]

    trainer = Trainer.build(tiny_config(), jax.devices()[:1], model=WithAux)
    params, batch = trainer.init_state().params, jax.device_get(trainer.batch(0))
    loss, metrics = jax.jit(trainer.loss_and_metrics)(params, batch)
    model = nnx.merge(trainer.graphdef, params)
    h, _ = base.hidden(model, batch["inputs"], batch["positions"])
    logits = np.asarray(h @ model.lm_head[...], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = np.mean(lse - np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0])
    square = np.mean(np.asarray(h, np.float64) ** 2)
    assert rel_err(metrics["square"], square) <= 1e-5
    assert rel_err(loss, ce + 0.5 * square) <= 1e-5


class Unnamed(nnx.Module):
    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        self.wte = nnx.Embed(config.model.vocab_size, 8, embedding_metadata={"out_sharding": ("vocab", "embed")},
                             rngs=rngs)
        self.proj = nnx.Linear(8, config.model.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.proj(self.wte(tokens))


class Misnamed(Unnamed):
    def __init__(self, config: jaxscale.Config, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.proj = nnx.Linear(8, config.model.vocab_size, use_bias=False,
                               kernel_metadata={"out_sharding": ("embed", "vocabulary")}, rngs=rngs)


def broken(config: jaxscale.Config, rngs: nnx.Rngs) -> nnx.Module:
    raise ValueError("the width must be even")


@pytest.mark.parametrize(
    "model, rules, mesh, extra, match",
    [
        (Unnamed, "dp", {"data": 8}, {}, r"^param proj\.kernel \(8, 256\) has no logical axis names"),
        (Misnamed, "dp", {"data": 8}, {},
         r"^param proj\.kernel: logical axis 'vocabulary' is not in rules table 'dp'"),
        (GPT, "pp", {"stage": 2, "data": 4}, {},
         r"^rules 'pp' \(layers on stage: 2 pipeline stages\) asks for pipeline parallelism: model GPT lacks "
         "config, embedding, embed, final_norm, logits, head_weight, aux_loss"),
        (GPT, "dp", {"data": 8}, {"overrides": ("model.loss_chunk=8",)},
         r"^model\.loss_chunk=8 asks for the chunked loss \(model\.loss_chunk > 0\): model GPT lacks hidden, "
         "head_weight"),
        (example("parallel_block").ParallelLM, "pp", {"stage": 2, "data": 4}, {"objective": z_objective},
         r"^rules 'pp' \(layers on stage: 2 pipeline stages\): a custom objective cannot run in the pipeline's loop"),
        (broken, "dp", {"data": 8}, {}, r"^model factory broken raised ValueError: the width must be even"),
    ],
    ids=["unnamed", "unknown-name", "plain-form-pipelined", "plain-form-chunked", "objective-pipelined",
         "factory-raises"],
)
def test_bad_models_fail_in_one_line_before_compiling(model, rules, mesh, extra, match):
    config = tiny_config(*extra.get("overrides", ()), rules=rules, mesh=mesh)
    with fails_early(match):
        Trainer.build(config, model=model, objective=extra.get("objective"))


def test_no_module_outside_the_models_names_llama():
    """The trainer, loss, pipeline, checkpoint and analysis code reach the built-in models through the
    contract (jaxscale/models/contract.py): no import of, or attribute named, ``Llama`` outside jaxscale/models/."""
    found = []
    for path in sorted((ROOT / "jaxscale").rglob("*.py")):
        if Path("jaxscale", "models") in path.relative_to(ROOT).parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom | ast.Import) else []
            names += [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else []
            if any(n == "Llama" or n.endswith(".Llama") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "Llama named outside jaxscale/models/: " + ", ".join(found)
