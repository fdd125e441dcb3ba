"""The DeepSeek-V3-style model (jaxscale/models/deepseek.py: multi-head latent attention, dense then MoE blocks
with group-limited routing and shared experts, multi-token prediction) under the layouts: each gives the loss and
every gradient of one device (fp32, 1e-5); its MTP loss honours loss masks and packed documents."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, fails_early, rel_err
from jax.ad_checkpoint import print_saved_residuals

from jaxscale.analysis import hlo, plan, strategy, timing, xla
from jaxscale.analysis.activations import layer_residuals
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.params import param_table
from jaxscale.analysis.predict import predict_trainer
from jaxscale.analysis.strategy import placement
from jaxscale.config import flops
from jaxscale.config.read import Config, ConfigError, load_config, read_yaml, resolve_named
from jaxscale.layout.sharding import use_rules
from jaxscale.models import balance
from jaxscale.models.deepseek import DeepSeek
from jaxscale.training.trainer import Trainer, abstract_model

TRAIN = ["train.global_batch=16", "train.seq_len=32", "train.steps=2", "train.warmup_steps=1",
         "train.learning_rate=0.01", "data.max_bytes=200000"]


def config(*overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None) -> Config:
    """The tiny DeepSeek-V3-style model (configs/models/deepseek-v3-tiny.yaml) under ``rules`` on ``mesh``."""
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 1, **(mesh or {})}
    return load_config(None, ["model=deepseek-v3-tiny", *TRAIN, f"rules={rules}",
                              *(f"mesh.{k}={v}" for k, v in sizes.items()), *overrides])


def one_device(*overrides: str) -> tuple:
    """One device: the initial parameters, batch 0, its loss and gradients."""
    trainer = Trainer.build(config(*overrides), jax.devices()[:1])
    params = jax.device_get(trainer.init_state().params)
    loss, grads = trainer.loss_and_grads(params, trainer.batch(0))
    return params, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    return one_device()


def same_as_one_device(trainer: Trainer, reference: tuple) -> None:
    """The trainer's loss and gradients at the reference's parameters on its own batch 0 (the same tokens: under
    ring attention in zig-zag order, positions following)."""
    params, ref_loss, ref_grads = reference
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)


LAYOUTS = {
    "zero3": ("zero3", {"fsdp": 8}, ()),
    "ep_fsdp": ("ep_fsdp", {"expert": 4, "fsdp": 2}, ()),
    "ep_fsdp_tp": ("ep_fsdp_tp", {"expert": 2, "fsdp": 2, "tensor": 2}, ()),
    "fsdp_cp": ("fsdp_cp", {"fsdp": 4, "context": 2}, ("model.attention=ring", "model.attention_block=8")),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "zero3" else pytest.mark.slow) for n in LAYOUTS])
def test_deepseek_under_a_layout_gives_the_loss_and_gradients_of_one_device(name, reference):
    rules, mesh, overrides = LAYOUTS[name]
    trainer = Trainer.build(config(*overrides, rules=rules, mesh=mesh))
    if name == "fsdp_cp":  # ring attention through MLA's shapes: queries and keys 24 wide, values 16
        assert trainer.config.model.attention == "ring" and trainer.sequence_order is not None
    same_as_one_device(trainer, reference)


def step_of(trainer: Trainer, params: dict, bias: dict) -> tuple:
    """Loss, gradients and the routing biases after the step's update, at ``params`` and ``bias`` on batch 0."""
    grads = trainer._jit(lambda p, b, bias: trainer._grads(p, b, None, bias))
    loss, grads, aux, _ = grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0), bias)
    update = balance.updated(bias, aux["moe_layers"], trainer.config.model.moe)
    return float(loss), jax.device_get(grads), jax.device_get(update)


