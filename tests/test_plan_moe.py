"""jaxscale plan on mixtures of experts: what autodiff keeps and recomputes of EP's dropless exchange, the routing
imbalance it assumes (overridable), Mixtral 8x7B on 64 H100s against EP inside a node, MLA's latent projections."""

import contextlib
import io
import math
import re

import jax.numpy as jnp
import pytest
import yaml
from helpers import tiny_config
from jax.ad_checkpoint import print_saved_residuals

from jaxscale.analysis import plan, reasons
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.params import param_table
from jaxscale.analysis.predict import predict_trainer
from jaxscale.analysis.strategy import Strategy, placement
from jaxscale.config.read import CONFIG_DIR, ConfigError, load_config
from jaxscale.layout.sharding import use_rules
from jaxscale.parallel import exchange
from jaxscale.training.trainer import Trainer

EP, TOP_K = 8, 2
MOE = ["model.moe={}", f"model.moe.experts={EP}", f"model.moe.top_k={TOP_K}", "model.moe.mlp=32",
       "model.moe.dispatch=dropless"]
SEQ_4K, TOKENS_1M = 4096, 2**20


def saved_exchange_bytes(trainer: Trainer) -> int:
    """Bytes of what the layer scan saves for the backward whose rows are the exchange's worst case (ep x each
    device's k·b·s routed rows: printed for the whole mesh), every layer's (not the loop-invariant zero buffers
    hoisted out of it, one of each)."""
    t = trainer.config.train
    worst = EP * t.global_batch * t.seq_len * TOP_K
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in trainer.abstract_batch().items()}

    def loss(params):
        with use_rules(trainer.mesh, trainer.rules):
            return trainer.loss(params, batch)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, trainer.abstract_state().params)
    found = [(dtype, [int(d) for d in shape.split(",")])
             for dtype, shape in re.findall(r"^(\w+)\[([\d,]+)\] output of scan", printed.getvalue(), re.M)]
    return sum(math.prod(dims) * {"f32": 4, "i32": 4, "bool": 1}[dtype] for dtype, dims in found if worst in dims)


@pytest.mark.parametrize("remat", ["none", "save_dots", "full"])
def test_the_exchange_is_kept_or_recomputed_as_autodiff_does(remat, monkeypatch):
    """Dropless rows exchange over 8 experts: the planner's kept exchange buffers (its activations less the same
    layout's without them, the all-gather exchange) against what jax saves of the ep x rows buffers (no
    compile): kept without remat (within 15%: the planner counts the rows' outputs, jax the routing's masks), none
    under save_dots (no routed expert's matmul is saved: they were counted there, 23 GB a layer for Mixtral at
    EP 8) or full. Recomputing, the lowered step runs 6 ragged exchanges a layer, not 4, and the planner's EP
    bytes are 6 or 4 exchanges of k·b·s·h·4·(ep−1)/ep times the imbalance (1.25) per layer."""
    monkeypatch.setattr(exchange, "RAGGED_PLATFORMS", ("cpu",))  # traced and lowered (not compiled) as on a GPU
    trainer = Trainer.build(tiny_config(*MOE, f"model.remat={remat}", rules="ep", mesh={"expert": EP}))
    gathered = Trainer.build(tiny_config(*MOE, f"model.remat={remat}", "model.moe.dropless_exchange=all_gather",
                                         rules="ep", mesh={"expert": EP}))
    prediction = predict_trainer(trainer)
    kept = prediction.memory["activations"] - predict_trainer(gathered).memory["activations"]
    saved = saved_exchange_bytes(trainer)
    if remat == "none":
        assert saved > 0 and kept * EP == pytest.approx(saved, rel=0.15)
    else:
        assert saved == 0 and kept == 0
    text = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    runs = 4 if remat == "none" else 6
    assert text.count("@ragged_all_to_all") == runs
    m, t = trainer.config.model, trainer.config.train
    tokens = t.global_batch * t.seq_len / EP
    each = TOP_K * tokens * m.embed * 4 * (EP - 1) / EP * 1.25
    ep_bytes = sum(f.wire_bytes for f in prediction.flows if f.what.startswith("EP"))
    assert ep_bytes == pytest.approx(runs * m.layers * each, rel=1e-9)


def mixtral(*cluster: str, attention: str = "cudnn") -> tuple:
    config = load_config(None, ["model=mixtral-8x7b", f"model.attention={attention}"])
    return config.model, param_table(config), load_cluster("h100", ["nodes=8", *cluster])


def exchange_seconds(imbalance: float, b: int = 4) -> float:
    """Mixtral's exchange a step at EP 8 inside a node (NVLink, 370 GB/s; a 3-step tree's latency each): 6 a
    layer (save_dots recomputes it), 32 layers, k·b·s·h·2 bytes·(ep−1)/ep each, times the imbalance."""
    runs = 6 * 32
    return runs * (TOP_K * b * SEQ_4K * 4096 * 2 * (EP - 1) / EP * imbalance / 370e9 + 3 * 3e-6)


