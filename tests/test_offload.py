"""Host memory as a tier (``jaxscale/layout/offload.py``): an offloaded run equals the run on the device, bit for bit,
and its compiled program keeps the offloaded bytes in host memory.

Bit for bit, not 1e-6: offloading moves a value between memories and computes nothing; the step computes the
same operations in the same order on the same values (the update runs on the device either way).

Activations: on XLA:CPU the three memory kinds are one memory and jax lowers the policy's moves to nothing, so
the equality here proves the configuration reaches the policy and the names; the moves themselves are shown in
the program compiled for H100 (``tests/test_compile_offload.py``). Optimizer state: XLA:CPU keeps the state's
arguments and results in memory space 5 (``S(5)``), read here from the compiled program's entry layout.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from helpers import run_steps, tiny_config

from jaxscale.analysis.predict import predict_trainer
from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.read import ConfigError
from jaxscale.layout import offload
from jaxscale.training.trainer import Trainer

BF16_MASTER = ("model.dtype=bfloat16", "precision.master=float32")
LAYOUTS = {  # rules, mesh, precision
    "dp": ("dp", {"data": 8}, ()),
    "zero1": ("zero1", {"data": 8}, BF16_MASTER),
    "zero3": ("zero3", {"fsdp": 8}, BF16_MASTER),
    "fsdp_tp": ("fsdp_tp", {"fsdp": 4, "tensor": 2}, ()),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    """Two steps of each (layout, overrides) asked for, run once per module."""
    done: dict = {}

    def run(layout: str, *overrides: str):
        key = (layout, overrides)
        if key not in done:
            rules, mesh, extra = LAYOUTS[layout]
            done[key] = run_steps(Trainer.build(tiny_config(*extra, *overrides, rules=rules, mesh=mesh)))
        return done[key]

    return run


def assert_same(a, b) -> None:
    assert a.loss == b.loss
    assert [m["loss"] for m in a.metrics] == [m["loss"] for m in b.metrics]
    for x, y in zip(jax.tree.leaves((a.grads, a.params)), jax.tree.leaves((b.grads, b.params)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


STATE_LAYOUTS = ["dp", pytest.param("zero1", marks=pytest.mark.slow), "zero3"]


@pytest.mark.parametrize("layout", STATE_LAYOUTS)
def test_optimizer_state_on_the_host_equals_the_run_on_the_device(runs, layout):
    assert_same(runs(layout), runs(layout, "precision.offload_state=true"))


@pytest.mark.parametrize("layout", STATE_LAYOUTS)
def test_the_state_offloaded_step_takes_and_returns_the_state_in_host_memory(runs, layout):
    """Host bytes per device = the master and Adam's two moments, 4 bytes each per parameter, over the devices
    their rules split them across (dp: none, 8 under ZeRO), plus the optimizer's int32 step counts; the
    device's arguments shrink by exactly that."""
    base, off = runs(layout), runs(layout, "precision.offload_state=true")
    rules, _, extra = LAYOUTS[layout]
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(base.trainer.abstract_state().params))
    split = 1 if rules == "dp" else 8
    copies = 3 if extra else 2  # master (when apart from the fp32 parameters), first and second moments
    counts = sum(1 for x in jax.tree.leaves(base.trainer.abstract_state().opt_state) if x.ndim == 0)
    expected = copies * 4 * psi // split + 4 * counts
    assert offload.argument_bytes(base.hlo) == {"device": offload.argument_bytes(base.hlo)["device"], "host": 0}
    assert offload.argument_bytes(off.hlo)["host"] == expected
    assert offload.argument_bytes(off.hlo)["device"] == offload.argument_bytes(base.hlo)["device"] - expected
    # The planner's prediction moves the same bytes (less the counts) off the device (the tiny model's state is
    # smaller than its activations: the update's peak stays under the backward's).
    device, host = predict_trainer(base.trainer).memory, predict_trainer(off.trainer).memory
    assert host["host_state"] == expected - 4 * counts
    assert device["total"] - host["total"] == pytest.approx(expected - 4 * counts)


@pytest.mark.parametrize("layout", [pytest.param("dp", marks=pytest.mark.slow),
                                    pytest.param("zero3", marks=pytest.mark.slow), "fsdp_tp"])
def test_offloaded_activations_equal_the_same_names_kept_on_the_device(runs, layout):
    names = "[attention_out, mlp_hidden]"
    kept = runs(layout, "model.remat=save_named", f"model.remat_names={names}")
    moved = runs(layout, "model.remat=save_named", f"model.remat_offload={names}")
    assert_same(kept, moved)


