"""Pipeline parallelism: every schedule equals one device; the tables it runs; memory, head and traffic; errors."""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from helpers import RTOL, assert_trees_close, fails_early, tiny_config

from jaxscale.analysis import hlo, hlo_compute, xla
from jaxscale.analysis.predict import predict_trainer
from jaxscale.config.read import CONFIG_DIR, MESH_AXES, ConfigError
from jaxscale.layout.rules import Rules, Stage
from jaxscale.layout.sharding import layout_of, use_layout, use_rules
from jaxscale.models import balance
from jaxscale.models.llama import Block
from jaxscale.parallel import schedules, weight_split
from jaxscale.parallel.schedules import FIRST, IDLE, LAST
from jaxscale.training.trainer import Trainer

# Eight layers split over up to 4 stages x 2 chunks; 32 sequences cut into up to 16 microbatches.
BASE = ("train.global_batch=32", "model.layers=8")
MESHES = {2: {"stage": 2, "data": 4}, 4: {"stage": 4, "data": 2}}
SCHEDULES = {1: ("gpipe", "1f1b"), 2: ("circular", "interleaved_1f1b")}
GRID = [(s, p, k * p, v) for v in (1, 2) for s in SCHEDULES[v] for p in (2, 4) for k in (1, 2, 4)]


def pipe(schedule: str, m: int, v: int = 1) -> list[str]:
    return [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}"]


@pytest.fixture(scope="module")
def reference():
    """One device, no pipeline: the initial state and two batches (host copies), loss and gradients, two steps."""
    trainer = Trainer.build(tiny_config(*BASE), jax.devices()[:1])
    state = trainer.init_state()
    initial = jax.device_get(state)
    batches = [jax.device_get(trainer.batch(step)) for step in range(2)]
    loss, grads = trainer.loss_and_grads(state.params, trainer.batch(0))
    outs = []
    for step in range(2):
        state, out = trainer.step(state, trainer.batch(step))
        outs.append(jax.device_get(out))
    return initial, batches, float(loss), grads, state.params, outs


def stored(trainer: Trainer, params):
    """Host parameters of the unpipelined model in the trainer's stack (its storage order) and shardings."""
    return jax.device_put(trainer.storage.place_params(params), trainer.param_shardings())


def canonical(trainer: Trainer, params):
    """The trainer's parameters (or gradients) with the stack in the model's order."""
    return trainer.storage.canonical_params(jax.device_get(params))


def placed(trainer: Trainer, batch):
    """A host batch in the trainer's layout."""
    return jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))


def close(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= RTOL * abs(float(b))


@pytest.mark.parametrize("schedule, p, m, v", [*GRID, ("zb_h1", 4, 8, 1)])
def test_pipeline_matches_single_device(schedule, p, m, v, reference):
    initial, batches, ref_loss, ref_grads, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, m, v), rules="pp", mesh=MESHES[p]))
    params = stored(trainer, initial.params)
    loss, grads = trainer.loss_and_grads(params, placed(trainer, batches[0]))
    assert close(loss, ref_loss)
    assert_trees_close(canonical(trainer, grads), ref_grads)


@pytest.mark.parametrize("rules, mesh", [("pp", MESHES[2]), ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2})])
def test_the_chunked_loss_inside_a_stage_matches_single_device(rules, mesh, reference):
    """``model.loss_chunk`` on the last stage (the plan proposes it with pipelines): the chunked head's scan
    carries its gradient typed as varying over the stage's manual axes; loss and gradients equal one device.
    Under ZB-H1 (p = 2; p = 4 in the grid above): the backward split into B and W slots, idle slots skipped
    (``pp``) or masked (``pp_fsdp_tp``), the head's gradient in the last stage's B."""
    initial, batches, ref_loss, ref_grads, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe("zb_h1", 4), "model.loss_chunk=8", rules=rules, mesh=mesh))
    params = stored(trainer, initial.params)
    loss, grads = trainer.loss_and_grads(params, placed(trainer, batches[0]))
    assert close(loss, ref_loss)
    assert_trees_close(canonical(trainer, grads), ref_grads)


def step_dots(trainer: Trainer) -> list[str]:
    """The dot instructions of the compiled step, each with the name of the code that made it."""
    text = xla.compile_step(trainer).as_text()
    dots = [line for line in text.splitlines() if re.search(r"= \S+ dot\(", line)]
    return [re.search(r'op_name="([^"]*)"', line).group(1) for line in dots]


def test_zb_h1_weight_slot_runs_the_weight_gradient_matmuls_alone():
    """ZB-H1's W slot (``pp``, p = 2, m = 4) compiles to one dot per weight matmul of a unit, each the transpose of
    a projection (its weight gradient): no recompute of the layer, no activation backward (attention's). Every
    matmul of 1F1B's step runs once in ZB-H1's too, in its B or its W: the same number of dots in all."""
    projections = 4 + 3  # q, k, v, o; gate, up, down
    zb, f1b = (step_dots(Trainer.build(tiny_config(*BASE, *pipe(schedule, 4), rules="pp", mesh=MESHES[2])))
               for schedule in ("zb_h1", "1f1b"))
    weight = [name for name in zb if "/weight_slot/" in name]
    assert len(weight) == projections and all("transpose(jvp(" in name for name in weight), weight
    assert len(zb) == len(f1b)


