"""Uneven pipeline stages (``pipeline.layers_per_stage``): equal to one device, from the unpipelined weights;
the stack's storage; checkpoints across splits and layouts; errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import RTOL, TINY, assert_trees_close, fails_early, tiny_config

from jaxscale.checkpoint import restack
from jaxscale.checkpoint.params import init_state_from, params_source, read_param, save_params
from jaxscale.checkpoint.store import Checkpointer
from jaxscale.cli import main
from jaxscale.config import stage_layers
from jaxscale.training.report import read_records
from jaxscale.training.trainer import Trainer

# Seven layers: no even split over 2 stages, nor over 2 stages x 2 chunks.
BASE = ("train.global_batch=32", "model.layers=7")


def pipe(schedule: str, m: int, v: int, counts: list[int]) -> list[str]:
    return [f"pipeline.microbatches={m}", f"pipeline.repeats={v}", f"pipeline.schedule={schedule}",
            f"pipeline.layers_per_stage={counts}"]


@pytest.fixture(scope="module")
def reference():
    """One device, seven layers, no pipeline: initial parameters, a batch (host copies), loss and gradients."""
    trainer = Trainer.build(tiny_config(*BASE), jax.devices()[:1])
    params = trainer.init_state().params
    batch = jax.device_get(trainer.batch(0))
    loss, grads = trainer.loss_and_grads(params, trainer.batch(0))
    return jax.device_get(params), batch, float(loss), jax.device_get(grads)


@pytest.mark.parametrize(
    "schedule, m, v, counts, rules, mesh, evaluate",
    [
        # Skipped slots (a conditional): stage 0 runs 3 layers in 4 slots.
        ("1f1b", 4, 1, [3, 4], "pp", {"stage": 2, "data": 4}, False),
        # Interleaved, the first virtual stage lighter: chunks of 2 slots, chunk 0 of stage 0 uses one.
        ("interleaved_1f1b", 4, 2, [1, 2, 2, 2], "pp", {"stage": 2, "data": 4}, True),
        # FSDP and TP inside a stage: the unused slot is computed and masked.
        ("1f1b", 4, 1, [4, 3], "pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, False),
    ],
)
def test_uneven_stages_match_single_device(schedule, m, v, counts, rules, mesh, evaluate, reference):
    """Loss and every real layer's gradient as one device; the unused slots' gradients exactly zero; the
    evaluation loss (the forward table) too."""
    params, batch, ref_loss, ref_grads = reference
    trainer = Trainer.build(tiny_config(*BASE, *pipe(schedule, m, v, counts), rules=rules, mesh=mesh))
    storage = trainer.storage
    assert storage == stage_layers.Storage(tuple(counts), 2)
    assert jax.tree.leaves(trainer.abstract_params["blocks"])[0].shape[0] == len(counts) * max(counts)
    unused = np.setdiff1d(np.arange(len(counts) * max(counts)), storage.positions())
    # Unused slots hold layer 0's weights: a block of zero weights would be the identity anyway.
    padded = {**params, "blocks": jax.tree.map(lambda w: _fill(w, unused), storage.place(params["blocks"]))}
    placed = jax.device_put(padded, trainer.param_shardings())
    batch = jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))
    loss, grads = trainer.loss_and_grads(placed, batch)
    assert abs(float(loss) - ref_loss) <= RTOL * abs(ref_loss)
    if evaluate:
        assert abs(float(trainer.jit_eval_loss(placed, batch)) - ref_loss) <= RTOL * abs(ref_loss)
    grads = jax.device_get(grads)
    assert_trees_close(storage.canonical_params(grads), ref_grads)
    assert unused.size and all(not np.asarray(g)[unused].any() for g in jax.tree.leaves(grads["blocks"]))


def _fill(w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``w`` with slot 0's values in ``rows``."""
    w = w.copy()
    w[rows] = w[0]
    return w


