"""jaxscale.analysis: the HLO collective parser on hand-made modules, then compiled steps against docs/formulas.md.

Sizes of the tiny model (conftest): Ψ = 106,816 parameters, fp32, so 4Ψ = 427,264 bytes; the layers
hold Ψ_layers = 73,984 of them, the embedding and the untied output head V·h = 16,384 each. Every
compiled layout here splits the batch or parameters 8 ways (N = 8), so (N−1)/N = 7/8.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers import Trainers

from jaxscale.analysis import hlo, hlo_compute, xla
from jaxscale.analysis.formulas import formulas
from jaxscale.analysis.inspect import step_report
from jaxscale.analysis.params import trainer_inputs
from jaxscale.config.flops import param_count
from jaxscale.config.read import MESH_AXES
from jaxscale.training.trainer import Trainer

# -- the parser, on hand-made HLO --------------------------------------------------

# data=2, fsdp=2, tensor=2: device id (position in mesh.devices.flat) = 4·data + 2·fsdp + tensor.
MESH_222 = jax.make_mesh((2, 1, 2, 1, 1, 1, 2), MESH_AXES)
MESH_FSDP8 = jax.make_mesh((1, 1, 8, 1, 1, 1, 1), MESH_AXES)


def one_all_reduce(groups: str) -> str:
    return f"""HloModule m
ENTRY %main (p: f32[64]) -> f32[64] {{
  %p = f32[64]{{0}} parameter(0)
  ROOT %ar = f32[64]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""  # noqa: E501


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ("tensor",)),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("{}", ("data", "fsdp", "tensor")),
        ("[4,2]<=[8]", ("tensor",)),
        ("[1,8]<=[8]", ("data", "fsdp", "tensor")),
        ("[4,2]<=[2,4]T(1,0)", ("data",)),
        ("[4,2]<=[2,2,2]T(0,2,1)", ("fsdp",)),
        ("[2,4]<=[2,2,2]T(1,0,2)", ("data", "tensor")),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ("data",)),
        ("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}", ("data", "tensor")),
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ("fsdp", "tensor")),
        ("mesh['axis_0'=8] {'axis_0':(2)2}", ("fsdp",)),
        ("mesh['axis_0'=8] {'axis_0':(1)2}", ("data",)),
    ],
)
def test_replica_group_forms(groups, axes):
    (c,) = hlo.collectives(one_all_reduce(groups), MESH_222)
    assert c.axes == axes
    assert c.n == math.prod(MESH_222.shape[a] for a in axes)
    assert sorted(d for g in c.groups for d in g) == list(range(8))  # a partition of the devices


def test_part_of_an_axis_is_named_as_a_sub_axis():
    # {i, i+4} on fsdp=8: the major factor 2 of the axis, XLA's 'fsdp':(1)2.
    (c,) = hlo.collectives(one_all_reduce("[4,2]<=[2,4]T(1,0)"), MESH_FSDP8)
    assert c.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert c.axes == ("fsdp:(1)2",)


