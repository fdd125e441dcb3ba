"""Pipeline parallelism: the pipelined model equals one device; the schedule it runs; its errors."""

from __future__ import annotations

import itertools

import jax
import pytest
import yaml
from conftest import tiny_config
from test_errors import fails_early
from test_layouts import RTOL, assert_trees_close

from jaxscale.analysis import hlo, xla
from jaxscale.config import CONFIG_DIR
from jaxscale.parallel import pipeline
from jaxscale.train import Trainer

# Eight layers split over up to 4 stages x 2 repeats; 32 sequences cut into up to 16 microbatches.
BASE = ("train.global_batch=32", "model.layers=8")
MESHES = {2: {"stage": 2, "data": 4}, 4: {"stage": 4, "data": 2}}
GRID = [(p, k * p, v) for p in (2, 4) for k in (1, 2, 4) for v in (1, 2)]


def pipe(m: int, v: int) -> list[str]:
    schedule = "circular" if v > 1 else "gpipe"
    return [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}"]


@pytest.fixture(scope="module", autouse=True)
def fast_codegen():
    """LLVM's expensive passes off for this module's compilations: halves compile time; the HLO (partitioning,
    collectives) is unchanged and every result is still checked against one device."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


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


def placed(trainer: Trainer, batch):
    """A host batch in the trainer's layout."""
    return jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))


@pytest.mark.parametrize("p, m, v", GRID)
def test_pipeline_matches_single_device(p, m, v, reference):
    initial, batches, ref_loss, ref_grads, *_ = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe(m, v), rules="pp", mesh=MESHES[p]))
    params = jax.device_put(initial.params, trainer.param_shardings())
    loss, grads = trainer.loss_and_grads(params, placed(trainer, batches[0]))
    assert abs(float(loss) - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(grads, ref_grads)


def test_pp_fsdp_tp_training_step_matches_single_device(reference):
    """Two steps of pp x fsdp x tp (2 x 2 x 2), circular; the step's pipeline moves only each device's rows."""
    initial, batches, _, _, ref_params, ref_outs = reference
    mesh = {"stage": 2, "fsdp": 2, "tensor": 2}
    trainer = Trainer.build(tiny_config(*BASE, *pipe(4, 2), rules="pp_fsdp_tp", mesh=mesh))
    compiled = xla.compile_step(trainer)
    state = jax.device_put(initial, trainer.state_shardings)
    for batch, ref_out in zip(batches, ref_outs, strict=True):
        state, out = compiled(state, placed(trainer, batch))
        for key in ("loss", "grad_norm"):
            assert abs(float(out[key]) - ref_out[key]) <= RTOL * abs(ref_out[key]), key
    assert_trees_close(state.params, ref_params)
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
    assert specs == jax.tree.map(lambda s: s.spec, trainer.param_shardings())
    # The HLO: each tick sends one microbatch shard (8 rows / fsdp 2 = 4 rows, 32 x 64) to the next
    # stage, forward and backward; no activation is gathered over the data axes (partial-manual gather).
    found = hlo.collectives(compiled.as_text(), trainer.mesh)
    loop = [c for c in found if c.loops and c.loops[-1].trips == pipeline.ticks(2, 4, 2)]
    permutes = [c for c in loop if c.kind == "collective-permute"]
    assert {(c.axes, c.shapes, c.runs) for c in permutes} == {(("stage",), (("f32", (4, 32, 64)),), 9)}
    assert sorted(c.phase for c in permutes) == ["backward", "forward"]
    for c in loop:
        if c.axes is None or {"data", "fsdp"} & set(c.axes):
            assert all(shape[-2:] != (32, 64) for _, shape in c.shapes), f"{c.kind} of activations over {c.axes}"


def test_data_parallel_gradients_are_reduced_once_per_step():
    """Under pp with data = 4, nothing crosses ``data`` inside the pipeline loop; block gradients cross it once."""
    trainer = Trainer.build(tiny_config(*BASE, *pipe(4, 1), rules="pp", mesh=MESHES[2]))
    found = hlo.collectives(xla.compile_step(trainer).as_text(), trainer.mesh)
    loop = [c for c in found if c.loops and c.loops[-1].trips == pipeline.ticks(2, 4, 1)]
    assert {c.kind for c in loop} == {"collective-permute"}
    # wq's gradient on a stage: [repeats 1, 8 layers / 2 stages, embed 64, heads 8, head_dim 8].
    wq_grad = [c for c in found if c.axes == ("data",) and ("f32", (1, 4, 64, 8, 8)) in c.shapes]
    assert [(c.kind, c.runs) for c in wq_grad] == [("all-reduce", 1)]


def test_parameters_per_device_fall_as_one_over_p():
    blocks, opt = {}, {}
    for p in (1, 2, 4):
        trainer = Trainer.build(tiny_config(*BASE, *pipe(p, 1), rules="pp", mesh={"stage": p}), jax.devices()[:p])
        state = trainer.abstract_state()
        blocks[p] = xla.per_device_bytes(state.params["blocks"])
        opt[p] = xla.per_device_bytes(state.opt_state)
    assert blocks[1] == 2 * blocks[2] == 4 * blocks[4]
    # Adam's two moments of the blocks fall with them; the rest (embedding, head) is replicated.
    assert opt[1] - opt[2] == 2 * (blocks[1] - blocks[2]) and opt[2] - opt[4] == 2 * (blocks[2] - blocks[4])


# -- the schedule ------------------------------------------------------------------


@pytest.mark.parametrize("p, m, v", [*GRID, (3, 5, 3), (4, 7, 1)])
def test_schedule_runs_each_group_once_in_layer_order(p, m, v):
    table = pipeline.schedule(p, m, v)
    assert table.shape == (v * m + p - 1, p, 2)
    busy = table[..., 0] >= 0
    assert busy.sum(axis=0).tolist() == [v * m] * p
    assert (1 - busy.mean()) == pytest.approx((p - 1) / (v * m + p - 1))  # FORMULAS.md's bubble
    when = {}
    for t, s in itertools.product(range(table.shape[0]), range(p)):
        if busy[t, s]:
            repeat, micro = table[t, s]
            assert (micro, repeat, s) not in when
            when[micro, repeat, s] = t
    for micro in range(m):
        for r in range(v):
            # Stage to stage within a repeat: the next tick (the ppermute's output is consumed at once) ...
            assert all(when[micro, r, s] - when[micro, r, s - 1] == 1 for s in range(1, p))
            # ... and round the ring to the next repeat: later (stage 0 keeps it until then).
            assert r == 0 or when[micro, r, 0] > when[micro, r - 1, p - 1]


# -- errors, before anything compiles --------------------------------------------------


@pytest.fixture(scope="module")
def warm():
    """A valid build first, so that optax's eager kernels are compiled before the error tests watch."""
    Trainer.build(tiny_config(*pipe(2, 1), rules="pp", mesh={"stage": 2, "data": 4}))


def write_rules(tmp_path, name: str, **changes) -> str:
    table = yaml.safe_load((CONFIG_DIR / "rules" / "pp_fsdp_tp.yaml").read_text())
    table["rules"].update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(table))
    return str(path)