def test_ep_imbalance_is_a_cluster_key_and_moves_the_exchange_by_the_formula():
    """--set ep_imbalance=1.5 (a cluster key): EP 8 inside a node for Mixtral runs the exchange on the critical path,
    so its step grows by exactly the formula's bytes at 0.25 more imbalance; the plan's line says which it assumed;
    an imbalance under 1 (max over mean rows) is refused in one line."""
    layout = Strategy(fsdp=8, expert=EP, remat="save_dots", micro_batch=4)
    m, params, base = mixtral()
    _, _, skewed = mixtral("ep_imbalance=1.5")
    at = {c.ep_imbalance: plan.evaluate(m, params, layout, SEQ_4K, c) for c in (base, skewed)}
    assert at[1.25].time["exposed.EP"] == pytest.approx(exchange_seconds(1.25), rel=1e-9)
    grown = at[1.5].time["total"] - at[1.25].time["total"]
    assert grown == pytest.approx(exchange_seconds(1.5) - exchange_seconds(1.25), rel=1e-9)
    line = reasons.expert_lines([at[1.5]], m, skewed.ep_imbalance, 8)[-1]
    assert "assumed 1.5 (cluster key ep_imbalance" in line
    with pytest.raises(ConfigError, match=r"^cluster h100: 'ep_imbalance' is the busiest shard's rows over the "
                                          r"mean \(>= 1\), got 0.9$"):
        load_cluster("h100", ["ep_imbalance=0.9"])


@pytest.fixture(scope="module")
def mixtral_plan():
    m, params, cluster = mixtral()
    return plan.search(m, params, cluster, TOKENS_1M, SEQ_4K, top=0)


def test_mixtral_on_64_h100_weighs_ep_inside_a_node_and_says_what_it_pays(mixtral_plan):
    """Mixtral 8x7B, 256 x 4096 tokens on 8 x 8 H100 (cuDNN attention): 8-way EP inside a node fits at save_dots
    (it needed 835 GB while the exchange's buffers were counted as kept there) and is ranked on time: ZeRO-3 over
    all 64 GPUs hides its gathers behind 2.4 s of compute, where EP's exchange is on the critical path, 6 times a
    layer; the reason line names the best 8-way EP layout and what it pays, the exchange first."""
    result = mixtral_plan
    assert result.candidates[0].layout.expert == 1
    node = [(i, c) for i, c in enumerate(result.candidates) if c.layout.expert == EP and c.layout.tensor == 1]
    i, best = node[0]
    assert best.layout.remat == "save_dots" and best.memory["total"] <= result.cluster.budget
    assert best.time["exposed.EP"] == pytest.approx(exchange_seconds(1.25, best.layout.micro_batch), rel=1e-9)
    line = next(r for r in result.reasons if r.startswith("best with 8-way EP inside a node"))
    assert line.startswith(f"best with 8-way EP inside a node #{i + 1} {best.layout.describe()} (save_dots): ")
    paid = line.split("slower than #1: ")[1]
    assert paid.startswith("+") and paid.split(", ")[0].endswith("exposed EP comm")
    assert "assumed 1.25" in result.reasons[-1]


def test_a_context_parallel_winner_over_dot_attention_is_named():
    """With the model's dot attention, splitting the sequence swaps in a fused kernel (the ring's): the line
    says so and gives the memory-bound seconds of the best layout without CP."""
    m, params, cluster = mixtral(attention="dot")
    ring = plan.evaluate(m, params, Strategy(fsdp=32, context=2, remat="save_dots", micro_batch=8), SEQ_4K, cluster)
    flat = plan.evaluate(m, params, Strategy(fsdp=64, remat="save_dots", micro_batch=4), SEQ_4K, cluster)
    assert ring.time["attention"] + ring.time["memory_bound"] < flat.time["memory_bound"]
    (line,) = reasons.kernel_line([ring, flat], m)
    assert line.startswith("#1 splits the sequence (context degree 2) and so runs a fused attention kernel")
    assert f"(fsdp=64) spends {reasons.fmt_time(flat.time['memory_bound'])}" in line and "--attention cudnn" in line


def test_fsdp_shards_mlas_latent_projections():
    """Every preset that shards ``embed`` shards the up projections' latent input (``q_lora_up``, ``kv_lora_up``)
    the same way; DeepSeek-V3 671B under ZeRO-3 on 512 devices holds 1/512 of wq_b and wkv_b (with 16 bytes of
    state a parameter: 54 GB a device when they were whole); the tiny model's wq_b is split over fsdp."""
    for path in sorted((CONFIG_DIR / "rules").glob("*.yaml")):
        rules = yaml.safe_load(path.read_text())["rules"]
        assert rules["q_lora_up"] == rules["kv_lora_up"] == rules["embed"], path.name
    config = load_config(None, ["model=deepseek-v3-671b"])
    place = placement(Strategy(fsdp=512))
    up = [p for p in param_table(config) if p.path.rsplit(".", 1)[-1] in ("wq_b", "wkv_b")]
    held = sum(p.size / place.ways(p.axes) for p in up) * 16
    whole = 16 * (1536 * 128 * 192 + 512 * 128 * 256) * 62  # 61 layers and the MTP block
    assert round(whole / 1e9) == 54 and held == pytest.approx(whole / 512, rel=1e-12)
    mesh = ["mesh.data=1", "mesh.stage=1", "mesh.fsdp=8", "mesh.context=1", "mesh.expert=1", "mesh.tensor=1"]
    tiny = Trainer.build(load_config(None, ["model=deepseek-v3-tiny", "rules=zero3", *mesh]))
    assert tiny.param_shardings()["blocks"]["attn"]["wq_b"].spec[1] == "fsdp"