NESTED = """HloModule nested, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_gather (param_0: f32[16]) -> f32[128] {
  %param_0 = f32[16]{0} parameter(0)
  ROOT %all-gather.1 = f32[128]{0} all-gather(%param_0), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
}

%inner_cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %limit = s32[] constant(4)
  ROOT %cmp = pred[] compare(%i, %limit), direction=DIRECTION
}

%inner_body (p.1: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p.1 = (s32[], f32[64]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %x = f32[64]{0} get-tuple-element(%p.1), index=1
  %all-reduce.1 = f32[64]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i.1, %one)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %all-reduce.1)
}

%outer_cond (q: (s32[], f32[64], f32[16])) -> pred[] {
  %q = (s32[], f32[64]{0}, f32[16]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

%outer_body (q.1: (s32[], f32[64], f32[16])) -> (s32[], f32[64], f32[16]) {
  %q.1 = (s32[], f32[64]{0}, f32[16]{0}) parameter(0)
  %j.1 = s32[] get-tuple-element(%q.1), index=0
  %a = f32[64]{0} get-tuple-element(%q.1), index=1
  %b = f32[16]{0} get-tuple-element(%q.1), index=2
  %zero = s32[] constant(0)
  %w.in = (s32[], f32[64]{0}) tuple(%zero, %a)
  %w = (s32[], f32[64]{0}) while(%w.in), condition=%inner_cond, body=%inner_body
  %a.1 = f32[64]{0} get-tuple-element(%w), index=1
  %gathered = f32[128]{0} fusion(%b), kind=kLoop, calls=%fused_gather
  %one.1 = s32[] constant(1)
  %next.1 = s32[] add(%j.1, %one.1)
  ROOT %t.1 = (s32[], f32[64]{0}, f32[16]{0}) tuple(%next.1, %a.1, %b)
}

ENTRY %main (a.0: f32[64], b.0: f32[16]) -> f32[64] {
  %a.0 = f32[64]{0} parameter(0)
  %b.0 = f32[16]{0} parameter(1)
  %zero.1 = s32[] constant(0)
  %init = (s32[], f32[64]{0}, f32[16]{0}) tuple(%zero.1, %a.0, %b.0)
  %loop = (s32[], f32[64]{0}, f32[16]{0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %res = f32[64]{0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


@pytest.mark.parametrize(("direction", "inner_trips"), [("LT", 4), ("LE", 5)])
def test_nested_loops_multiply_and_fusions_are_searched(direction, inner_trips):
    # The outer while has known_trip_count 3; the inner one only its condition i < 4 (or i <= 4).
    found = {c.name: c for c in hlo.collectives(NESTED.replace("DIRECTION", direction), MESH_222)}
    ar, ag = found["all-reduce.1"], found["all-gather.1"]
    assert [loop.trips for loop in ar.loops] == [3, inner_trips]
    assert ar.runs == 3 * inner_trips and ar.computation == "inner_body"
    assert ar.wire_bytes == 2 * 7 / 8 * 256 * ar.runs
    assert (ag.runs, ag.computation, ag.n, ag.result_bytes, ag.operand_bytes) == (3, "fused_gather", 8, 512, 64)
    assert ag.wire_bytes == 7 / 8 * 512 * 3
    assert hlo.in_loop(list(found.values()), trips=inner_trips) == [ar]


ASYNC = """HloModule async

%wrapped_reduce_scatter (param: f32[1024]) -> f32[128] {
  %param = f32[1024]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[128]{0} reduce-scatter(%param), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

ENTRY %main (p0: f32[1024], p1: f32[128], p2: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[128]{0} parameter(1)
  %p2 = f32[1024]{0} parameter(2)
  %ars = f32[1024]{0} all-reduce-start(%p0), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p1), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[1024]{0} all-gather-done(%ags)
  %rss = ((f32[1024]{0}), f32[128]{0}) async-start(%p2), calls=%wrapped_reduce_scatter
  %rsd = f32[128]{0} async-done(%rss)
  %cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%p0), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  %cpd = f32[1024]{0} collective-permute-done(%cps)
  %a2a = f32[1024]{0} all-to-all(f32[1024]{0} %p2), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %out = (f32[1024]{0}, f32[1024]{0}, f32[128]{0}, f32[1024]{0}, f32[1024]{0}) tuple(%ard, %agd, %rsd, %cpd, %a2a)
}
"""  # noqa: E501


def test_async_forms_count_once_with_the_formula_bytes():
    found = {c.kind: c for c in hlo.collectives(ASYNC, MESH_222)}
    assert sorted(found) == sorted(hlo.KINDS)  # one each: the -done ops are not collectives
    size = 4096  # f32[1024]
    assert found["all-reduce"].is_async and found["all-reduce"].wire_bytes == 2 * 7 / 8 * size
    assert found["all-gather"].is_async and found["all-gather"].shapes == (("f32", (1024,)),)
    assert found["all-gather"].wire_bytes == 7 / 8 * size
    assert found["reduce-scatter"].computation == "wrapped_reduce_scatter"
    assert found["reduce-scatter"].operand_bytes == size and found["reduce-scatter"].wire_bytes == 7 / 8 * size
    assert found["all-to-all"].wire_bytes == 7 / 8 * size  # inline-typed operand
    permute = found["collective-permute"]
    assert permute.wire_bytes == size and permute.axes == ("tensor",)  # pairs stay within tensor groups
    totals = hlo.summarize(list(found.values()))
    assert totals["total"]["wire_bytes"] == size * (2 * 7 / 8 + 3 * 7 / 8 + 1)


SLICED = """HloModule sliced