def test_b_keeps_each_weight_matmuls_input_and_output_gradient():
    """What ZB-H1's B keeps of a Llama unit for its W (:mod:`jaxscale.parallel.weight_split`): each distinct weight
    matmul input, as it is in the compute dtype (the normed input once for q, k and v, the attention output, the
    normed input once for gate and up, the MLP hidden: 2h + q + f per token) and each matmul's output gradient
    (q, k, v, o, gate, up, down: q + 2k + h + 2f + h), where the unsplit backward keeps the unit's input, h."""
    config = tiny_config()
    c = config.model
    h, q, k, f, rows = c.embed, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.mlp, 2
    tokens = rows * config.train.seq_len
    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=jax.devices()[:1])
    place = dataclasses.replace(layout_of(mesh, Rules.load("dp")), stage=Stage((), ()))
    with nnx.use_eager_sharding(False):
        block = Block(config, nnx.Rngs(0))
    x = jnp.zeros((rows, config.train.seq_len, h), jnp.dtype(c.dtype))
    positions = jnp.broadcast_to(jnp.arange(config.train.seq_len), x.shape[:2])
    with use_layout(mesh, place):
        outputs, inputs = weight_split.types(lambda: block(x, positions))
    assert len(outputs) == 7 and len(inputs) == 4
    itemsize = jnp.dtype(c.dtype).itemsize
    assert weight_split.kept_bytes(inputs) == tokens * (2 * h + q + f) * itemsize
    assert weight_split.kept_bytes(outputs) == tokens * (q + 2 * k + h + 2 * f + h) * itemsize


def test_the_pipeline_backward_scales_with_its_cotangent(reference):
    """grad(2·loss) = 2·grad(loss) of one device under ``pp``: the pipeline's custom VJP multiplies what it
    computed by the cotangent it is given (the trainer always differentiates with cotangent 1)."""
    initial, batches, _, ref_grads, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe("1f1b", 2), rules="pp", mesh=MESHES[2]))

    @jax.jit
    def doubled(params, batch):
        with trainer.scope():
            return jax.grad(lambda p: 2 * trainer.loss(p, batch))(params)

    params = stored(trainer, initial.params)
    grads = canonical(trainer, doubled(params, placed(trainer, batches[0])))
    assert_trees_close(grads, jax.tree.map(lambda g: 2 * g, ref_grads))


def test_evaluation_runs_the_forward_table(reference):
    """Without a gradient the loop runs the forwards only, the loss in the last stage's forward slot."""
    initial, batches, ref_loss, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe("interleaved_1f1b", 4, 2), rules="pp", mesh=MESHES[2]))
    params = stored(trainer, initial.params)
    assert close(trainer.jit_eval_loss(params, placed(trainer, batches[0])), ref_loss)


@pytest.mark.parametrize("schedule, v, attention, gather", [("1f1b", 1, "dot", "step"),
                                                             ("interleaved_1f1b", 2, "blockwise", "tick"),
                                                             ("interleaved_1f1b", 2, "dot", "visit")])
def test_pp_fsdp_tp_training_steps_match_single_device(schedule, v, attention, gather, reference):
    """Two steps of pp x fsdp x tp (2 x 2 x 2): only messages and per-step sums cross stage, the stage's FSDP
    gathers once a step (``pipeline.fsdp=step``: the loop manual over fsdp and tensor, every matmul in a
    conditional, idle slots skipped), each layer as a slot runs it (``visit``: the blocks enter split over fsdp
    and tensor, fsdp gathered layer by layer; idle slots skipped) or every tick (``tick``: fsdp and tensor left
    to the partitioner, idle slots masked). The blockwise kernel runs inside the stage's loop as it is, no
    shard_map of its own. Executed work: the layers' matmul FLOPs, each tick's conditionals counted on the
    stage's busy slots, are the table's work (v·m forwards and v·m backwards, a backward 3 forwards: the
    recompute, then two matmuls per forward matmul) times a chunk's forward FLOPs (:func:`chunk_flops`)."""
    initial, batches, _, _, ref_params, ref_outs = reference
    m = 4
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, m, v), f"model.attention={attention}",
                                        f"pipeline.fsdp={gather}", rules="pp_fsdp_tp",
                                        mesh={"stage": 2, "fsdp": 2, "tensor": 2}))
    compiled = xla.compile_step(trainer)
    state = jax.device_put(initial._replace(params=trainer.storage.place_params(initial.params)),
                           trainer.state_shardings)
    for batch, ref_out in zip(batches, ref_outs, strict=True):
        state, out = compiled(state, placed(trainer, batch))
        for key in ("loss", "grad_norm"):
            assert close(out[key], ref_out[key]), key
    assert_trees_close(canonical(trainer, state.params), ref_params)
    # Each tick sends one microbatch shard (8 rows / fsdp 2 = 4 rows, 32 x 64) to each neighbour; every
    # other collective over stage runs once per step on parameters (the embedding and head gradients'
    # sum) or scalars, never on activations. Interleaved, the stack is stored in the chunks' order: no
    # all-to-all over stage moves the blocks or their gradients (before the storage did: 18 per step).
    table = schedules.build(schedule, 2, m, v)
    assert (hlo_compute.dots(compiled.as_text())["outside"] == 0) == (gather != "tick")
    assert attention != "dot" or executed_layer_flops(compiled.as_text(), table) == table.work(1, 3) * chunk_flops(v)
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    over_stage = [c for c in found if c.axes and "stage" in c.axes]
    permutes = [c for c in over_stage if c.kind == "collective-permute"]
    assert {(c.shapes, c.runs) for c in permutes} == {((("f32", (4, 32, 64)),), table.ticks)}
    assert len(permutes) == 2
    assert not [c for c in over_stage if c.kind == "all-to-all"]
    outer = sum(w.size * 4 for k, v in initial.params.items() if k != "blocks" for w in jax.tree.leaves(v))
    for c in over_stage:
        if c.kind != "collective-permute":
            assert c.runs == 1 and c.result_bytes <= outer + 256, c  # the parameters and a few scalars
            assert all(np.prod(s) < 16 * 32 * 64 for _, s in c.shapes), c  # the stack's output on a device