def test_the_storage_keeps_each_stages_chunks_together():
    """7 units as [1, 2, 2, 2] on 2 stages x 2 chunks: virtual stages 0, 2 on stage 0 and 1, 3 on stage 1,
    chunks of 2 slots: stage 0 holds [g0: 0, -], [g2: 3, 4]; stage 1 [g1: 1, 2], [g3: 5, 6]."""
    storage = stage_layers.Storage((1, 2, 2, 2), 2)
    np.testing.assert_array_equal(storage.positions(), [0, 4, 5, 2, 3, 6, 7])
    stacked = {"w": np.arange(1, 7 * 3 + 1, dtype=np.float32).reshape(7, 3)}
    placed = storage.place(stacked)
    assert placed["w"].shape == (8, 3) and not placed["w"][1].any()
    np.testing.assert_array_equal(placed["w"][[0, 2, 3, 4, 5, 6, 7], 0], [1, 10, 13, 4, 7, 16, 19])
    np.testing.assert_array_equal(storage.canonical(placed)["w"], stacked["w"])
    even = stage_layers.Storage((2, 2, 2, 2), 2)  # even, interleaved: a permutation, no padding
    np.testing.assert_array_equal(even.positions(), [0, 1, 4, 5, 2, 3, 6, 7])
    assert stage_layers.Storage((4, 4), 2).canonical_order and not even.canonical_order
    # A checkpoint's stack between schedules and splits: interleaved [1, 2, 2, 2] -> 1F1B [3, 4] -> unpipelined.
    split = restack.moved(placed["w"], storage, stage_layers.Storage((3, 4), 2))
    np.testing.assert_array_equal(split[:, 0], [1, 4, 7, 0, 10, 13, 16, 19])
    np.testing.assert_array_equal(restack.moved(split, stage_layers.Storage((3, 4), 2), stage_layers.Storage((7,))),
                                  stacked["w"])


@pytest.mark.parametrize(
    "overrides, mesh, match",
    [
        (["pipeline.layers_per_stage=[3, 3]"], {"stage": 2, "data": 4},
         r"^pipeline\.layers_per_stage \[3, 3\]: sums to 6, not model\.layers \(7\)$"),
        (["pipeline.layers_per_stage=[7, 0]"], {"stage": 2, "data": 4},
         r"^pipeline\.layers_per_stage \[7, 0\]: every virtual stage needs at least one layer$"),
        (["pipeline.layers_per_stage=[8, -1]"], {"stage": 2, "data": 4},
         r"^pipeline\.layers_per_stage \[8, -1\]: every virtual stage needs at least one layer$"),
    ],
)
def test_bad_lists_fail_in_the_config(overrides, mesh, match):
    with fails_early(match):
        tiny_config(*BASE, *overrides, rules="pp", mesh=mesh)


@pytest.fixture(scope="module")
def warm() -> None:
    """A pipelined trainer built once before the failures below are timed (fails_early): the imports and jax's
    first traces are behind them."""
    Trainer.build(tiny_config("pipeline.microbatches=2", rules="pp", mesh={"stage": 2, "data": 4}))


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize(
    "overrides, rules, mesh, match",
    [
        (["pipeline.layers_per_stage=[1, 2, 4]"], "pp", {"stage": 2, "data": 4},
         r"^pipeline\.layers_per_stage has 3 entries; it needs one per virtual stage, mesh\.stage \(2\) x "
         r"pipeline\.repeats \(1\) = 2$"),
        # mesh.stage=-1: the length is checked against the resolved mesh.
        (["pipeline.layers_per_stage=[1, 2, 4]"], "pp", {"data": 2, "stage": -1},
         r"^pipeline\.layers_per_stage has 3 entries; it needs one per virtual stage, mesh\.stage \(4\)"),
        # No pipeline: the rules leave the layers whole.
        (["pipeline.layers_per_stage=[3, 4]"], "dp", {"data": 4, "stage": 2},
         r"^pipeline\.layers_per_stage: rules 'dp' on this mesh run no pipeline"),
    ],
)
def test_bad_lists_fail_before_compiling(overrides, rules, mesh, match):
    config = tiny_config(*BASE, *overrides, rules=rules, mesh=mesh)
    with fails_early(match):
        Trainer.build(config)


# Through the command line: 7 layers unpipelined (zero3 on 8 devices) and as [3, 4] and [4, 3] on pp_fsdp_tp
# (stage 2 x fsdp 2 x tensor 2), the same seed; [3, 4]'s checkpoint after 3 steps resumed onto zero3 and [4, 3].
CLI = [*TINY, "model.layers=7", "train.schedule_steps=5", "train.log_every=1", "pipeline.microbatches=2"]
UNPIPELINED = ["rules=zero3", "mesh.data=1", "mesh.fsdp=8", "mesh.stage=1", "mesh.tensor=1"]


def split(counts: str) -> list[str]:
    return ["rules=pp_fsdp_tp", "mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2",
            f"pipeline.layers_per_stage={counts}"]