%fused_slice (param_0: f32[64,128], param_1: s32[]) -> f32[ROWS,128] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[ROWS,128]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={ROWS,128}
}

ENTRY %main (g: f32[64,128], h: f32[64], off: s32[]) -> (f32[ROWS,128], f32[64]) {
  %g = f32[64,128]{1,0} parameter(0)
  %h = f32[64]{0} parameter(1)
  %off = s32[] parameter(2)
  %all-reduce.1 = (f32[64,128]{1,0}, f32[64]{0}) all-reduce(%g, %h), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %gte.0 = f32[64,128]{1,0} get-tuple-element(%all-reduce.1), index=0
  %bitcast.1 = f32[64,128]{1,0} bitcast(%gte.0)
  %sliced = f32[ROWS,128]{1,0} fusion(%bitcast.1, %off), kind=kLoop, calls=%fused_slice
  %gte.1 = f32[64]{0} get-tuple-element(%all-reduce.1), index=1
  %twice = f32[64]{0} add(%gte.1, %gte.1)
  ROOT %out = (f32[ROWS,128]{1,0}, f32[64]{0}) tuple(%sliced, %twice)
}
"""  # noqa: E501


def test_all_reduce_then_slice_reads_as_reduce_scatter():
    # Element 0 (32 KiB) is only ever sliced to its 1/8 (through a tuple element, a bitcast and a
    # fusion parameter): a reduce-scatter on GPU/TPU. Element 1 (256 B) is used whole: a real all-reduce.
    (c,) = hlo.collectives(SLICED.replace("ROWS", "8"), MESH_222)
    assert (c.size, c.sliced_bytes, c.reading) == (32768 + 256, 32768, "all-reduce")
    assert c.wire_bytes == 2 * 7 / 8 * (32768 + 256)
    assert c.rs_wire_bytes == 7 / 8 * 32768 + 2 * 7 / 8 * 256
    # Without the whole-use element the op reads as a reduce-scatter.
    only = SLICED.replace("ROWS", "8").replace(", %h), channel", "), channel")
    only = only.replace("(f32[64,128]{1,0}, f32[64]{0}) all-reduce", "(f32[64,128]{1,0}) all-reduce")
    (c,) = hlo.collectives(only, MESH_222)
    assert c.reading == hlo.SLICED and c.rs_wire_bytes == c.wire_bytes / 2
    # A slice of 1/4 on 8 devices is not each device's shard: not a reduce-scatter.
    (c,) = hlo.collectives(SLICED.replace("ROWS", "16"), MESH_222)
    assert c.sliced_bytes == 0
    # Over pairs {d, d + 4} (data), a half sliced by a per-device table: each device of a pair its own half reads
    # as a reduce-scatter; both the same half (the table follows another axis, as a stage sum sliced to a TP
    # shard) does not.
    pairs = only.replace("[8,128]", "[32,128]").replace("={8,128}", "={32,128}")
    pairs = pairs.replace("[1,8]<=[8]", "{{0,4},{1,5},{2,6},{3,7}}")
    pairs = pairs.replace("%off), kind", "%off, %t), kind").replace(
        "%off = s32[] parameter(2)", "%off = s32[] parameter(2)\n  %t = u32[8]{0} constant({TABLE})")
    for table, sliced in (("0, 0, 0, 0, 1, 1, 1, 1", 32768), ("0, 1, 0, 1, 0, 1, 0, 1", 0)):
        (c,) = hlo.collectives(pairs.replace("TABLE", table), MESH_222)
        assert (c.axes, c.sliced_bytes) == (("data",), sliced)


# -- compiled steps ----------------------------------------------------------------


class Step(NamedTuple):
    trainer: Trainer
    compiled: object
    found: list[hlo.Collective]


def compile_step(trainers: Trainers, rules: str, mesh: dict[str, int], *overrides: str) -> Step:
    trainer, compiled = trainers.step(*overrides, rules=rules, mesh=mesh)
    return Step(trainer, compiled, hlo.collectives(compiled.as_text(), trainer.mesh))


@pytest.fixture(scope="module")
def dp(trainers) -> Step:
    return compile_step(trainers, "dp", {"data": 8})


@pytest.fixture(scope="module")
def zero1(trainers) -> Step:
    return compile_step(trainers, "zero1", {"data": 8})


@pytest.fixture(scope="module")
def zero2(trainers) -> Step:
    return compile_step(trainers, "zero2", {"data": 8})


@pytest.fixture(scope="module")
def zero3(trainers) -> Step:
    return compile_step(trainers, "zero3", {"fsdp": 8})


@pytest.fixture(scope="module")
def zero3_remat(trainers) -> Step:
    return compile_step(trainers, "zero3", {"fsdp": 8}, "model.remat=full")


@pytest.fixture(scope="module")
def tp(trainers) -> Step:
    return compile_step(trainers, "tp", {"data": 2, "tensor": 4})


def formulas_of(trainer: Trainer) -> dict:
    return formulas(trainer.config.model, *trainer_inputs(trainer))


def psi(step: Step) -> int:
    total = param_count(step.trainer.config.model)["total"]
    assert total == sum(math.prod(x.shape) for x in jax.tree.leaves(step.trainer.abstract_params))
    return total


def psi_layers(step: Step) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(step.trainer.abstract_params["blocks"]))


def scalar_bytes(tree) -> int:
    """Bytes of the scalars (step, Adam's and the schedule's counts): replicated in every layout."""
    return sum(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if x.ndim == 0)


def wire(found: list[hlo.Collective], rs: bool = False, **match) -> float:
    """Summed wire bytes (the reduce-scatter reading if ``rs``) of the collectives whose attributes equal ``match``."""
    chosen = [c for c in found if all(getattr(c, k) == v for k, v in match.items())]
    return sum(c.rs_wire_bytes if rs else c.wire_bytes for c in chosen)


def test_zero3_state_is_an_eighth_of_dp(dp, zero3):
    state = {name: step.trainer.abstract_state() for name, step in (("dp", dp), ("zero3", zero3))}
    scalars = scalar_bytes(state["dp"])
    assert scalars == scalar_bytes(state["zero3"]) == 12
    held = {name: xla.per_device_bytes(s) for name, s in state.items()}
    # Params + Adam from the shardings: exactly 1/8 once the three replicated int32 scalars are set aside.
    assert held["dp"] - scalars == 12 * psi(dp)
    assert held["zero3"] - scalars == (held["dp"] - scalars) / 8
    # The compiled argument buffers are exactly that state plus the device's 1/8 of the batch: the
    # compiler agrees with the shardings to the byte (ratio 7.97, not 8, only for scalars and batch).
    for name, step in (("dp", dp), ("zero3", zero3)):
        batch = xla.per_device_bytes(step.trainer.abstract_batch())
        assert xla.memory(step.compiled)["argument"] == held[name] + batch
    # The donated state is aliased in and out: all but the batch.
    assert xla.memory(zero3.compiled)["alias"] == held["zero3"]


def test_zero1_shards_the_optimizer_state_only(dp, zero1):
    parts = {name: xla.state_bytes(step.trainer) for name, step in (("dp", dp), ("zero1", zero1))}
    assert parts["zero1"]["params"] == parts["dp"]["params"] == 4 * psi(dp)  # whole fp32 parameters
    adam_scalars = scalar_bytes(dp.trainer.abstract_state().opt_state)
    assert parts["zero1"]["opt_state"] - adam_scalars == (parts["dp"]["opt_state"] - adam_scalars) / 8
    formulas = formulas_of(zero1.trainer)
    assert formulas["zero_stage"] == 1 and formulas["adam_bytes"] == parts["zero1"]["opt_state"] - adam_scalars


def test_dp_gradient_all_reduce_matches_the_formula(dp):
    # XLA:CPU combines the gradients into two tuple all-reduces over 'data': one in the backward
    # layer scan (the layer's gradients, run L times) and one after it (embedding, head, final norm,
    # plus the loss scalar). Nothing else crosses devices.
    assert {(c.kind, c.axes) for c in dp.found} == {("all-reduce", ("data",))}
    in_scan = hlo.in_loop(dp.found, trips=dp.trainer.config.model.layers)
    assert len(in_scan) == 1 and in_scan[0].phase == "backward"
    assert in_scan[0].wire_bytes == 2 * 7 / 8 * 4 * psi_layers(dp)
    # The loss (and nothing else) rides along: a few bytes over 2(N−1)/N·Ψ·4, under 0.01%.
    formula = formulas_of(dp.trainer)["dp_comm_bytes"]
    assert formula == 2 * 7 / 8 * 4 * psi(dp)
    measured = hlo.summarize(dp.found)["total"]["wire_bytes"]
    assert formula <= measured <= formula * 1.0001


def test_zero3_gathers_each_pass_and_scatters_gradients(zero3, zero3_remat):
    """ZeRO-3 on fsdp=8, against 3·(N−1)/N·Ψ·4 in the reduce-scatter reading.

    Measured: the layer scan's body gathers every layer parameter forward and *again* backward,
    although remat is off (the step is compiled with model.remat=none): the full weights are
    gathered inside the scan body from the sharded slice, so they are never residuals, and the
    backward body gathers them anew (with remat=full the count is the same, plus the norm scales
    gathered once more for the recomputation). The gradients leave the backward scan as an
    all-reduce + 1/8 slice (XLA:CPU's reduce-scatter). So the scan moves exactly
    3·(N−1)/N·Ψ_layers·4. The two V×h matrices do not follow the formula: the embedding is never
    gathered (its rows are looked up on the shards, and an all-to-all moves the activations), the
    output head is gathered once forward and reused, and its gradient is computed in place from
    all-gathered targets and all-to-all'd activations rather than reduce-scattered.
    """
    layers = zero3.trainer.config.model.layers
    per_pass = 7 / 8 * 4 * psi_layers(zero3)
    for step in (zero3, zero3_remat):
        scan = hlo.in_loop(step.found, trips=layers)
        assert wire(scan, kind="all-gather", phase="forward") == pytest.approx(per_pass)
        assert wire(scan, True, reading=hlo.SLICED) == pytest.approx(per_pass)
        assert all(c.axes == ("fsdp",) for c in step.found)
    # Backward gathers: the same pass again, remat or not (remat=full adds only the two norm
    # scales' re-gather for the recomputation: 2·7/8·256 B per layer, 0.3%).
    backward = wire(hlo.in_loop(zero3.found, trips=layers), kind="all-gather", phase="backward")
    assert backward == pytest.approx(per_pass)
    backward_remat = wire(hlo.in_loop(zero3_remat.found, trips=layers), kind="all-gather", phase="backward")
    assert backward_remat == pytest.approx(per_pass, rel=0.005)

    # Whole step. Forward gathers: every parameter but the embedding.
    v_h = 4 * param_count(zero3.trainer.config.model)["embedding"]
    params = 4 * psi(zero3)
    forward = [c for c in zero3.found if c.phase == "forward" and c.kind == "all-gather" and c.shapes[0][0] == "f32"]
    assert wire(forward) == pytest.approx(7 / 8 * (params - v_h))
    # Total, reduce-scatter reading: the formula less the four V×h passes that do not happen
    # (embedding forward and backward gathers, head backward gather and gradient scatter:
    # −4·7/8·V·h·4), plus what replaces them (two activation all-to-alls, the targets' gather,
    # scalars: +3.4% measured), within 5%. Here V·h is 31% of Ψ; in a real model it is a few %.
    formula = formulas_of(zero3.trainer)["dp_comm_bytes"]
    assert formula == 3 * 7 / 8 * params
    measured = hlo.summarize(zero3.found)["total"]["rs_wire_bytes"]
    assert measured == pytest.approx(formula - 4 * 7 / 8 * v_h, rel=0.05)
    # As compiled on CPU (all-reduce + slice), the gradient part costs twice as much.
    assert hlo.summarize(zero3.found)["total"]["wire_bytes"] > measured * 1.3


def test_zero1_and_zero2_communication(dp, zero1, zero2):
    # Both all-gather the updated parameters once: exactly (N−1)/N·Ψ·4.
    params = 4 * psi(dp)
    for step in (zero1, zero2):
        assert wire(step.found, kind="all-gather", phase="update") == 7 / 8 * params
    # Without accumulation ZeRO-1 and ZeRO-2 move the same bytes: the gradients go straight to the
    # optimizer state's layout (reduce-scatter), the update runs on the shard, the parameters are
    # all-gathered. ZeRO-2 differs only in the accumulator's layout, with train.microbatches > 1.
    totals = [hlo.summarize(step.found)["total"]["wire_bytes"] for step in (zero1, zero2)]
    assert totals[0] == pytest.approx(totals[1], rel=1e-4)
    # The layers' gradients are all-reduce + 1/8 slice, i.e. a
    # reduce-scatter. In that reading the step is 2·(N−1)/N·Ψ·4 less the output head's gradient
    # scatter (computed in place, as in the zero3 test: −7/8·V·h·4) plus its all-to-all and
    # gathered targets (+2.4% measured), within 3%.
    scan = hlo.in_loop(zero2.found, trips=zero2.trainer.config.model.layers)
    assert wire(scan, True, reading=hlo.SLICED) == 7 / 8 * 4 * psi_layers(zero2)
    formula = formulas_of(zero2.trainer)["dp_comm_bytes"]
    v_h = 4 * param_count(zero2.trainer.config.model)["embedding"]
    measured = hlo.summarize(zero2.found)["total"]["rs_wire_bytes"]
    assert measured == pytest.approx(formula - 7 / 8 * v_h, rel=0.03)


def test_tp_activation_all_reduces(tp):
    # Megatron: per layer 2 all-reduces of b·s·h forward (attention out, MLP out), over 'tensor'.
    config = tp.trainer.config
    b = config.train.global_batch // tp.trainer.mesh.shape["data"]
    bsh = b * config.train.seq_len * config.model.embed * 4
    scan = [c for c in hlo.in_loop(tp.found, trips=config.model.layers) if c.axes == ("tensor",)]
    forward = [c for c in scan if c.phase == "forward"]
    assert [c.operand_bytes for c in forward] == [bsh, bsh]
    assert wire(forward) == config.model.layers * 2 * (2 * 3 / 4 * bsh)
    # Backward, XLA:CPU all-reduces each input-gradient partial separately (dq, dk, dv and dgate,
    # dup: 5·b·s·h per layer) where Megatron sums them first (2·b·s·h): 2.5x the formula's backward.
    backward = [c for c in scan if c.phase == "backward"]
    assert sum(c.operand_bytes for c in backward) >= 2 * bsh
    # The gradients' all-reduce runs over 'data' only, on what each tensor rank holds: the formula
    # with Ψ_t/t + (Ψ − Ψ_t), 2·(2−1)/2·4·26,944 B, plus the loss scalar riding along.
    assert {c.axes for c in tp.found} == {("tensor",), ("data",)}
    formulas = formulas_of(tp.trainer)
    assert formulas["params_bytes"] == xla.state_bytes(tp.trainer)["params"]
    data = hlo.summarize(tp.found)["by_axes"]["data"]["wire_bytes"]
    assert formulas["dp_comm_bytes"] <= data <= formulas["dp_comm_bytes"] * 1.0001


def test_step_report_is_json(zero3):
    report = step_report(zero3.trainer, zero3.compiled)
    assert json.loads(json.dumps(report)) == report
    assert report["memory"]["argument"] == sum(report["state"].values())
    assert set(report["collectives"]["by_axes"]) == {"fsdp"}
    assert report["formulas"]["zero_stage"] == 3


def test_tp_sp_layer_moves_activations_by_gather_and_scatter_only(trainers):
    # Megatron SP: inside the layer scan, activations move by all-gather and reduce-scatter over
    # 'tensor' (b·s·h each, 2 of each per layer and pass); no all-reduce of activation size is left.
    step = compile_step(trainers, "tp_sp", {"data": 2, "tensor": 4})
    config, mesh = step.trainer.config, step.trainer.mesh
    b = config.train.global_batch // mesh.shape["data"]
    bsh = b * config.train.seq_len * config.model.embed * 4
    scan = hlo.in_loop(step.found, trips=config.model.layers)
    # Over 'data' runs the weight gradients' all-reduce (inside the shard_map, so inside the scan).
    big = [c for c in scan if c.axes == ("tensor",) and max(c.operand_bytes, c.result_bytes) >= bsh // 4]
    assert not [c for c in big if c.kind == "all-reduce"], "an activation-sized all-reduce in the layer body"
    gathers = [c for c in big if c.kind == "all-gather"]
    scatters = [c for c in big if c.kind == "reduce-scatter"]
    assert sorted(c.phase for c in gathers) == ["backward", "backward", "forward", "forward"]
    assert sorted(c.phase for c in scatters) == ["backward", "backward", "forward", "forward"]
    assert all(c.result_bytes == bsh for c in gathers) and all(c.operand_bytes == bsh for c in scatters)
    # Same wire bytes as TP's all-reduces: 4 x (t−1)/t·b·s·h per layer and pass.
    assert wire(gathers) + wire(scatters) == config.model.layers * 8 * 3 / 4 * bsh


TICKS = """HloModule ticks

%idle (x.0: f32[64]) -> f32[64] {
  ROOT %x.0 = f32[64]{0} parameter(0)
}

%taken (x.2: f32[64]) -> f32[64] {
  %x.2 = f32[64]{0} parameter(0)
  ROOT %all-gather.1 = f32[64]{0} all-gather(%x.2), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
}

%busy (x.1: f32[64]) -> f32[64] {
  %x.1 = f32[64]{0} parameter(0)
  %all-reduce.1 = f32[64]{0} all-reduce(%x.1), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %l = f32[4,16]{1,0} reshape(%all-reduce.1)
  %r = f32[16,8]{1,0} constant({...})
  %dot.1 = f32[4,8]{1,0} dot(%l, %r), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %head = pred[] constant(true)
  ROOT %inner = f32[64]{0} conditional(%head, %all-reduce.1, %all-reduce.1), true_computation=%taken, false_computation=%idle
}

%tick (q: (s32[], f32[64])) -> (s32[], f32[64]) {
  %q = (s32[], f32[64]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %a = f32[64]{0} get-tuple-element(%q), index=1
  %permuted = f32[64]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1},{1,2}}
  %k = s32[] constant(1)
  %slot = f32[64]{0} conditional(%k, %permuted, %permuted), branch_computations={%idle, %busy}
  %next = s32[] add(%j, %k)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %slot)
}