def chunk_flops(v: int) -> int:
    """A forward slot's matmul FLOPs on a device of pp_fsdp_tp (2 x 2 x 2, m = 4): 32 / 4 / 2 = 4 sequences of 32
    tokens through 8 / (2·v) layers, 2 FLOPs a token per weight (q, o 64x64, k, v 64x32, gate, up, down 64x128)
    and 2·2·32·64 in dot attention (QKᵀ and PV, 32 keys, 8 heads of 8), all split over tensor."""
    return 4 * 32 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 2 * 2 * 32 * 64) // 2 * (8 // (2 * v))


def executed_layer_flops(text: str, table: schedules.Table) -> int:
    """FLOPs per step and device of the layer matmuls (in the layer scan in a slot's conditional; the head's in
    one inside it), a tick's conditionals counted on the stage's busy slots."""
    return sum(d.flops * d.runs for d in hlo_compute.matmuls(text, hlo.busy_slots(table))
               if len(d.loops) == 2 and d.loops[0].trips == table.ticks and d.branches == 1)


def pp_fsdp_steps(reference, schedule: str, v: int, gather: str):
    """pp_fsdp (stage 2 x fsdp 4, m = 8) with ``pipeline.fsdp=gather``: two compiled steps, each equal to one
    device's (loss, gradient norm, parameters). Returns the trainer, its compiled step and its collectives."""
    initial, batches, _, _, ref_params, ref_outs = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, 8, v), f"pipeline.fsdp={gather}", rules="pp_fsdp",
                                        mesh={"stage": 2, "fsdp": 4}))
    compiled = xla.compile_step(trainer)
    state = jax.device_put(initial._replace(params=trainer.storage.place_params(initial.params)),
                           trainer.state_shardings)
    for batch, ref_out in zip(batches, ref_outs, strict=True):
        state, out = compiled(state, placed(trainer, batch))
        for key in ("loss", "grad_norm"):
            assert close(out[key], ref_out[key]), key
    assert_trees_close(canonical(trainer, state.params), ref_params)
    return trainer, compiled, hlo.collectives(compiled.as_text(), trainer.mesh)


def test_fsdp_inside_a_stage_at_fsdps_price(reference):
    """pp_fsdp (stage 2 x fsdp 4, 1F1B, m = 8): two steps equal one device; the stage gathers its blocks over
    fsdp once a step and reduces their gradients once (no fsdp collective in the loop), so the step moves at
    most 1.3x the bytes of ZeRO-3 on fsdp 8 plus the pipeline's permutes (4.7x when gathered every tick);
    with no axis left to the partitioner every matmul sits in a conditional (idle slots skipped)."""
    _, compiled, found = pp_fsdp_steps(reference, "1f1b", 1, "step")
    assert [c for c in found if c.axes and "fsdp" in c.axes and c.runs > 1] == []
    zero3 = Trainer.build(tiny_config(*BASE, rules="zero3", mesh={"fsdp": 8}))
    reference_bytes = sum(c.rs_wire_bytes for c in hlo.collectives(xla.compile_step(zero3).as_text(), zero3.mesh))
    permutes = sum(c.wire_bytes for c in found if c.kind == "collective-permute")
    ratio = sum(c.rs_wire_bytes for c in found) / (reference_bytes + permutes)
    print(f"pp_fsdp collective bytes / (zero3 + permutes) = {ratio:.3f}")
    assert ratio <= 1.3
    assert hlo_compute.dots(compiled.as_text())["outside"] == 0


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_fsdp_inside_a_stage_gathered_per_visit(schedule, v, reference):
    """``pipeline.fsdp=visit`` on pp_fsdp (stage 2 x fsdp 4, m = 8): two steps equal one device. Each layer is
    gathered over fsdp when a slot runs it (the forward slot, then the backward slot's recompute) and its
    gradient reduce-scattered after its backward, all inside the loop's conditionals (idle slots skipped:
    no matmul outside one). Per layer slot the compiled loop gathers 2·U·(n−1)/n bytes and reduce-scatters
    U·(n−1)/n (U one layer's fp32 parameters, n = 4); a stage runs m·v busy slots of each kind, L/(p·v)
    layers each, so a step moves 2·m·(L/p)·U·(n−1)/n gathered and m·(L/p)·U·(n−1)/n scattered, against
    (T ticks) 2·T·(L/(p·v))·U·(n−1)/n and T·(L/(p·v))·U·(n−1)/n gathered every tick (``tick``). The planner's
    analytic model counts the same, and so does ``hlo`` given the busy slots (``hlo.busy_slots``)."""
    initial = reference[0]
    trainer, compiled, found = pp_fsdp_steps(reference, schedule, v, "visit")
    p, m, n, layers = 2, 8, 4, 8
    unit = sum(w.size * 4 for w in jax.tree.leaves(initial.params["blocks"])) / layers  # U, fp32
    table = schedules.build(schedule, p, m, v)
    slots = layers // (p * v)
    fsdp = [c for c in found if c.axes == ("fsdp",)]
    looped = [c for c in fsdp if c.runs > 1]
    assert {tuple(loop.trips for loop in c.loops) for c in looped} == {(table.ticks, slots)}
    per_slot = {kind: sum(c.wire_bytes / c.runs for c in looped if c.kind == kind)
                for kind in ("all-gather", "reduce-scatter")}
    assert per_slot == pytest.approx({"all-gather": 2 * unit * (n - 1) / n, "reduce-scatter": unit * (n - 1) / n})
    assert {c.kind for c in looped} == {"all-gather", "reduce-scatter"}
    busy = [int((kinds > IDLE).sum(axis=0)[0]) for kinds in (table.f_kind, table.b_kind)]
    assert busy == [m * v, m * v]
    moved = {kind: per_slot[kind] * busy[0] * slots for kind in per_slot}
    assert moved == pytest.approx({"all-gather": 2 * m * layers / p * unit * (n - 1) / n,
                                   "reduce-scatter": m * layers / p * unit * (n - 1) / n})
    flows = [f for f in predict_trainer(trainer).flows if f.what.startswith("blocks.") and f.axes == ("fsdp",)]
    assert {kind: sum(f.wire_bytes for f in flows if f.kind == kind) for kind in moved} == pytest.approx(moved)
    taken = {c.name: c.wire_bytes for c in hlo.collectives(compiled.as_text(), trainer.mesh, hlo.busy_slots(table))}
    assert {k: sum(taken[c.name] for c in looped if c.kind == k) for k in moved} == pytest.approx(moved)
    outer = sum(w.size * 4 for k, part in initial.params.items() if k != "blocks" for w in jax.tree.leaves(part))
    assert all(c.result_bytes <= outer for c in fsdp if c.runs == 1)  # outside the loop: no block gathered
    assert hlo_compute.dots(compiled.as_text())["outside"] == 0