def test_the_policy_offloads_the_named_activations_to_pinned_host():
    """Differentiating a scanned layer under the policy moves the offloaded name to host memory in the
    forward, as the layers' stacked residual, and back in the backward; the kept name stays on the device."""
    from jax.ad_checkpoint import checkpoint_name

    def layer(x, _):
        h = checkpoint_name(jax.numpy.sin(x), "moved")
        return checkpoint_name(jax.numpy.cos(h), "kept") * h, None

    def program(policy) -> str:
        body = jax.checkpoint(layer, policy=policy)
        return str(jax.make_jaxpr(jax.grad(lambda x: jax.lax.scan(body, x, length=3)[0].sum()))(np.ones(4)))

    moved = program(offload.remat_policy(["kept"], ["moved"]))
    assert "f32<host>[3,4]" in moved and moved.count("device_put[") == 2  # 3 layers of "moved", in host memory
    assert "<host>" not in program(offload.remat_policy(["kept", "moved"], []))


@pytest.mark.parametrize(("overrides", "message"), [
    (("model.remat=full", "model.remat_offload=[query]"),
     r"^model\.remat_offload: read only by model\.remat=save_named, not full \(set "),
    (("model.remat=save_named", "model.remat_names=[query, key]", "model.remat_offload=[key]"),
     r"^model\.remat_names and model\.remat_offload both name 'key': an activation is kept on the device or "),
])
def test_offload_settings_that_cannot_be_read_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


def test_an_offloaded_name_the_model_does_not_mark_is_refused_naming_its_names():
    config = tiny_config("model.remat=save_named", "model.remat_offload=[bogus]")
    with pytest.raises(ConfigError, match=r"^model\.remat_offload: 'bogus' is not the checkpoint_name of any "):
        Trainer.build(config, jax.devices()[:1])


def test_argument_bytes_reads_the_entry_layout():
    hlo = ("HloModule m, entry_computation_layout={(f32[4,8]{1,0:S(5)}, bf16[2,3]{1,0}, s32[])->"
           "(f32[4,8]{1,0:S(5)})}")
    assert offload.argument_bytes(hlo) == {"host": 4 * 8 * 4, "device": 2 * 3 * 2 + 4}


@pytest.mark.parametrize("setting", ["offload_state", pytest.param("offload_params", marks=pytest.mark.slow)])
def test_an_offloaded_state_resumes_into_host_or_device_memory_and_continues_bit_for_bit(tmp_path, setting):
    """A step from a checkpoint of the zero3 state offloaded by ``setting``, restored into host memory (offload
    on) or the device (off, the same layouts), equals the step from the state that was saved."""
    rules, mesh, extra = LAYOUTS["zero3"]
    trainers = {on: Trainer.build(tiny_config(*extra, f"precision.{setting}={on}", rules=rules, mesh=mesh))
                for on in ("true", "false")}
    moved = (lambda s: s.params) if setting == "offload_params" else (lambda s: (s.master, s.opt_state))
    host = trainers["true"]
    state, _ = host.step(host.init_state(), host.batch(0))
    checkpointer = Checkpointer(tmp_path, async_save=False)
    checkpointer.save(1, state, {}, {}, {})
    expected, _ = host.step(state, host.batch(1))
    for on, trainer in trainers.items():
        restored = checkpointer.restore_state(trainer.abstract_state(), 1)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(moved(restored))}
        assert kinds == {"pinned_host" if on == "true" else "device"}, on
        after, _ = trainer.step(restored, trainer.batch(1))
        for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["dp", pytest.param("fsdp_tp", marks=pytest.mark.slow)])
def test_offload_dots_equals_save_dots(runs, layout):
    assert_same(runs(layout, "model.remat=save_dots"), runs(layout, "model.remat=offload_dots"))


def test_a_nonfinite_step_keeps_the_offloaded_state_in_host_memory(runs):
    """The guarded step (train.nonfinite) decides on the device and stores the old state back unchanged."""
    trainer = runs("dp", "precision.offload_state=true").trainer
    state = trainer.init_state()
    state = state._replace(params=jax.tree.map(lambda x: x * np.nan, state.params))  # a non-finite loss
    before = jax.device_get(state.opt_state)
    new, out = trainer.compiled_guarded_step[0](state, trainer.batch(0))
    assert not bool(out["finite"])
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new.opt_state)} == {"pinned_host"}
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(new.opt_state), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))


# -- the parameters in host memory (precision.offload_params), fetched layer by layer inside the layer scan

PARAMS = "precision.offload_params=true"
NAMED = ("model.remat=save_named", "model.remat_names=[attention_out, mlp_hidden]")


def test_parameters_on_the_host_equal_the_run_on_the_device_under_zero3(runs):
    """zero3, bf16 compute copy and fp32 master, model.remat: none (the fetched weights alone recomputed)."""
    assert_same(runs("zero3"), runs("zero3", PARAMS))