@pytest.mark.slow
def test_deepseek_pipelines_1f1b_as_one_device(reference):
    """The whole tiny model under 1F1B on 2 stages (the dense block with the embedding on the first, one MoE block
    on each, MTP with the head on the last), experts split over ``expert`` inside each stage (pp_ep: 2 x 2 data),
    bias balancing on from a random bias: loss, every gradient and the bias update of one device on the same 4
    microbatches (the routing statistics, and so the load-balance loss and the loads, are per microbatch)."""
    one = Trainer.build(config("train.microbatches=4"), jax.devices()[:1])
    params = reference[0]  # the initial parameters (microbatches do not change them)
    rng = np.random.default_rng(0)
    bias = jax.tree.map(lambda a: jnp.asarray(rng.normal(scale=0.05, size=a.shape), a.dtype), one.fresh_balance())
    assert jax.tree.structure(bias) == jax.tree.structure({"blocks": {"routed": {"bias": 0}},
                                                           "mtp": {0: {"block": {"routed": {"bias": 0}}}}})
    pipe = ("pipeline.schedule=1f1b", "pipeline.microbatches=4", "model.moe.impl=partitioner")
    pp = Trainer.build(config(*pipe, rules="pp_ep", mesh={"stage": 2, "expert": 2, "data": 2}))
    assert pp.param_shardings()["blocks"]["routed"]["w_gate"].spec[:2] == ("stage", "expert")
    (loss, grads, update), (ref_loss, ref_grads, ref_update) = step_of(pp, params, bias), step_of(one, params, bias)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)
    assert_trees_close(update, ref_update)


