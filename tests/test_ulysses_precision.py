"""Ulysses and USP under reduced precision (jaxscale/parallel/ulysses.py): bf16 compute gives one fp32 device's loss
and gradients to bf16's precision (as tests/test_pipeline_bf16.py holds its layouts), and FP8 (delayed and blockwise
scaling) gives one FP8 device's loss, amax histories and parameters after two steps at the tolerances of
tests/test_fp8_state.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, rel_err, tiny_config
from test_fp8_state import HISTORY_RTOL, PARAM_RTOL, RTOL, run

from jaxscale.training.trainer import Trainer

# name -> (rules, mesh, model.attention): Ulysses over 4 devices on whole sequences; USP as an all-to-all of 2 inside
# a ring of 2.
LAYOUTS = {
    "ulysses": ("ulysses", {"fsdp": 2, "context": 4}, "model.attention=blockwise"),
    "usp": ("usp", {"fsdp": 2, "context": 2, "ulysses": 2}, "model.attention=ring"),
}
FP8 = {"delayed": ("precision.fp8=delayed",), "blockwise": ("precision.fp8=blockwise", "precision.fp8_block=16")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "usp" else pytest.mark.slow) for n in LAYOUTS])
def test_bf16_under_ulysses_matches_one_fp32_device(name, docs):
    """Packed documents, bf16 weights and compute: the loss within 1e-2 and each gradient within 5e-2 (relative) of
    one fp32 device on the same bf16-rounded weights (measured: loss 4e-6, gradients 6.3e-3 for both layouts)."""
    rules, mesh, kernel = LAYOUTS[name]
    data = ("data.source=tokens", f"data.path={docs}", "model.vocab_size=264", "data.documents=true",
            "model.attention_block=4", kernel)
    bf16 = Trainer.build(tiny_config(*data, "model.dtype=bfloat16", rules=rules, mesh=mesh))
    state = bf16.init_state()
    loss, grads = bf16.loss_and_grads(state.params, bf16.batch(0))
    assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"bfloat16"}

    ref = Trainer.build(tiny_config(*data), jax.devices()[:1])  # the natural order (USP's batch is zig-zagged)
    host = bf16.storage.canonical_params(jax.device_get(state.params))
    ref_loss, ref_grads = ref.loss_and_grads(jax.tree.map(lambda w: np.asarray(w, np.float32), host), ref.batch(0))
    assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss))
    got = bf16.storage.canonical_params(jax.device_get(grads))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref_grads), strict=True):
        assert rel_err(g, r) <= 5e-2, jax.tree_util.keystr(path)


@pytest.mark.parametrize("name, mode", [
    pytest.param(n, m, id=f"{m}-{n}", marks=() if (n, m) == ("ulysses", "delayed") else pytest.mark.slow)
    for n in LAYOUTS for m in FP8
])
def test_fp8_under_ulysses_matches_one_device(name, mode):
    """Two steps: the first loss at RTOL, the amax histories at HISTORY_RTOL, the parameters at PARAM_RTOL of one
    device's (measured: loss at most 4.3e-7; histories 0 and 3.4e-8 under Ulysses, 1.8e-7 and 1.4e-5 under USP;
    parameters 1.1e-7 under Ulysses, 2.1e-5 delayed and 2.6e-2 blockwise under USP, whose ring sums the
    attention's gradients in another order: fp8 rounding flips, as fsdp_tp's 2.3e-2)."""
    rules, mesh, kernel = LAYOUTS[name]
    ref_loss, ref_state = run(tiny_config(kernel, *FP8[mode]), jax.devices()[:1])
    loss, state = run(tiny_config(kernel, *FP8[mode], rules=rules, mesh=mesh))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(state.fp8, ref_state.fp8, HISTORY_RTOL)
    assert all(np.all(h[..., :2] > 0) and np.all(h[..., 2:] == 0) for h in jax.tree.leaves(state.fp8))
    assert_trees_close(state.params, ref_state.params, PARAM_RTOL)