ENTRY %main (a.0: f32[64]) -> f32[64] {
  %a.0 = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(%zero, %a.0)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%tick, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[64]{0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


def test_a_ticks_conditionals_run_on_the_busy_slots():
    """A loop of 5 ticks whose slot runs in a conditional: without ``Taken`` its collectives count at every tick;
    with ``Taken(5, 2)`` (2 busy slots) twice, a conditional nested in the slot's as the slot's; the permute
    outside it every tick. A matmul [4, 16] x [16, 8] is 2·4·8·16 FLOPs a run."""
    every = {c.name: c.runs for c in hlo.collectives(TICKS, MESH_222)}
    assert every == {"permuted": 5, "all-reduce.1": 5, "all-gather.1": 5}
    busy = {c.name: c.runs for c in hlo.collectives(TICKS, MESH_222, hlo.Taken(trips=5, runs=2))}
    assert busy == {"permuted": 5, "all-reduce.1": 2, "all-gather.1": 2}
    (dot,) = hlo_compute.matmuls(TICKS, hlo.Taken(trips=5, runs=2))
    assert (dot.flops, dot.runs, dot.branches, [loop.trips for loop in dot.loops]) == (2 * 4 * 8 * 16, 2, 1, [5])
    assert hlo_compute.matmuls(TICKS)[0].runs == 5
