"""The analytic model (jaxscale.analysis) against what XLA compiled, layout by layout, and its pieces.

LAYOUTS is the table of compiled checks: one line per layout (rules preset, mesh sizes, config
overrides), each compiled once on 8 simulated devices (fp32: XLA:CPU runs bf16 matmuls in f32) and
held to the analytic memory within 10% of ``compiled.memory_analysis()`` and the analytic wire
bytes within 5% of the collectives inspected in the HLO (reduce-scatter reading): ZeRO 0 to 3, TP,
SP, CP (ring attention, Ulysses, USP), PP (alone, with FSDP gathered once a step or per layer visit, with FSDP and TP,
with CP; 1F1B, GPipe and interleaved 1F1B) and EP, remat on and off. A pipeline tick's conditionals count
on the schedule's busy slots where idle slots are skipped (``inspect.branch_runs``): the runs executed.
The pipelined lines run two layers per chunk: with one, XLA hoists the stage's FSDP gathers out of the loop
(the model counts them per tick). One runs at seq_len 256,
where dot attention's s x s buffers in the backward slot are most of the step (at 32 they are not); one
at seq_len 2048 under full remat, where a recomputed layer's MLP backward is most of the step; ZeRO-3 at
seq_len 256, where the partitioner gathers the embedding table rather than move the looked-up activations.
A bf16 ZeRO-3 step's all-gathers are held to the partitioned HLO (the compiled CPU text runs them in f32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Trainers, partitioned_hlo, tiny_config
from jax.ad_checkpoint import print_saved_residuals

from jaxscale.analysis import hlo, xla
from jaxscale.analysis.activations import layer_residuals
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.communication import communication, flow
from jaxscale.analysis.formulas import state_formula
from jaxscale.analysis.inspect import step_collectives
from jaxscale.analysis.params import Step, param_table
from jaxscale.analysis.predict import predict_trainer
from jaxscale.analysis.timing import crosses_nodes
from jaxscale.config.read import CONFIG_DIR, ConfigError
from jaxscale.layout.rules import Layout, Rules
from jaxscale.layout.sharding import use_rules
from jaxscale.training.trainer import Trainer

MEMORY_RTOL = 0.10
COMM_RTOL = 0.05
# HSDP with one sequence per device in each microbatch, and the chunked loss
HSDP_ONE_ROW = ("zero3", {"data": 2, "fsdp": 4}, "train.global_batch=16", "train.microbatches=2", "model.loss_chunk=8")
LAYOUTS = [
    ("dp", {"data": 8}),
    ("dp", {"data": 8}, "model.remat=save_dots"),
    ("zero1", {"data": 8}),
    ("zero1", {"data": 8}, "train.global_batch=32", "train.microbatches=2"),
    ("zero2", {"data": 8}, "train.global_batch=32", "train.microbatches=2"),
    ("zero3", {"fsdp": 8}),
    ("zero3", {"fsdp": 8}, "model.remat=full"),
    ("zero3", {"fsdp": 8}, "model.layers=2", "train.seq_len=256"),  # the table gathered, not the lookups moved
    ("zero3", {"data": 2, "fsdp": 4}),
    HSDP_ONE_ROW,
    ("tp", {"data": 2, "tensor": 4}),
    ("tp", {"data": 2, "tensor": 4}, "model.remat=full"),
    ("tp_sp", {"data": 2, "tensor": 4}),
    ("tp_sp", {"data": 2, "tensor": 4}, "model.remat=save_dots"),
    ("fsdp_tp", {"fsdp": 2, "tensor": 4}),
    ("fsdp_tp_sp", {"data": 2, "fsdp": 2, "tensor": 2}, "model.remat=full"),
    ("ep", {"expert": 8}, "model.moe={experts: 8, top_k: 2}"),
    ("cp", {"data": 2, "context": 4}, "model.attention=ring"),
    ("ulysses", {"data": 2, "context": 4}, "model.attention=blockwise"),  # all-to-alls over context
    ("usp", {"data": 2, "context": 2, "ulysses": 2}, "model.attention=ring"),  # all-to-alls over ulysses, ring
    ("pp", {"stage": 2, "data": 4}, "model.layers=4"),
    ("pp_fsdp", {"stage": 2, "fsdp": 4}, "model.layers=4", "model.remat=full"),
    ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, "model.layers=4"),
    ("pp", {"stage": 2, "data": 4}, "model.layers=4", "pipeline.schedule=gpipe", "pipeline.microbatches=4"),
    ("pp", {"stage": 2, "data": 4}, "model.layers=4", "train.seq_len=256"),  # s x s buffers in the backward slot
    ("pp_fsdp", {"stage": 2, "fsdp": 4}, "model.layers=8", "pipeline.schedule=interleaved_1f1b",
     "pipeline.repeats=2"),
    ("pp_tp_cp", {"stage": 2, "context": 4}, "model.layers=4", "model.attention=ring"),
    # ZB-H1: what each layer's B keeps for its W (activations.split_kept), the W slot's weight-gradient matmuls alone
    ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, "model.layers=4", "pipeline.schedule=zb_h1",
     "pipeline.microbatches=4"),
    ("pp_fsdp", {"stage": 2, "fsdp": 4}, "model.layers=4", "pipeline.fsdp=visit"),  # gathered per layer visit
    ("pp_tp_sp", {"stage": 2, "tensor": 2, "data": 2}, "model.layers=4"),  # TP and SP manual in a stage
    ("pp_fsdp_tp_cp", {"stage": 2, "fsdp": 2, "context": 2}, "model.layers=4", "model.attention=ring"),
    # flash-style attention's score tiles: one tile of the whole sequence, and 128-token tiles of a TP head shard
    ("pp", {"stage": 2, "data": 4}, "model.layers=4", "train.seq_len=256", "model.attention=blockwise"),
    ("tp_sp", {"data": 2, "tensor": 4}, "model.layers=4", "train.seq_len=512", "model.attention=blockwise",
     "model.attention_block=128"),
    # a recomputed layer's MLP backward past its attention's tiles (0.73x compiled when SwiGLU's counted 6f, not 9f)
    ("dp", {"data": 8}, "model.layers=4", "train.seq_len=2048", "model.attention=blockwise",
     "model.attention_block=128", "model.remat=full"),
]


def layout_id(layout: tuple) -> str:
    rules, mesh, *overrides = layout
    sizes = "-".join(f"{a}{s}" for a, s in mesh.items())
    return "-".join([rules, sizes, *(o.split("=")[1] for o in overrides)])


def compile_layout(trainers: Trainers, layout: tuple) -> tuple[Trainer, object]:
    """The layout's trainer and compiled step, from the session's cache."""
    rules, mesh, *overrides = layout
    return trainers.step(*overrides, rules=rules, mesh=mesh)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_analytic_matches_compiled(layout, trainers):
    trainer, step = compile_layout(trainers, layout)
    prediction = predict_trainer(trainer)
    memory = xla.memory(step)["total"]
    assert prediction.memory["total"] == pytest.approx(memory, rel=MEMORY_RTOL)
    wire = hlo.summarize(step_collectives(trainer, step)[0])["total"]["rs_wire_bytes"]
    assert prediction.comm["total"] == pytest.approx(wire, rel=COMM_RTOL)


@pytest.mark.parametrize("layout", [
    ("pp_tp_sp", {"stage": 2, "tensor": 2, "data": 2}, "model.layers=4", "pipeline.schedule=zb_h1"),
    pytest.param(("pp_fsdp_tp_cp", {"stage": 2, "fsdp": 2, "context": 2}, "model.layers=4", "model.attention=ring",
                  "pipeline.schedule=zb_h1"), marks=pytest.mark.slow),
], ids=layout_id)
def test_zb_h1_memory_matches_compiled(layout, trainers):
    """ZB-H1 with TP and SP, or FSDP and CP, inside a stage: the analytic memory (its layer inputs and output
    gradients kept from B to W) within 10% of compiled. Its wire bytes are not held here: the weight slot's
    recompute runs the layers' TP, SP and CP collectives again, which the planner's W slot does not count."""
    trainer, step = compile_layout(trainers, layout)
    assert predict_trainer(trainer).memory["total"] == pytest.approx(xla.memory(step)["total"], rel=MEMORY_RTOL)


def test_bf16_gathers_move_the_compute_copy(tmp_path, trainers):
    """ZeRO-3 of a bf16 model (fp32 master) gathers the bf16 compute copy: the analytic all-gather bytes within
    5% of the partitioned HLO's, and half the fp32 model's (they were counted in model.param_dtype: 1.97x)."""
    def gathered(trainer: Trainer) -> float:
        return sum(f.wire_bytes for f in predict_trainer(trainer).flows if f.kind == "all-gather")

    bf16 = Trainer.build(tiny_config("model.dtype=bfloat16", rules="zero3", mesh={"fsdp": 8}))
    found = hlo.summarize(hlo.collectives(partitioned_hlo(bf16, tmp_path), bf16.mesh))["by_kind"]["all-gather"]
    assert gathered(bf16) == pytest.approx(found["wire_bytes"], rel=COMM_RTOL)
    fp32 = trainers.get(rules="zero3", mesh={"fsdp": 8})  # LAYOUTS' trainer, built once
    assert gathered(bf16) == pytest.approx(gathered(fp32) / 2, rel=0.02)


def test_hsdp_gathers_no_whole_activation(trainers):
    """No collective of the step gives a device a whole microbatch's [sequences, length, embed] activations.

    Left to the partitioner, the embedding lookup's backward under HSDP with one sequence per device
    gathered them on every device ("involuntary full rematerialization") to scatter them into the table.
    """
    trainer, step = compile_layout(trainers, HSDP_ONE_ROW)
    t, m = trainer.config.train, trainer.config.model
    whole = (t.global_batch // t.microbatches, t.seq_len, m.embed)
    found = hlo.collectives(step.as_text(), trainer.mesh)
    assert found
    assert [(c.kind, c.op_name) for c in found if any(dims == whole for _, dims in c.shapes)] == []


def test_state_is_exact_and_follows_the_zero_stages(trainers):
    # Parameters, Adam and gradients are not estimates: the shardings say them to the byte.
    for layout in LAYOUTS[:5]:
        trainer = trainers.get(*layout[2:], rules=layout[0], mesh=layout[1])
        held = xla.state_bytes(trainer)
        mem = predict_trainer(trainer).memory
        adam_scalars = 8  # two int32 step counts (Adam's and the schedule's), replicated
        assert mem["params"] == held["params"]
        assert mem["optimizer"] == held["opt_state"] - adam_scalars
    # docs/formulas.md's stages in jaxscale's convention: 4Ψ + 8Ψ + 4Ψ, divided stage by stage.
    psi, n = 1000.0, 8
    assert state_formula(psi, n, 0) == {"params": 4000, "gradients": 4000, "optimizer": 8000}
    assert state_formula(psi, n, 1) == {"params": 4000, "gradients": 4000, "optimizer": 1000}
    assert state_formula(psi, n, 2) == {"params": 4000, "gradients": 500, "optimizer": 1000}
    assert state_formula(psi, n, 3) == {"params": 500, "gradients": 500, "optimizer": 1000}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", ["none", "selective", "full", "save_dots"])
def test_layer_residuals_are_what_autodiff_saves(remat, dtype):
    """The per-layer activation table against jax's own list of saved residuals (no compile)."""
    config = tiny_config(f"model.remat={remat}", f"model.dtype={dtype}", "model.layers=2", rules="dp",
                         mesh={"data": 8})
    trainer = Trainer.build(config)
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in trainer.abstract_batch().items()}

    def loss(params):
        with use_rules(trainer.mesh, trainer.rules):
            return trainer.loss(params, batch)

    m, t = config.model, config.train
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, trainer.abstract_state().params)
    stacked = 0
    for dtype_, shape, where in re.findall(r"^(\w+)\[([\d,]*)\] (.*)$", printed.getvalue(), re.M):
        if not shape:
            continue  # a scalar (the loss's count of trained targets)
        # A layer's activations: stacked by the layer scan, with the batch and sequence dimensions.
        layers, *dims = (int(d) for d in shape.split(","))
        if "output of scan" in where and layers == m.layers and {t.global_batch, t.seq_len} <= set(dims):
            stacked += math.prod(dims) * {"f32": 4, "bf16": 2}[dtype_]
    itemsize = {"fp32": 4, "compute": np.dtype(dtype).itemsize}
    table = sum(a.per_token * itemsize[a.dtype] for a in layer_residuals(m, remat, t.seq_len))
    assert stacked == table * t.global_batch * t.seq_len