@pytest.mark.slow
def test_parameters_on_the_host_equal_the_run_on_the_device_under_fsdp_tp(runs):
    """fsdp 4 x tensor 2, keeping two names on the device (the fetch joins the layer's own remat policy)."""
    assert_same(runs("fsdp_tp", *NAMED), runs("fsdp_tp", *NAMED, PARAMS))


def test_the_param_offloaded_step_takes_and_returns_the_parameters_in_host_memory(runs):
    """zero3 on 8 devices: every parameter split 8 ways, the bf16 compute copy is 2 bytes per parameter: the
    host holds 2 Ψ / 8 bytes per device, and the device's arguments shrink by exactly that."""
    base, off = runs("zero3"), runs("zero3", PARAMS)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(base.trainer.abstract_state().params))
    expected = 2 * psi // 8
    assert offload.argument_bytes(off.hlo)["host"] == expected
    assert offload.argument_bytes(off.hlo)["device"] == offload.argument_bytes(base.hlo)["device"] - expected
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.params)} == {"pinned_host"}
    device, host = predict_trainer(base.trainer).memory, predict_trainer(off.trainer).memory
    assert host["host_params"] == expected
    assert device["total"] - host["total"] == pytest.approx(expected)


def _scan_outputs(jaxpr) -> list:
    """The avals every ``scan`` of ``jaxpr`` (and of the jaxprs inside it) returns."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out += [v.aval for v in eqn.outvars]
        for sub in _subjaxprs(eqn):
            out += _scan_outputs(sub)
    return out


def _subjaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def test_no_layer_loop_returns_every_layers_weights_on_the_device(runs):
    """The layer stack's weights (and their gradients) never stand on the device all at once inside the step's
    loops: no scan returns a device array shaped as a stacked weight (the run on the device does: its
    backward returns the stacked gradients), the host-typed ones being the backward's gradients written there."""
    stacked = {(x.shape, x.dtype) for x in jax.tree.leaves(runs("zero3").trainer.abstract_state().params)
               if x.ndim and x.shape[0] == 2}  # the test model's 2 layers

    def device_stacks(run) -> int:
        trainer = run.trainer
        jaxpr = jax.make_jaxpr(trainer.jit_step)(trainer.abstract_state(), trainer.abstract_batch()).jaxpr
        return sum((a.shape, a.dtype) in stacked and "host" not in str(a) for a in _scan_outputs(jaxpr))

    assert device_stacks(runs("zero3")) > 0
    assert device_stacks(runs("zero3", PARAMS)) == 0


def test_offload_params_on_a_model_of_its_own_is_refused_in_one_line():
    from jaxscale.models.builtin import build

    def mine(config, rngs):
        return build(config, rngs)

    rules, mesh, extra = LAYOUTS["zero3"]
    with pytest.raises(ConfigError, match=r"^precision\.offload_params: model .*mine is not a built-in one; "):
        Trainer.build(tiny_config(*extra, PARAMS, rules=rules, mesh=mesh), model=mine)


# -- inside pipeline stages: the stage's stash of kept layer inputs in host memory (pipeline.offload_stash)

PP_1F1B = ("train.global_batch=32", "model.layers=8", "pipeline.schedule=1f1b", "pipeline.microbatches=4")


@pytest.mark.slow  # 60 s on 2 cores; tests/test_compile_offload.py shows the stash's moves in the compile stage
def test_a_stash_in_host_memory_equals_the_stash_on_the_device_in_a_1f1b_pipeline():
    """2 stages x 4 data, 1F1B over 4 microbatches: the stage program reads and writes its kept layer inputs
    (and the arrivals waiting beside them) in host memory, each choice made on the device; nothing else moves."""
    runs_ = [run_steps(Trainer.build(tiny_config(*PP_1F1B, f"pipeline.offload_stash={on}", rules="pp",
                                                 mesh={"stage": 2, "data": 4}))) for on in ("false", "true")]
    assert_same(*runs_)
    traced = [str(jax.make_jaxpr(r.trainer.jit_step)(r.trainer.abstract_state(), r.trainer.abstract_batch()))
              for r in runs_]
    assert "<host>" not in traced[0] and "<host>" in traced[1]
    # The planner moves the stash off the device: 1F1B's 2p = 4 act slots x 4 layers a stage x 2 rows (32 / 4 data
    # / 4 microbatches) x 32 tokens x 64 wide x 4 bytes, two buffers of each.
    on_device, on_host = (predict_trainer(r.trainer).memory for r in runs_)
    assert on_host["host_stash"] == 2 * 4 * 4 * 2 * 32 * 64 * 4
    assert on_device["total"] - on_host["total"] == on_host["host_stash"]