@pytest.mark.parametrize("rules, mesh, schedule, v, gather", [
    ("pp_tp_cp", {"stage": 2, "context": 2, "tensor": 2}, "1f1b", 1, "step"),
    ("pp_fsdp_tp_cp", {"stage": 2, "fsdp": 2, "context": 2}, "interleaved_1f1b", 2, "step"),
    ("pp_fsdp_tp_cp", {"stage": 2, "fsdp": 2, "context": 2}, "zb_h1", 1, "visit"),
    pytest.param("pp_fsdp_tp_cp", {"stage": 2, "tensor": 2, "context": 2}, "1f1b", 1, "step", marks=pytest.mark.slow),
    pytest.param("pp_fsdp_tp_cp", {"stage": 4, "context": 2}, "interleaved_1f1b", 2, "step", marks=pytest.mark.slow),
    pytest.param("pp_tp_cp", {"stage": 4, "context": 2}, "1f1b", 1, "step", marks=pytest.mark.slow),
    pytest.param("pp_fsdp_tp_cp", {"stage": 4, "context": 2}, "zb_h1", 1, "step", marks=pytest.mark.slow),
    pytest.param("pp_tp_cp", {"stage": 2, "context": 2, "tensor": 2}, "zb_h1", 1, "step", marks=pytest.mark.slow),
])
def test_context_parallelism_inside_a_stage(rules, mesh, schedule, v, gather, reference):
    """Ring attention over context inside each stage (the loop manual over stage, context and TP's or FSDP's
    axes; the keys and values all-gathered over context, no collective-permute in a conditional) equals one
    device, the sequence in the ring's order, and every matmul sits in a conditional (idle slots skipped),
    under ZB-H1 too (its B and W slots), and with FSDP's axes gathered per layer visit (``visit``)."""
    initial, batches, ref_loss, ref_grads, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, 4, v), "model.attention=ring",
                                        f"pipeline.fsdp={gather}", rules=rules, mesh=mesh))
    order = trainer.sequence_order
    assert order is not None and sorted(order) == list(range(32))
    params = stored(trainer, initial.params)
    batch = placed(trainer, {k: v[:, order] for k, v in batches[0].items()})
    compiled = trainer.jit_loss_and_grads.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    assert close(loss, ref_loss)
    assert_trees_close(canonical(trainer, grads), ref_grads)
    assert hlo_compute.dots(compiled.as_text())["outside"] == 0