def test_flows_count_wire_bytes_like_inspect():
    place = Layout(Rules("none", {}), {"data": 8, "tensor": 1})
    (ar,) = flow("x", "all-reduce", ["data"], 800.0, 3, place, "backward", True)
    (ag,) = flow("x", "all-gather", ["data"], 800.0, 1, place, "forward", True)
    (cp,) = flow("x", "collective-permute", ["data"], 800.0, 2, place, "forward", True)
    assert (ar.wire_bytes, ag.wire_bytes, cp.wire_bytes) == (2 * 7 / 8 * 800 * 3, 7 / 8 * 800, 1600)
    assert flow("x", "all-reduce", ["tensor"], 800.0, 1, place, "backward", True) == []


def test_the_ring_passes_the_kv_heads_of_its_tensor_shard():
    """Keys and values round the ring are the device's kv heads: half of them with kv_heads over tensor = 2."""
    config = tiny_config("model.attention=ring", rules="fsdp_tp_cp", mesh={"context": 2, "tensor": 2})
    params, step, m = param_table(config), Step.from_config(config), config.model
    rules = Rules.load("fsdp_tp_cp")

    def ring(tensor: int) -> float:
        flows = communication(m, params, Layout(rules, {"context": 2, "tensor": tensor}), step)
        return sum(f.size for f in flows if f.what.startswith("CP ring"))

    assert ring(2) == ring(1) / 2 and ring(1) > 0


