"""The fp8 scaling state: the same as one device under a sharded layout, and exact across a checkpoint."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, optimized_codegen, tiny_config

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
RTOL = 1e-5
# Rounding to fp8 is not continuous: the sharded step sums in another order, fp32 values one ulp
# apart can round to neighbouring fp8 values (6% apart in e4m3), and a token's gradients move with
# it. Measured on one device, scaling every parameter by (1 + 2^-23) moves the fp8 gradients by
# 9.7e-3 relative (1e-6 without fp8); fsdp_tp_sp vs one device: loss 3.4e-7, amax histories 9e-7,
# gradients 1.0e-2, parameters after two steps 7.8e-3. The loss is held to RTOL, the histories to
# HISTORY_RTOL, the parameters to PARAM_RTOL.
PARAM_RTOL = 3e-2
# An amax downstream of an fp8 matmul moves with its rounding flips (summation order): blockwise's o-projection
# history measured 1.28e-5 and 1.94e-5 apart on fsdp_tp_sp (current scaling: 9e-7).
HISTORY_RTOL = 1e-4


# The steps compile as jaxscale compiles (tests/conftest.py turns LLVM's passes off; optimized_codegen turns them
# on): without them the sharded step's fp32 values land on other sides of fp8 rounding boundaries, and the second
# step's amax histories differ from one device's by 2e-3. The initial states compile without them, one device's
# and the layout's alike (the fp32 initialisation is the same either way under every layout: tests of
# test_gold_equivalence.py); their compiles are 3 times as long with them.


def run(config, devices=None, steps: int = 2):
    """The loss of the first step (at the initial parameters, fresh fp8 state) and the state after ``steps``."""
    trainer = Trainer.build(config, devices)
    state, losses = trainer.init_state(), []
    with optimized_codegen():
        for step in range(steps):
            state, out = trainer.step(state, trainer.batch(step))
            losses.append(float(out["loss"]))
    state = jax.device_get(state)  # per-layer entries in the model's order, whatever the pipeline's storage
    return losses[0], state._replace(params=trainer.storage.canonical_params(state.params),
                                     fp8=trainer.storage.canonical_params(state.fp8))


MOE = ["model.moe={}", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp=32", "model.moe.shared_experts=1",
       "model.moe.capacity_factor=4"]
PP_1F1B = ["pipeline.microbatches=2", "pipeline.schedule=1f1b"]
PP_ZB = ["pipeline.microbatches=2", "pipeline.schedule=zb_h1"]
LAYOUTS = {
    "current-fsdp_tp_sp": (("precision.fp8=current",), "fsdp_tp_sp", MESH),
    # 16-element tiles and blocks: every block lies within one tensor-parallel shard (the key/value
    # projections' 32 outputs are 16 per device).
    "blockwise-fsdp_tp_sp": (("precision.fp8=blockwise", "precision.fp8_block=16"), "fsdp_tp_sp", MESH),
    "current-fsdp_tp": (("precision.fp8=current",), "fsdp_tp", {"fsdp": 2, "tensor": 4}),
    # The routed experts in fp8 too (a scale per expert). Measured: loss equal, histories 5e-8, parameters 6e-7
    # (ep, capacity and dropless rows exchange); ep_fsdp_tp capacity: parameters 1.2e-2.
    "current-moe-ep": (("precision.fp8=current", *MOE), "ep", {"expert": 8}),
    "current-moe-ep-dropless": (("precision.fp8=current", *MOE, "model.moe.dispatch=dropless"), "ep", {"expert": 8}),
    # Blockwise scales are per tile within a sequence: a pipeline's microbatches quantize as the whole batch.
    "blockwise-pp_1f1b": (
        ("precision.fp8=blockwise", "precision.fp8_block=16", *PP_1F1B), "pp", {"stage": 2, "data": 4}
    ),
    # Interleaved: each stage's two chunks stored together, histories in that storage, compared in layer order.
    "blockwise-pp_interleaved": (
        ("precision.fp8=blockwise", "precision.fp8_block=16", "model.layers=4", "pipeline.microbatches=2",
         "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2"),
        "pp",
        {"stage": 2, "data": 4},
    ),
    # A stage with axes left to the partitioner: idle slots computed and masked, their amaxes too.
    "blockwise-pp_fsdp_tp": (
        ("precision.fp8=blockwise", "precision.fp8_block=16", *PP_1F1B),
        "pp_fsdp_tp",
        {"stage": 2, "fsdp": 2, "tensor": 2},
    ),
    # The routed experts in blockwise fp8 too: per-expert 16 x 16 weight blocks, 1 x 16 tiles of the buffers' rows;
    # dropless: the grouped matmuls' weight gradients tiled along each expert's rows (rows exchange).
    "blockwise-moe-ep": (("precision.fp8=blockwise", "precision.fp8_block=16", *MOE), "ep", {"expert": 8}),
    "blockwise-moe-ep-dropless": (
        ("precision.fp8=blockwise", "precision.fp8_block=16", *MOE, "model.moe.dispatch=dropless"), "ep", {"expert": 8}
    ),
    # The LM head in fp8 too (precision.fp8_head), on the last stage: its histories the largest of the microbatches'.
    "delayed-head-pp_1f1b": (("precision.fp8=delayed", "precision.fp8_head=true", *PP_1F1B), "pp",
                             {"stage": 2, "data": 4}),
    "current-pp_1f1b": (("precision.fp8=current", *PP_1F1B), "pp", {"stage": 2, "data": 4}),
    # ZB-H1: the weight gradients and the weights' histories in the W slot, from the e4m3 inputs B kept.
    "current-pp_zb_h1": (("precision.fp8=current", *PP_ZB), "pp", {"stage": 2, "data": 4}),
    "blockwise-pp_zb_h1": (("precision.fp8=blockwise", "precision.fp8_block=16", *PP_ZB), "pp",
                           {"stage": 2, "data": 4}),
    "current-pp_interleaved": (
        ("precision.fp8=current", "model.layers=4", "pipeline.microbatches=2", "pipeline.schedule=interleaved_1f1b",
         "pipeline.repeats=2"),
        "pp",
        {"stage": 2, "data": 4},
    ),
}
# Per-tensor scales of a pipeline are per microbatch: current scaling's (and delayed's while a history is empty)
# is the microbatch's amax. No scale can wait for the whole step's: under 1F1B the first microbatch's backward
# runs before the last one's forward. Their one device accumulates the same microbatches (row r of microbatch
# i is row r·m + i in both), each quantized on its own amax as a stage does.
ACCUMULATED = {"delayed-head-pp_1f1b", "current-pp_1f1b", "current-pp_interleaved", "current-pp_zb_h1"}


# The pipelines' cases run in tests/test_fp8_state_pp.py: the suite's two workers take a file each.
PIPELINES = [name for name in LAYOUTS if "-pp_" in name]


@pytest.fixture(scope="module")
def one_device() -> dict:
    """The one-device runs by their overrides, each made once: layouts with the same precision and model
    settings (current-fsdp_tp_sp and current-fsdp_tp; blockwise-pp_1f1b and blockwise-pp_fsdp_tp) share one."""
    return {}


def matches_single_device(one_device: dict, case: str) -> None:
    """Loss and amax histories as one device's at RTOL, parameters after two steps at PARAM_RTOL (measured:
    fsdp_tp 2.3e-2)."""
    overrides, rules, mesh = LAYOUTS[case]
    key = (*(o for o in overrides if not o.startswith("pipeline.")),  # one device: no pipeline
           *(("train.microbatches=2",) if case in ACCUMULATED else ()))
    if key not in one_device:
        one_device[key] = run(tiny_config(*key), jax.devices()[:1])
    ref_loss, ref_state = one_device[key]
    loss, state = run(tiny_config(*overrides, rules=rules, mesh=mesh))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    # The amaxes are global maxima over the shards: each history is the single device's, at HISTORY_RTOL.
    assert_trees_close(state.fp8, ref_state.fp8, HISTORY_RTOL)
    assert all(np.all(h[..., :2] > 0) and np.all(h[..., 2:] == 0) for h in jax.tree.leaves(state.fp8))
    assert_trees_close(state.params, ref_state.params, PARAM_RTOL)


@pytest.mark.parametrize("case", [name if name == "current-fsdp_tp_sp" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in LAYOUTS if name not in PIPELINES])
def test_fp8_layout_matches_single_device(one_device, case):
    matches_single_device(one_device, case)


def test_fp8_collective_matmul_quantizes_as_plain_sequence_parallelism():
    """``model.tp_overlap`` with ``precision.fp8=delayed`` under fsdp_tp_sp: the collective matmuls use one scale
    per operand for the whole ring and push each history once, as the plain collectives' step does. Two steps'
    loss, gradients and updated histories from the same parameters and fp8 state: a fresh one (the tensors'
    own amaxes), then the first step's histories (delayed scales). Measured: loss and histories equal,
    gradients 1.2e-7 apart (summation order; held to PARAM_RTOL, as above). Blockwise: function level in
    tests/test_fp8_blockwise.py (measured on this step: loss equal, histories 2.3e-5, gradients 5.4e-4 and
    2.9e-3 of their largest value)."""
    plain, overlap = (
        Trainer.build(tiny_config("precision.fp8=delayed", f"model.tp_overlap={on}", rules="fsdp_tp_sp", mesh=MESH))
        for on in ("false", "true")
    )
    params, fp8_state = plain.init_state().params, plain.fresh_fp8()
    steps = [trainer._jit(trainer._grads) for trainer in (plain, overlap)]
    for step in range(2):
        batch = plain.batch(step)
        with optimized_codegen():
            (ref_loss, ref_grads, _, ref_fp8), (loss, grads, _, new_fp8) = (
                jax.device_get(grads_of(params, batch, fp8_state)) for grads_of in steps
            )
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
        assert_trees_close(new_fp8, ref_fp8, HISTORY_RTOL)
        assert all(np.all(h[..., : step + 1] > 0) and np.all(h[..., step + 1 :] == 0) for h in jax.tree.leaves(new_fp8))
        assert_trees_close(grads, ref_grads, PARAM_RTOL)
        fp8_state = ref_fp8


def test_gradient_accumulation_pushes_the_batchs_amaxes():
    """``train.microbatches=2`` against one batch (``precision.fp8=delayed``, the scales from a step's histories):
    the updated histories, loss and gradients as one batch's. Each microbatch's loss is weighed by its share of
    the batch before it is differentiated, so each output gradient is the whole batch's at those rows. Before:
    weighed after, the output gradients' amaxes were 2x (0.998 to 1.07 relative above one batch's); measured
    after: histories equal (1.2e-7), gradients 2e-6."""
    whole, accumulated = (Trainer.build(tiny_config("precision.fp8=delayed", *m), jax.devices()[:1])
                          for m in ((), ("train.microbatches=2",)))
    params, batch = whole.init_state().params, whole.batch(0)
    grads_of = whole._jit(whole._grads)
    fp8_state = grads_of(params, batch, whole.fresh_fp8())[3]
    ref_loss, ref_grads, _, ref_fp8 = jax.device_get(grads_of(params, batch, fp8_state))
    loss, grads, _, new_fp8 = jax.device_get(accumulated._jit(accumulated._grads)(params, batch, fp8_state))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(new_fp8, ref_fp8, HISTORY_RTOL)
    assert_trees_close(grads, ref_grads, 1e-4)


def test_fp8_state_survives_checkpoint_round_trip(tmp_path):
    config = tiny_config(
        "precision.fp8=delayed",
        "model.dtype=bfloat16",
        "train.steps=8",
        "train.log_every=1",
        "checkpoint.every=4",
        "checkpoint.resume=auto",
        f"run_dir={tmp_path}",
        rules="fsdp_tp_sp",
        mesh=MESH,
    )
    trainer = Trainer.build(config)
    at4, _ = fit(trainer, progress=False, stop_at=4)
    saved = jax.device_get(at4)
    assert all(np.all(h[:, :4] > 0) and np.all(h[:, 4:] == 0) for h in jax.tree.leaves(saved.fp8))

    checkpointer = Checkpointer.from_config(config)
    restored = checkpointer.restore(trainer.abstract_state(), 4).state
    checkpointer.close()
    for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(got, want)

    # Resume from the checkpoint (the loop) vs going on from the state in memory: bit for bit.
    resumed, history = fit(trainer, progress=False)
    step_fn, _ = trainer.compiled_guarded_step
    state, losses = at4, {}
    for step in range(4, 8):
        state, out = step_fn(state, trainer.batch(step))
        losses[step] = float(out["loss"])
    assert {r["step"]: r["loss"] for r in history if "loss" in r} == losses
    for got, want in zip(jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(state)), strict=True):
        np.testing.assert_array_equal(got, want)