@pytest.mark.parametrize("rules, mesh, schedule, v, gather", [
    ("pp_tp_sp", {"stage": 2, "tensor": 2, "data": 2}, "1f1b", 1, "step"),
    ("pp_tp_sp", {"stage": 4, "tensor": 2}, "interleaved_1f1b", 2, "step"),
    ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, "interleaved_1f1b", 2, "step"),
    ("pp_fsdp_tp", {"stage": 4, "tensor": 2}, "1f1b", 1, "step"),
    ("pp_fsdp_tp", {"stage": 4, "tensor": 2}, "zb_h1", 1, "step"),
    ("pp_fsdp_tp_sp", {"stage": 2, "fsdp": 2, "tensor": 2}, "zb_h1", 1, "visit"),
    pytest.param("pp_tp_sp", {"stage": 2, "tensor": 2, "data": 2}, "interleaved_1f1b", 2, "step",
                 marks=pytest.mark.slow),
    pytest.param("pp_tp_sp", {"stage": 4, "tensor": 2}, "1f1b", 1, "step", marks=pytest.mark.slow),
    pytest.param("pp_fsdp_tp", {"stage": 4, "tensor": 2}, "interleaved_1f1b", 2, "step", marks=pytest.mark.slow),
    pytest.param("pp_tp_sp", {"stage": 4, "tensor": 2}, "zb_h1", 1, "step", marks=pytest.mark.slow),
])
def test_tensor_and_sequence_parallelism_inside_a_stage(rules, mesh, schedule, v, gather, reference, tmp_path):
    """TP (and SP) inside each stage, the loop manual over tensor, its collectives written by the projections
    among one stage's devices: equals one device, and every matmul sits in a conditional (idle slots skipped),
    under ZB-H1 too and with FSDP gathered per layer visit. Under SP the residual stream is split on the
    sequence over tensor inside the stage: each tick's message is half a microbatch's tokens."""
    initial, batches, ref_loss, ref_grads, *_ = reference
    sp = rules != "pp_fsdp_tp"
    if rules == "pp_fsdp_tp_sp":  # pp_fsdp_tp with SP (norm_length over tensor): FSDP, TP and SP in a stage
        rules = write_rules(tmp_path, rules, norm_length="tensor")
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, 4, v), f"pipeline.fsdp={gather}", rules=rules,
                                        mesh=mesh))
    params, batch = stored(trainer, initial.params), placed(trainer, batches[0])
    compiled = trainer.jit_loss_and_grads.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    assert close(loss, ref_loss)
    assert_trees_close(canonical(trainer, grads), ref_grads)
    assert hlo_compute.dots(compiled.as_text())["outside"] == 0
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    permutes = {c.shapes for c in found if c.kind == "collective-permute" and c.axes == ("stage",)}
    rows = 32 // 4 // mesh.get("data", 1) // mesh.get("fsdp", 1)
    assert permutes == {(("f32", (rows, 32 // 2 if sp else 32, 64)),)}


MOE = ("model.moe={}", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.balance=sign", "model.layers=4",
       "train.global_batch=16")
# pp_ep with TP inside each stage too: attention heads, the MLP and the experts' MLP over tensor.
EP_TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "expert_mlp": "tensor", "vocab": "tensor"}


def moe_step(trainer: Trainer, params: dict, batch: dict, bias: dict) -> tuple:
    """Loss, gradients and the routing biases' update (the model's order) and the compiled step's text."""
    fn = trainer._jit(lambda p, b, bias: trainer._grads(p, b, None, bias))
    args = (params, placed(trainer, batch), bias)
    compiled = fn.lower(*args).compile()
    loss, grads, aux, _ = compiled(*args)
    update = balance.updated(bias, aux["moe_layers"], trainer.config.model.moe)
    return loss, canonical(trainer, grads), canonical(trainer, update), compiled.as_text()


@pytest.fixture(scope="module")
def moe_reference():
    """One device with the pipeline's 4 microbatches (routing statistics are per microbatch), per dispatch: the
    initial parameters, batch 0, a random routing bias (balancing on), and loss, gradients and bias update."""
    cache = {}

    def get(dispatch: str) -> tuple:
        if dispatch not in cache:
            ref = Trainer.build(tiny_config(*BASE, *MOE, f"model.moe.dispatch={dispatch}", "train.microbatches=4"),
                                jax.devices()[:1])
            params, batch = jax.device_get(ref.init_state().params), jax.device_get(ref.batch(0))
            rng = np.random.default_rng(0)
            bias = jax.tree.map(lambda a: jnp.asarray(rng.normal(scale=0.05, size=a.shape), a.dtype),
                                ref.fresh_balance())
            cache[dispatch] = (params, batch, bias, *moe_step(ref, params, batch, bias)[:3])
        return cache[dispatch]

    return get


@pytest.mark.parametrize("schedule, v, mesh, dispatch, impl", [
    ("1f1b", 1, {"stage": 4, "expert": 2}, "capacity", "shard_map"),
    ("interleaved_1f1b", 2, {"stage": 2, "expert": 2, "data": 2}, "dropless", "shard_map"),
    ("zb_h1", 1, {"stage": 2, "expert": 2, "tensor": 2}, "capacity", "shard_map"),
    ("interleaved_1f1b", 2, {"stage": 2, "expert": 2, "data": 2}, "capacity", "partitioner"),
])
def test_moe_with_expert_parallelism_inside_a_stage(schedule, v, mesh, dispatch, impl, moe_reference, tmp_path):
    """MoE blocks with their experts split over ``expert`` inside each stage equal one device with the same
    microbatches, aux losses included; with bias balancing from a random bias, the biases' update too: each
    stage's loads, stored as its chunks are (two per stage with v = 2, not the model's order), averaged over the
    microbatches. Explicit experts (``model.moe.impl=shard_map``): the loop manual over every axis, the tokens
    exchanged among a stage's devices (all-to-alls; dropless: counts then rows), with TP (``tensor``) the experts'
    MLP split and summed: every matmul of the compiled step in a conditional (idle slots skipped). Partitioner
    experts: the loop manual over ``stage`` alone, idle slots computed and masked."""
    params, batch, bias, ref_loss, ref_grads, ref_update = moe_reference(dispatch)
    rules = write_rules(tmp_path, "pp_ep_tp", base="pp_ep", **EP_TP) if "tensor" in mesh else "pp_ep"
    config = tiny_config(*BASE, *MOE, f"model.moe.dispatch={dispatch}", f"model.moe.impl={impl}",
                         *pipe(schedule, 4, v), rules=rules, mesh=mesh)
    trainer = Trainer.build(config)
    assert trainer.storage.canonical_order == (v == 1)
    loss, grads, update, text = moe_step(trainer, stored(trainer, params), batch, trainer.storage.place_params(bias))
    assert close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)
    assert_trees_close(update, ref_update)
    assert (hlo_compute.dots(text)["outside"] == 0) == (impl == "shard_map")
    if impl == "shard_map":  # the experts' exchange among a stage's devices, in the busy slots' conditionals
        exchange = hlo_compute.dots(text, ("all-to-all",))
        assert exchange["outside"] == 0 and exchange["in_conditional"] > 0


# -- the tables --------------------------------------------------------------------


def simulate(table: schedules.Table) -> None:
    """Run ``table`` symbolically: every slot must hold exactly the message its reader expects."""
    p, v, last = table.p, table.v, table.v * table.p - 1
    acts = [dict() for _ in range(p)]
    grads = [dict() for _ in range(p)]
    cots = [dict() for _ in range(p)]
    seen = set()
    for t in range(table.ticks):
        sent_f, sent_b = [None] * p, [None] * p
        for s in range(p):
            kind, i, c, src = table.f_kind[t, s], table.f_micro[t, s], table.f_chunk[t, s], table.f_src[t, s]
            if i >= 0:
                g = c * p + s
                assert (kind == FIRST) == (g == 0) and (kind == LAST) == (g == last) and src >= 0
                if g == 0:  # the first virtual stage's slot is taken as its forward embeds the tokens
                    acts[s][src] = ("act", i, 0)
                assert acts[s][src] == ("act", i, g), (t, s)
                seen.add(("F", i, g))
                if g < last:
                    sent_f[(s + 1) % p] = ("act", i, g + 1)
            kind, i, c = table.b_kind[t, s], table.b_micro[t, s], table.b_chunk[t, s]
            if kind != IDLE:
                g = c * p + s
                assert ("F", i, g) in seen and (kind == LAST) == (g == last) and (kind == FIRST) == (g == 0)
                assert acts[s][table.b_src[t, s]] == ("act", i, g), (t, s)
                if g < last:
                    assert grads[s][table.b_grad[t, s]] == ("grad", i, g), (t, s)
                seen.add(("B", i, g))
                if table.split:  # the B keeps its units' matmul inputs and output gradients for the W
                    cots[s][table.b_cot[t, s]] = ("cot", i, g)
                if g > 0:
                    sent_b[(s - 1) % p] = ("grad", i, g - 1)
            i, c = table.w_micro[t, s], table.w_chunk[t, s]
            if table.w_kind[t, s] != IDLE:
                g = c * p + s
                assert table.split and ("B", i, g) in seen and ("W", i, g) not in seen
                # The W reads what its B kept alone: the stage inputs are freed at the B.
                assert table.w_src[t, s] == -1 and cots[s][table.w_cot[t, s]] == ("cot", i, g)
                seen.add(("W", i, g))
        for s in range(p):
            if table.recv_f[t, s] >= 0:
                acts[s][table.recv_f[t, s]] = sent_f[s]
            if table.recv_b[t, s] >= 0:
                grads[s][table.recv_b[t, s]] = sent_b[s]
    kinds = ("F", "B", "W") if table.train and table.split else ("F", "B") if table.train else ("F",)
    assert seen == {(k, i, g) for k in kinds for i in range(table.m) for g in range(v * p)}


@pytest.mark.parametrize("schedule, p, m, v", [*GRID, ("1f1b", 3, 7, 1), ("circular", 3, 5, 3),
                                                ("interleaved_1f1b", 3, 6, 3), ("1f1b", 8, 64, 1),
                                                *[("zb_h1", p, k * p, 1) for p in (2, 3, 4, 8) for k in (1, 2, 4)],
                                                ("zb_h1", 3, 7, 1)])
@pytest.mark.parametrize("train", [True, False])
def test_table_runs_every_operation_once_with_its_inputs(schedule, p, m, v, train):
    simulate(schedules.build(schedule, p, m, v, train))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_keeps_a_bounded_stash_where_gpipe_keeps_every_microbatch(p):
    for m in (p, 4 * p, 16 * p):
        assert schedules.build("1f1b", p, m, 1).act_slots <= 2 * p
        assert schedules.build("gpipe", p, m, 1).act_slots == m
        assert schedules.build("interleaved_1f1b", p, m, 2).act_slots <= 4 * p


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved_1f1b", 2)])
def test_counted_bubble_is_the_formula(schedule, v):
    """The step time lost counted from the table (a backward = 3 forwards) is the playbook's (p − 1)/(v·m + p − 1),
    and so is :func:`schedules.formula_bubble`."""
    for p, k in itertools.product((2, 4, 8), (1, 2, 4)):
        m = k * p
        formula = (p - 1) / (v * m + p - 1)
        assert schedules.formula_bubble(p, m, v) == pytest.approx(formula, rel=1e-12)
        assert schedules.build(schedule, p, m, v).bubble() == pytest.approx(formula, rel=1e-9), (p, m)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_bubble_is_its_formula_below_1f1b(p):
    """ZB-H1 in our terms (F 1; B 2: the chunk recomputed, then its input gradient; W 1: the weight matmuls'
    gradients; 1F1B's backward 3), a B alone in its tick and a W with the next F: the bubble counted from the
    table is (p − 1)·(F + B) over a step of m·(F + B + W) + (p − 1)·(F + B) (here exact), below 1F1B's
    (p − 1)/(m + p − 1) on the same (p, m), as is its step; 2m + 2p − 1 ticks. It keeps no more stage inputs
    than 1F1B, with at most p chunks' matmul inputs and output gradients from a B to its W."""
    for m in (p, 2 * p, 4 * p, 8 * p):
        zb, f1b = schedules.build("zb_h1", p, m, 1), schedules.build("1f1b", p, m, 1)
        ours = (p - 1) * (1 + 2) / (m * (1 + 2 + 1) + (p - 1) * (1 + 2))
        assert zb.bubble() == pytest.approx(ours, rel=1e-9) and zb.ticks == 2 * m + 2 * p - 1
        assert zb.bubble() < f1b.bubble() == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
        assert zb.cost() < f1b.cost()
        assert schedules.formula_bubble(p, m, 1, "zb_h1") == pytest.approx(ours, rel=1e-12)
        assert zb.act_slots <= f1b.act_slots and zb.cot_slots <= p


def test_the_head_runs_once_per_microbatch_on_the_last_stage():
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)):
        table = schedules.build(schedule, 4, 8, v)
        assert (table.b_kind == LAST).sum() == 8 and set(np.nonzero(table.b_kind == LAST)[1]) == {3}
        # The last chunk's forward keeps its layers' inputs; the head runs in its backward (training)
        # or in the forward (evaluation).
        assert (table.f_kind == LAST).sum() == 8
        assert (schedules.build(schedule, 4, 8, v, train=False).f_kind == LAST).sum() == 8