@pytest.mark.parametrize(
    "overrides, mesh, match",
    [
        # Layers that do not split over the stages fail as any parameter that does not split.
        (["model.layers=6"], {"stage": 4, "data": 2}, r"^param blocks\.\S+: dimension 0 \('layers', size 6\) is not "
         r"divisible by mesh axes stage of size 4$"),
        (["model.layers=4", *pipe(4, 4)], {"stage": 2, "data": 4}, r"^model\.layers \(4\) is not divisible by "
         r"mesh\.stage \(2\) x pipeline\.repeats \(4\)"),
        (pipe(3, 1), {"stage": 2, "data": 4}, r"^the batch of 16 sequences \(train\.global_batch / "
         r"train\.microbatches\) is not divisible by pipeline\.microbatches \(3\)"),
        (["train.microbatches=2", *pipe(3, 1)], {"stage": 2, "data": 4}, r"^the batch of 8 sequences"),
        (["model.layers=4", *pipe(2, 1)], {"stage": 4, "data": 2}, r"^pipeline\.microbatches \(2\) is fewer than "
         r"the 4 pipeline stages \(mesh\.stage\)"),
        (pipe(8, 1), {"stage": 2, "data": 4}, r"^pipeline microbatch: dimension 0 \('batch', size 2\) is not "
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
        ("pipeline.schedule=1f1b", r"^pipeline\.schedule: '1f1b' is not one of gpipe, circular$"),
        ("pipeline.repeats=2", r"^pipeline\.repeats \(2\) needs pipeline\.schedule=circular"),
        ("pipeline.schedule=circular", r"^pipeline\.schedule=circular needs pipeline\.repeats >= 2"),
        ("pipeline.microbatches=0", r"^pipeline\.microbatches must be at least 1, got 0$"),
        ("pipeline.repeats=0", r"^pipeline\.repeats must be at least 1, got 0$"),
        ("pipeline.micro=2", r"^unknown config key 'pipeline\.micro'"),
    ],
)
def test_pipeline_config_errors(override, match):
    with fails_early(match):
        tiny_config(override)


def test_layers_on_stage_and_another_axis(warm, tmp_path):
    path = write_rules(tmp_path, "two", layers=["stage", "data"])
    config = tiny_config("model.layers=4", *pipe(2, 1), rules=path, mesh={"stage": 2, "data": 2, "tensor": 2})
    with fails_early(r"^rules 'two': layers maps to \['stage', 'data'\]; a pipeline needs layers on 'stage' alone"):
        Trainer.build(config)


def test_sequence_parallelism_inside_a_stage(warm, tmp_path):
    path = write_rules(tmp_path, "sp", norm_length="tensor")
    config = tiny_config(*pipe(2, 1), rules=path, mesh={"stage": 2, "fsdp": 2, "tensor": 2})
    with fails_early(r"^rules 'sp': sequence parallelism \(norm_length on \('tensor',\)\) inside a pipeline stage"):
        Trainer.build(config)


def test_context_parallelism_inside_a_stage(warm, tmp_path):
    path = write_rules(tmp_path, "cp", length="context", norm_length="context")
    config = tiny_config("model.attention=ring", *pipe(2, 1), rules=path, mesh={"stage": 2, "context": 2, "data": 2})
    with fails_early(r"^rules 'cp': context parallelism \(length on \['context'\]\) inside a pipeline stage"):
        Trainer.build(config)