def packed_rows() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Two rows of 16 inputs cut from streams of 17 tokens, as the data path makes them: row 0 one document, a
    prompt (tokens 1-5 not trained) and padding (tokens 14-16); row 1 packed documents starting at tokens 0, 5,
    11 and 16 (the row's last target), token 9 not trained; positions restart at each document, whose first
    token is no target. Returns the batch, the streams, whether each token is trained, each token's document."""
    tokens = np.random.default_rng(3).integers(0, 256, (2, 17)).astype(np.int32)
    trained = np.ones((2, 17), bool)
    trained[0, 1:6] = trained[0, 14:] = trained[1, 9] = False
    starts = [np.array([0]), np.array([0, 5, 11, 16])]
    doc = np.stack([np.searchsorted(row, np.arange(17), side="right") for row in starts])
    positions = np.stack([np.arange(17) - row[d - 1] for row, d in zip(starts, doc, strict=True)])
    keep = trained[:, 1:] & (positions[:, 1:] != 0)
    batch = {"inputs": tokens[:, :16], "positions": positions[:, :16].astype(np.int32),
             "targets": np.where(keep, tokens[:, 1:], -1).astype(np.int32)}
    return batch, tokens, trained, doc


def with_documents(cfg: Config) -> Config:
    """``cfg`` with data.documents on (the model's view; there is no prepare-data directory to read them from)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, documents=True))


def test_mtp_loss_honours_loss_masks_and_documents():
    """MTP depth 1 at token t predicts token t+2: its loss is the mean over the t whose token t+2 is in the stream,
    trained, and in t's document of -log p(token t+2), written here over the depth's log-probabilities (the MTP
    module run on the stack's output and the embedding of each token's next, its head's log-softmax)."""
    with nnx.use_eager_sharding(False):
        graph, state = nnx.split(DeepSeek(with_documents(config("model.layers=2")), nnx.Rngs(0)))
    batch, tokens, trained, doc = packed_rows()

    @jax.jit
    def run(state: nnx.State, batch: dict, after: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graph, state)
        y, _ = model.trunk(batch["inputs"], batch["positions"])
        _, normed, _ = model.mtp[0](y, model.embed(after), batch["positions"])
        return model.ahead(y, batch)["mtp_loss"], jax.nn.log_softmax(model.logits(normed))

    after = np.concatenate([tokens[:, 1:16], tokens[:, 15:16]], axis=1)  # the next token (the row's last: any)
    mtp_loss, logp = run(state, batch, after)
    picked = [-logp[b, t, tokens[b, t + 2]] for b in range(2) for t in range(15)
              if trained[b, t + 2] and doc[b, t] == doc[b, t + 2]]
    assert len(picked) == 17  # of 30: row 0's t = 4..11; row 1's 0-2, 5, 6, 8, 11-13
    assert rel_err(mtp_loss, np.mean(picked)) <= 1e-5


def test_deepseek_refuses_what_it_cannot_run_in_one_line():
    rngs = nnx.Rngs(0)
    # MTP with documents under ring attention: refused where the trainer's rules zig-zag the rows over a ring of 2
    # or more (tests/test_refusals.py), not by the model, which runs it where rows stay in order (Ulysses alone:
    # tests/test_ulysses.py).
    with nnx.use_eager_sharding(False):
        DeepSeek(with_documents(config("model.attention=ring")), rngs)
    with fails_early(r"^rules 'pp' \(layers on stage: 2 pipeline stages\): precision\.fp8=current with model "
                     r"build's prefix or ahead"):
        Trainer.build(config("precision.fp8=current", "model.moe.impl=partitioner", rules="pp",
                             mesh={"stage": 2, "data": 4}))
    for override, match in [("model.deepseek.qk_rope_head_dim=7", r"qk_rope_head_dim \(7\) must be even"),
                            ("model.deepseek.dense_layers=3", r"dense_layers \(3\) must be below model\.layers"),
                            ("model.deepseek.mtp_loss_weight=nan", r"^model\.deepseek\.mtp_loss_weight must be"),
                            ("model.moe=null", r"^model\.deepseek: needs model\.moe")]:
        with pytest.raises(ConfigError, match=match):
            config(override)


def test_the_full_deepseek_v3_config_has_its_671b_parameters():
    """configs/models/deepseek-v3-671b.yaml's shapes: DeepSeek-V3's technical report counts 671B parameters in the
    main model; the MTP module (one MoE layer, its projection and norms; its embedding and head are the shared
    ones) adds 11.6B."""
    model = load_config(None, ["model=deepseek-v3-671b"]).model
    shapes = jax.tree_util.tree_flatten_with_path(abstract_model(load_config(None, ["model=deepseek-v3-671b"]))[1])[0]
    total = sum(math.prod(a.shape) for _, a in shapes)
    mtp = sum(math.prod(a.shape) for path, a in shapes if path[0].key == "mtp")
    assert (total - mtp, mtp) == (671_026_404_352, 11_610_067_968)
    assert flops.param_count(model)["total"] == total and flops.param_count(model)["mtp"] == mtp  # the planner's


def test_deepseek_flops_per_token_count_the_active_experts_and_mla():
    """6 x the matmul weights a token goes through (MLA's five projections, the dense MLPs, the router, its 8 of
    256 routed experts and the shared one, the MTP projection and the head once per prediction depth more) plus
    causal attention, 3·s·heads·(qk + v) per layer run (the MTP block too), written out for DeepSeek-V3."""
    e, heads, qk, v, seq = 7168, 128, 192, 128, 4096
    mla = e * 1536 + 1536 * heads * qk + e * (512 + 64) + 512 * heads * (128 + v) + heads * v * e
    moe = e * 256 + 3 * e * 2048 * (8 + 1)
    active = 62 * mla + 3 * 3 * e * 18432 + 59 * moe + 2 * e * e + 2 * e * 129280
    expected = 6 * active + 3 * seq * heads * (qk + v) * 62
    model = load_config(None, ["model=deepseek-v3-671b"]).model
    assert flops.flops_per_token(model, seq) == expected
    assert round(active / 1e9, 1) == 38.2  # the report's 37B active, plus the MTP block and a second head


def test_the_step_times_matmuls_are_the_models_flops():
    """The planner's time model runs MLA's five projections, the dense and MoE layers (8 routed experts of 256 and
    the shared one) and the MTP block per token: 2 x the matmul weights flops.py counts, less the routers'."""
    m = load_config(None, ["model=deepseek-v3-671b"]).model
    tokens, e = 1000, m.embed
    layers = sum(c * 2 * mm * n * k for c, mm, n, k in timing._matmuls(m, placement(plan.Strategy()), tokens))
    heads = 2 * tokens * (2 * e * m.vocab_size + 2 * e * e)  # the head twice (MTP), MTP's projection
    routers = 2 * tokens * e * m.moe.experts * (m.layers - m.deepseek.dense_layers + 1)
    assert layers * 62 + heads + routers == pytest.approx(2 * tokens * flops.param_count(m)["matmul"], rel=1e-9)


def test_plan_ranks_deepseek_layouts_with_a_reason():
    """The planner's analytic model takes DeepSeek's shapes: the 671B's state on 512 H100s under one layout fits and
    its per-device parameters are the config's divided as the rules shard them; the tiny model's plan ranks layouts
    (no pipeline: its dense block and MTP are not pipelined) and states the exchange's assumed imbalance."""
    big = load_config(None, ["model=deepseek-v3-671b"]).model
    cluster = load_cluster("h100", ["nodes=64"])
    layout = plan.Strategy(fsdp=16, expert=4, tensor=8, sequence=True, remat="full", micro_batch=2, accumulation=32)
    found = plan.evaluate(big, param_table(load_config(None, ["model=deepseek-v3-671b"])), layout, 4096, cluster)
    assert found.memory["total"] < cluster.budget and found.time["total"] > 0
    tiny = config()
    result = plan.search(tiny.model, param_table(tiny), load_cluster("h100"), 64 * 128, 128, top=5)
    assert result.candidates and all(c.layout.stage == 1 for c in result.candidates)
    assert result.reasons[0].startswith("#1 ") and "(max/mean rows to a shard) assumed 1.25" in result.reasons[-1]
    assert "#1" in plan.table(result).split("why:")[1]


def test_a_planned_deepseek_layout_is_an_experiment_the_trainer_runs():
    """The planner's winning family for the 671B (ZeRO-3 + TP + SP + EP), written as an experiment for the tiny
    model, builds and lowers (MLA, MoE and MTP through its rules)."""
    layout = plan.Strategy(fsdp=2, expert=2, tensor=2, sequence=True, remat="full", micro_batch=2)
    model = read_yaml(resolve_named("deepseek-v3-tiny", "models"))
    trainer = Trainer.build(strategy.config_for(layout, model, 32, ["data.max_bytes=200000"]))
    assert dict(trainer.mesh.shape) == layout.mesh()
    trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch())


@pytest.mark.parametrize("remat", ["none", "save_dots"])
def test_the_planner_counts_what_autodiff_saves_of_a_deepseek_layer(remat):
    """The analytic model's residuals per layer (MLA's latents and widths, dense and MoE layers averaged, the
    dropless rows) against jax's list of what the dense and MoE layer scans save (no compile): within 4% (not
    counted: RoPE's tables and the routing's small pieces)."""
    trainer = Trainer.build(config(f"model.remat={remat}", mesh={"data": 8}))
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in trainer.abstract_batch().items()}

    def loss(params):
        with use_rules(trainer.mesh, trainer.rules):
            return trainer.loss(params, batch)

    m, t = trainer.config.model, trainer.config.train
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, trainer.abstract_state().params)
    stacks, rows = (m.deepseek.dense_layers, m.layers - m.deepseek.dense_layers), t.global_batch * t.seq_len
    saved = 0
    for dtype, shape, where in re.findall(r"^(\w+)\[([\d,]*)\] (.*)$", printed.getvalue(), re.M):
        layers, *dims = [int(d) for d in shape.split(",") if d] or [0]
        per_token = {t.global_batch, t.seq_len} <= set(dims) or rows * m.moe.top_k in dims
        if "output of scan" in where and layers in stacks and per_token:
            saved += layers * math.prod(dims) * {"f32": 4, "bool": 1, "i32": 4}[dtype]
    table = sum(a.per_token * 4 for a in layer_residuals(m, remat, t.seq_len)) * m.layers * rows
    assert table == pytest.approx(saved, rel=0.04)


@pytest.mark.slow
def test_the_planner_predicts_the_compiled_deepseek_step():
    """The analytic memory per device within 10% of the compiled step's (memory_analysis) and its wire bytes within
    5% of the HLO's (reduce-scatter reading), as tests/test_analytic.py holds Llama's: ZeRO-3 on 8 devices, MLA, the
    dense block, the MoE blocks' shard_map keeping its gathered experts, MTP. Capacity dispatch: XLA:CPU expands
    dropless's grouped matmuls (ragged_dot) into a dense matmul per expert, E x the rows, which is not modelled."""
    trainer = Trainer.build(config("model.moe.dispatch=capacity", rules="zero3", mesh={"fsdp": 8}))
    step = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    prediction = predict_trainer(trainer)
    assert prediction.memory["total"] == pytest.approx(xla.memory(step)["total"], rel=0.10)
    wire = hlo.summarize(hlo.collectives(step.as_text(), trainer.mesh))["total"]["rs_wire_bytes"]
    assert prediction.comm["total"] == pytest.approx(wire, rel=0.05)
