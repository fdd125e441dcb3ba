"""bf16 compute through a pipeline whose stages are manual over TP's axes (their bf16 sums written inside the
stage, idle slots skipped): it compiles, and it gives one fp32 device's loss and gradients to bf16's precision."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import rel_err, tiny_config

from jaxscale.training.trainer import Trainer

BASE = ("train.global_batch=16", "model.layers=4", "pipeline.microbatches=4", "pipeline.schedule=1f1b")


@pytest.mark.parametrize("rules, mesh", [
    ("pp_tp_sp", {"stage": 2, "tensor": 2, "data": 2}),
    ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}),
])
def test_bf16_in_a_tensor_parallel_stage_matches_fp32(rules, mesh):
    """XLA:CPU widens bf16 all-reduces to fp32 by cloning their reduction; that clone aborted the compile
    ("Invalid binary instruction opcode copy") where the stage's shard_map left size-1 mesh axes automatic
    (jax then annotated the reduction's add with a sharding). Here the loss is within 1e-2 and each gradient
    within 5e-2 (relative) of one fp32 device run on the same bf16-rounded weights."""
    bf16 = Trainer.build(tiny_config(*BASE, "model.dtype=bfloat16", rules=rules, mesh=mesh))
    state = bf16.init_state()
    batch = jax.device_get(bf16.batch(0))
    loss, grads = bf16.loss_and_grads(state.params, bf16.batch(0))
    assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"bfloat16"}

    ref = Trainer.build(tiny_config(*BASE), jax.devices()[:1])
    host = bf16.storage.canonical_params(jax.device_get(state.params))
    weights = jax.tree.map(lambda w: np.asarray(w, np.float32), host)
    ref_loss, ref_grads = ref.loss_and_grads(weights, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss))
    got = bf16.storage.canonical_params(jax.device_get(grads))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref_grads), strict=True):
        assert rel_err(g, r) <= 5e-2, jax.tree_util.keystr(path)