# -- memory and the head in the compiled step --------------------------------------------


def temp_bytes(schedule: str, p: int, m: int) -> int:
    """Compiled temporaries per device of a step with m microbatches of 4 sequences (pp x data 4 / p)."""
    config = tiny_config("model.layers=8", f"train.global_batch={4 * m}", *pipe(schedule, m), rules="pp",
                         mesh={"stage": p, "data": 8 // p})
    return xla.memory(xla.compile_step(Trainer.build(config)))["temp"]


def test_1f1b_memory_does_not_grow_with_microbatches_where_gpipe_does():
    """Microbatches of a fixed size: 1F1B's temporaries at m = 16p stay within 10% of m = 4p; GPipe's grow."""
    p = 2
    f1b = {m: temp_bytes("1f1b", p, m) for m in (4 * p, 16 * p)}
    gpipe = {m: temp_bytes("gpipe", p, m) for m in (4 * p, 16 * p)}
    print(f"temp bytes per device: 1f1b {f1b}, gpipe {gpipe}")
    assert f1b[16 * p] <= 1.1 * f1b[4 * p]
    # GPipe stashes every microbatch's stage input: 12p more of them, one 32 x 64 fp32 row on each device.
    assert gpipe[16 * p] - gpipe[4 * p] >= 12 * p * 32 * 64 * 4


def eqns(jaxpr):
    """Every equation of the jaxpr and of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from eqns(sub)


def traced_step(*overrides: str):
    trainer = Trainer.build(tiny_config(*BASE, *pipe("1f1b", 4), *overrides, rules="pp", mesh=MESHES[2]))
    with trainer.scope():
        return jax.make_jaxpr(trainer.loss_and_grads)(trainer.abstract_state().params, trainer.abstract_batch()).jaxpr


def test_the_head_matmul_appears_once_in_the_step():
    """One forward head matmul ([.., embed] -> [.., vocab]) in the traced step: in the last stage's conditional,
    which the table takes once per microbatch."""
    heads = 0
    for eqn in eqns(traced_step()):
        if eqn.primitive.name == "dot_general":
            a, b = (v.aval.shape for v in eqn.invars)
            heads += eqn.outvars[0].aval.shape[-1] == 256 and 64 in (a[-1], b[0])
    assert heads == 1


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_a_layer_is_recomputed_once(remat):
    """Whatever model.remat says, no checkpoint (``remat2``) inside the stage: the backward slot's vjp is the
    one recompute (the same step without a pipeline has one per layer)."""
    assert not [e for e in eqns(traced_step(f"model.remat={remat}")) if e.primitive.name.startswith("remat")]


def test_rules_alone_do_not_run_a_pipeline(reference):
    """``use_rules`` with layers on ``stage`` but no pipeline settings refuses to run the loop on defaults."""
    initial, batches, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe("gpipe", 4), rules="pp", mesh=MESHES[2]))
    with use_rules(trainer.mesh, trainer.rules), pytest.raises(
        ConfigError, match=r"^rules 'pp' put layers on 'stage' \(2 stages\) but no pipeline settings are in effect"
    ):
        jax.eval_shape(trainer.loss, initial.params, batches[0])


# -- errors, before anything compiles --------------------------------------------------


@pytest.fixture(scope="module")
def warm():
    """A valid build first, so that optax's eager kernels are compiled before the error tests watch."""
    Trainer.build(tiny_config(*pipe("gpipe", 2), rules="pp", mesh={"stage": 2, "data": 4}))


def write_rules(tmp_path, name: str, base: str = "pp_fsdp_tp", **changes) -> str:
    table = yaml.safe_load((CONFIG_DIR / "rules" / f"{base}.yaml").read_text())
    table["rules"].update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(table))
    return str(path)


@pytest.mark.parametrize(
    "overrides, mesh, match",
    [
        # Layers that do not split over the stages: refused with the layout, before the model is built.
        (["model.layers=6"], {"stage": 4, "data": 2}, r"^model\.layers \(6\) is not divisible by mesh\.stage \(4\) x "
         r"pipeline\.repeats \(1\); pipeline\.layers_per_stage splits them unevenly$"),
        (["model.layers=4", *pipe("circular", 4, 4)], {"stage": 2, "data": 4}, r"^model\.layers \(4\) is not "
         r"divisible by mesh\.stage \(2\) x pipeline\.repeats \(4\)"),
        (pipe("gpipe", 3), {"stage": 2, "data": 4}, r"^the batch of 16 sequences \(train\.global_batch / "
         r"train\.microbatches\) is not divisible by pipeline\.microbatches \(3\)"),
        (["train.microbatches=2", *pipe("1f1b", 3)], {"stage": 2, "data": 4}, r"^the batch of 8 sequences"),
        (["model.layers=4", *pipe("gpipe", 2)], {"stage": 4, "data": 2}, r"^pipeline\.microbatches \(2\) is fewer "
         r"than the 4 pipeline stages \(mesh\.stage\)"),
        (["model.layers=8", *pipe("interleaved_1f1b", 6, 2)], {"stage": 4, "data": 2},
         r"^pipeline\.schedule=interleaved_1f1b sends microbatches in groups of mesh\.stage \(4\)"),
        (pipe("gpipe", 8), {"stage": 2, "data": 4}, r"^pipeline microbatch: dimension 0 \('batch', size 2\) is not "
         r"divisible by mesh axes \('data', 'fsdp'\) of size 4"),
    ],
)
def test_pipeline_shape_errors(warm, overrides, mesh, match):
    config = tiny_config(*overrides, rules="pp", mesh=mesh)
    with fails_early(match):
        Trainer.build(config)


@pytest.mark.parametrize(
    "override, match",
    [
        ("pipeline.schedule=zb", r"^pipeline\.schedule: 'zb' is not one of gpipe, circular, 1f1b, interleaved_1f1b, "
         r"zb_h1$"),
        ("pipeline.repeats=2", r"^pipeline\.repeats \(2\) needs pipeline\.schedule=circular or interleaved_1f1b"),
        ("pipeline.schedule=circular", r"^pipeline\.schedule=circular needs pipeline\.repeats >= 2"),
        ("pipeline.microbatches=0", r"^pipeline\.microbatches must be at least 1, got 0$"),
        ("pipeline.repeats=0", r"^pipeline\.repeats must be at least 1, got 0$"),
        ("pipeline.micro=2", r"^unknown config key 'pipeline\.micro'"),
    ],
)
def test_pipeline_config_errors(override, match):
    with fails_early(match):
        tiny_config(override)


def test_zb_h1_runs_each_stages_layers_once():
    with fails_early(r"^pipeline\.repeats \(2\) needs pipeline\.schedule=circular or interleaved_1f1b \(zb_h1 runs"):
        tiny_config("pipeline.schedule=zb_h1", "pipeline.repeats=2")


def test_layers_on_stage_and_another_axis(warm, tmp_path):
    path = write_rules(tmp_path, "two", layers=["stage", "data"])
    config = tiny_config("model.layers=4", *pipe("gpipe", 2), rules=path, mesh={"stage": 2, "data": 2, "tensor": 2})
    with fails_early(r"^rules 'two': layers maps to \['stage', 'data'\]; a pipeline needs layers on 'stage' alone"):
        Trainer.build(config)


@pytest.mark.parametrize(
    "changes, overrides, mesh, match",
    [
        ({"norm_length": "tensor"}, ["model.tp_overlap=true"], {"stage": 2, "fsdp": 2, "tensor": 2},
         r"^rules 'x': model\.tp_overlap \(collective matmuls\) inside a pipeline stage nests a shard_map"),
        ({"length": "context", "norm_length": "context"}, [], {"stage": 2, "context": 2, "fsdp": 2},
         r"^rules 'x': context parallelism \(length on \['context'\]\) inside a pipeline stage needs "
         r"model\.attention=ring"),
        ({"norm_length": "tensor"}, ["model.moe={experts: 4}", "model.moe.impl=shard_map"],
         {"stage": 2, "fsdp": 2, "tensor": 2}, r"^rules 'x': model\.moe\.impl=shard_map inside a pipeline stage "
         r"needs the stage's loop manual over every mesh axis, but \['tensor'\] would stay with the partitioner "
         r"\(sequence parallelism, .*model\.moe\.impl=partitioner runs the experts there"),
        ({}, ["pipeline.fsdp=visit", "precision.fp8=delayed"], {"stage": 2, "fsdp": 2, "tensor": 2},
         r"^pipeline\.fsdp=visit: not supported with precision\.fp8=delayed \(the e4m3 copies"),
    ],
)
def test_what_a_stage_cannot_run_is_refused(warm, tmp_path, changes, overrides, mesh, match):
    config = tiny_config(*pipe("1f1b", 2), *overrides, rules=write_rules(tmp_path, "x", **changes), mesh=mesh)
    with fails_early(match):
        Trainer.build(config)
