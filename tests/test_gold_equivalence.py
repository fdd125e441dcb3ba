"""The gold test of every layout: the same loss, gradients and parameters as one device (fp32), each laid out
as the ZeRO stages say."""

import jax
import pytest
from helpers import RTOL, assert_trees_close, run_steps, tiny_config

from jaxscale.layout.rules import part_axes
from jaxscale.training.trainer import Trainer

LAYOUTS = {
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "zero2": {"data": 8},
    "zero3": {"fsdp": 8},
    "tp": {"data": 2, "tensor": 4},
    "tp_sp": {"data": 2, "tensor": 4},
    "fsdp_tp": {"fsdp": 2, "tensor": 4},
    "fsdp_tp_sp": {"data": 2, "fsdp": 2, "tensor": 2},
}
# The mesh axes (of size > 1) that split every parameter, gradient and Adam moment of the ZeRO stages (each
# parameter has an 'embed' dimension): written from the stages, not read from the rules tables.
ZERO = {  # rules: (parameters, gradients, Adam moments)
    "dp": ((), (), ()),
    "zero1": ((), (), ("data",)),
    "zero2": ((), ("data",), ("data",)),
    "zero3": (("fsdp",), ("fsdp",), ("fsdp",)),
}


def split_over(tree, mesh) -> set[tuple[str, ...]]:
    """The mesh axes of size > 1 each array of ``tree`` (its scalars aside) is split over, as a set of tuples."""
    return {
        tuple(a for part in x.sharding.spec for a in part_axes(part) if mesh.shape[a] > 1)
        for x in jax.tree.leaves(tree)
        if x.ndim
    }


@pytest.mark.parametrize("rules", list(LAYOUTS))
def test_layout_matches_single_device(rules, one_device, trainers):
    _, ref_loss, ref_grads, ref_params, *_ = one_device
    trainer, loss, grads, params, *_ = run_steps(*trainers.step(rules=rules, mesh=LAYOUTS[rules]))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(grads, ref_grads)
    assert_trees_close(params, ref_params)
    # Each parameter (and gradient) is laid out as the rules table says.
    for kind, tree in (("params", params), ("gradients", grads)):
        specs = jax.tree.map(lambda x: x.sharding.spec, tree)
        want = jax.tree.map(lambda s: s.spec, trainer.param_shardings(kind))
        assert specs == want, f"{rules}: {kind} shardings differ from the rules table"
    if rules in ZERO:
        state = trainer.init_state()
        flat = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        moments = [x for path, x in flat if any(getattr(key, "name", None) in ("mu", "nu") for key in path)]
        assert len(moments) == 2 * len(jax.tree.leaves(params))
        for what, tree, axes in zip(("parameters", "gradients", "Adam moments"), (params, grads, moments),
                                    ZERO[rules], strict=True):
            assert split_over(tree, trainer.mesh) == {axes}, f"{rules}: {what} are not split over {axes}"


@pytest.fixture(scope="module")
def reference_batch32():
    """One step on the whole batch of 32 sequences, on one device."""
    return run_steps(Trainer.build(tiny_config("train.global_batch=32", rules="dp"), jax.devices()[:1]))


@pytest.mark.parametrize(
    ("rules", "mesh", "overrides"),
    [
        ("zero2", LAYOUTS["zero2"], ()),
        ("fsdp_tp_sp", LAYOUTS["fsdp_tp_sp"], ()),
        # HSDP, one sequence per device in each microbatch, the chunked loss
        ("zero3", {"data": 2, "fsdp": 4}, ("model.loss_chunk=8",)),
    ],
    ids=["zero2", "fsdp_tp_sp", "zero3-hsdp-chunked"],
)
def test_gradient_accumulation_equals_whole_batch(rules, mesh, overrides, reference_batch32):
    _, ref_loss, ref_grads, ref_params, *_ = reference_batch32
    config = tiny_config("train.global_batch=32", "train.microbatches=4", *overrides, rules=rules, mesh=mesh)
    _, loss, grads, params, *_ = run_steps(Trainer.build(config))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(grads, ref_grads)
    assert_trees_close(params, ref_params)