def train(run: Path, steps: int, *sets: str, resume: bool = False) -> dict[int, float]:
    """``jaxscale train`` of the 7-layer model into ``run``: its losses by step (this call's)."""
    argv = [f"--set={s}" for s in (*CLI, *sets, f"train.steps={steps}", f"run_dir={run}")]
    assert main(["train", "--no-progress", *(["--resume"] if resume else []), *argv]) == 0
    return {r["step"]: r["loss"] for r in read_records(run / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, float]]:
    root = tmp_path_factory.mktemp("runs")
    out = {"straight": train(root / "straight", 5, *UNPIPELINED),
           "[3, 4]": train(root / "34", 3, *split("[3, 4]"), "checkpoint.every=3"),
           "[4, 3]": train(root / "43", 3, *split("[4, 3]"))}
    for name, layout in (("zero3", UNPIPELINED), ("[4, 3] resumed", split("[4, 3]"))):
        shutil.copytree(root / "34" / "checkpoints", root / name / "checkpoints")
        out[name] = train(root / name, 5, *layout, resume=True)
    return out


def close_losses(got: dict[int, float], want: dict[int, float]) -> bool:
    return all(abs(loss - want[step]) <= RTOL * abs(want[step]) for step, loss in got.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["[3, 4]", "[4, 3]"])
def test_uneven_runs_are_the_unpipelined_run(runs, name):
    """The padded stack is the unpipelined model's stack placed in slots: the same losses from step 0 on."""
    assert sorted(runs[name]) == [0, 1, 2] and close_losses(runs[name], runs["straight"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "[4, 3] resumed"])
def test_a_checkpoint_resumes_onto_another_split_or_layout(runs, name):
    """[3, 4]'s checkpoint after 3 steps goes on as the straight run, unpipelined or split the other way."""
    assert sorted(runs[name]) == [3, 4] and close_losses(runs[name], runs["straight"])


@pytest.fixture(scope="module")
def interleaved():
    """Interleaved [1, 2, 2, 2] on 2 stages x 2 chunks: the trainer and its initial state (host copy)."""
    trainer = Trainer.build(tiny_config(*BASE, *pipe("interleaved_1f1b", 4, 2, [1, 2, 2, 2]), rules="pp",
                                        mesh={"stage": 2, "data": 4}))
    return trainer, jax.device_get(trainer.init_state())


def test_a_checkpoint_written_before_storages_were_recorded_restores(interleaved, tmp_path):
    """[1, 2, 2, 2] as jaxscale wrote it before: chunks of padded slots in the order of the virtual stages
    (g·Lmax + j), no ``layer_storage`` in the loop item; restored into the chunk-order storage."""
    trainer, state = interleaved
    model = trainer.storage.canonical_params(state.params)
    old = stage_layers.Storage((1, 2, 2, 2))
    assert old.positions().tolist() == [0, 2, 3, 4, 5, 6, 7]
    checkpointer = Checkpointer(tmp_path, async_save=False)
    loop = {"skipped_updates": 0, "skipped_in_a_row": 0}
    checkpointer.save(1, state._replace(params=old.place_params(model)), trainer.batches.state(1), loop,
                      trainer.config.to_dict())
    checkpointer.wait()
    saved = checkpointer.read_json(1)
    storage = restack.saved_storage(saved.loop, saved.config)
    assert storage == old
    restored = checkpointer.restore_state(restack.abstract_state(trainer, storage), 1)
    params = jax.device_get(restack.convert_state(trainer, restored, storage).params)
    checkpointer.close()
    assert_trees_close(trainer.storage.canonical_params(params), model, rtol=0)


def test_init_from_a_model_fills_the_storage(interleaved, tmp_path):
    """A parameters checkpoint (the canonical stack) read into [1, 2, 2, 2]'s padded, chunk-order storage."""
    trainer, state = interleaved
    model = jax.tree.map(lambda w: w + 1, trainer.storage.canonical_params(state.params))  # not the run's own
    save_params(tmp_path, model, trainer.config.to_dict()["model"])
    params = jax.device_get(init_state_from(trainer, tmp_path).params)
    assert_trees_close(trainer.storage.canonical_params(params), model, rtol=0)
    assert not jax.tree.leaves(params["blocks"])[0][1].any()  # stage 0's unused slot


def test_a_runs_parameters_read_back_in_the_models_order(interleaved, tmp_path):
    """A run's checkpoint records its storage; a parameter read from it (``jaxscale convert``'s way) is the
    model's stack."""
    trainer, state = interleaved
    checkpointer = Checkpointer(tmp_path, async_save=False)
    loop = {"skipped_updates": 0, restack.KEY: trainer.storage.to_dict()}
    checkpointer.save(1, state, trainer.batches.state(1), loop, trainer.config.to_dict())
    checkpointer.close()
    source = params_source(tmp_path)
    assert source.storage == trainer.storage
    path = ("blocks", "attn", "wq")
    want = trainer.storage.canonical_params(state.params)["blocks"]["attn"]["wq"]
    np.testing.assert_array_equal(read_param(source, path), want)