def test_groups_cross_nodes_from_the_inner_axes_out():
    mesh = {"data": 4, "stage": 1, "fsdp": 2, "context": 1, "ulysses": 1, "expert": 1, "tensor": 8}
    assert not crosses_nodes(["tensor"], mesh, 8)
    assert crosses_nodes(["fsdp"], mesh, 8)
    assert not crosses_nodes(["fsdp", "tensor"], mesh, 16)
    assert crosses_nodes(["data"], mesh, 16)


def test_cluster_presets_load_and_bad_keys_fail():
    for path in (CONFIG_DIR / "clusters").glob("*.yaml"):
        cluster = load_cluster(path.stem)
        assert cluster.devices >= 8 and 0 < cluster.budget < cluster.memory_bytes
    assert load_cluster("h100", ["nodes=8"]).devices == 64
    with pytest.raises(ConfigError, match="unknown key 'nodez'"):
        load_cluster("h100", ["nodez=8"])
    with pytest.raises(ConfigError, match="'peak_flops' must be a positive number"):
        load_cluster("h100", ["peak_flops=fast"])
    with pytest.raises(ConfigError, match="no cluster named 'h1000'"):
        load_cluster("h1000")


def test_step_time_hides_gradient_traffic_but_not_tensor_traffic():
    config = tiny_config(rules="tp", mesh={"data": 2, "tensor": 4})
    trainer = Trainer.build(config)
    cluster = load_cluster("h100", ["peak_flops=1e9"])  # slow devices: every overlap hides
    time = predict_trainer(trainer, cluster).time
    tp = [f for f in predict_trainer(trainer).flows if not f.overlap]
    assert tp and all(f.axes == ("tensor",) for f in tp)
    latency = sum(f.runs * cluster.latency_intra * 2 * math.ceil(math.log2(f.n)) for f in tp)
    assert time["exposed.TP"] == pytest.approx(sum(f.wire_bytes for f in tp) / cluster.intra_bandwidth + latency)
    assert time["total"] == pytest.approx(time["compute"] + time["exposed"] + time["contention"])
    table = [[x, e / 2] for x, e in cluster.matmul_efficiency]
    slow = dataclasses.replace(cluster, matmul_efficiency=table, attention_efficiency=None, compute_efficiency=0.25)
    assert predict_trainer(trainer, slow).time["matmul"] == pytest.approx(2 * time["matmul"])
