"""The DeepSeek-V3-style model (jaxscale/models/deepseek.py: multi-head latent attention, dense then MoE blocks
with group-limited routing and shared experts, multi-token prediction) under the layouts: each gives the loss and
every gradient of one device (fp32, 1e-5)."""

from __future__ import annotations

import math

import jax
import pytest
from helpers import assert_trees_close, fails_early, rel_err

from jaxscale.analysis import plan
from jaxscale.config import Config, ConfigError, load_config
from jaxscale.train import Trainer, abstract_model

TRAIN = ["train.global_batch=16", "train.seq_len=32", "train.steps=2", "train.warmup_steps=1",
         "train.learning_rate=0.01", "data.max_bytes=200000"]
# The pipeline runs model.blocks (no dense blocks, no MTP), the experts by the partitioner, no bias balancing.
PIPELINED = ("model.layers=4", "model.deepseek.dense_layers=0", "model.deepseek.mtp_depth=0", "model.moe.balance=off",
             "model.moe.impl=partitioner")


def config(*overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None) -> Config:
    """The tiny DeepSeek-V3-style model (configs/models/deepseek-v3-tiny.yaml) under ``rules`` on ``mesh``."""
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, **(mesh or {})}
    return load_config(None, ["model=deepseek-v3-tiny", *TRAIN, f"rules={rules}",
                              *(f"mesh.{k}={v}" for k, v in sizes.items()), *overrides])


def one_device(*overrides: str) -> tuple:
    """One device: the initial parameters, batch 0, its loss and gradients."""
    trainer = Trainer.build(config(*overrides), jax.devices()[:1])
    params = jax.device_get(trainer.init_state().params)
    loss, grads = trainer.loss_and_grads(params, trainer.batch(0))
    return params, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    return one_device()


def same_as_one_device(trainer: Trainer, reference: tuple) -> None:
    """The trainer's loss and gradients at the reference's parameters on its own batch 0 (the same tokens: under
    ring attention in zig-zag order, positions following)."""
    params, ref_loss, ref_grads = reference
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)


LAYOUTS = {
    "zero3": ("zero3", {"fsdp": 8}, ()),
    "ep_fsdp": ("ep_fsdp", {"expert": 4, "fsdp": 2}, ()),
    "ep_fsdp_tp": ("ep_fsdp_tp", {"expert": 2, "fsdp": 2, "tensor": 2}, ()),
    "fsdp_cp": ("fsdp_cp", {"fsdp": 4, "context": 2}, ("model.attention=ring", "model.attention_block=8")),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "zero3" else pytest.mark.slow) for n in LAYOUTS])
def test_deepseek_under_a_layout_gives_the_loss_and_gradients_of_one_device(name, reference):
    rules, mesh, overrides = LAYOUTS[name]
    trainer = Trainer.build(config(*overrides, rules=rules, mesh=mesh))
    if name == "fsdp_cp":  # ring attention through MLA's shapes: queries and keys 24 wide, values 16
        assert trainer.config.model.attention == "ring" and trainer.sequence_order is not None
    same_as_one_device(trainer, reference)


@pytest.mark.slow
def test_deepseek_pipelines_1f1b_as_one_device():
    """The MoE blocks (no dense ones, no MTP: the pipeline runs model.blocks) on 2 stages x 4 data shards, against
    one device on the same 4 microbatches (the routing statistics, and so the load-balance loss, are per microbatch)."""
    pipe = ("pipeline.schedule=1f1b", "pipeline.microbatches=4")
    trainer = Trainer.build(config(*PIPELINED, *pipe, rules="pp", mesh={"stage": 2, "data": 4}))
    same_as_one_device(trainer, one_device(*PIPELINED, "train.microbatches=4"))


def test_deepseek_refuses_what_it_cannot_run_in_one_line():
    with fails_early(r"^model\.deepseek: rules 'pp' pipeline model\.blocks only: dense_layers \(1\) and "
                     r"mtp_depth \(1\) must be 0"):
        Trainer.build(config(rules="pp", mesh={"stage": 2, "data": 4}))
    with fails_early(r"^plan: the analytic model describes Llama-style decoders, not model\.deepseek's"):
        plan.search(config().model, [], None, 1024, 128)
    for override, match in [("model.deepseek.qk_rope_head_dim=7", r"qk_rope_head_dim \(7\) must be even"),
                            ("model.deepseek.dense_layers=3", r"dense_layers \(3\) must be below model\.layers"),
                            ("model.deepseek.mtp_loss_weight=nan", r"^model\.deepseek\.mtp_loss_weight must be"),
                            ("model.moe=null", r"^model\.deepseek: needs model\.moe")]:
        with pytest.raises(ConfigError, match=match):
            config(override)


def test_the_full_deepseek_v3_config_has_its_671b_parameters():
    """configs/models/deepseek-v3-671b.yaml's shapes: DeepSeek-V3's technical report counts 671B parameters in the
    main model; the MTP module (one MoE layer, its projection and norms; its embedding and head are the shared
    ones) adds 11.6B."""
    shapes = jax.tree_util.tree_flatten_with_path(abstract_model(load_config(None, ["model=deepseek-v3-671b"]))[1])[0]
    total = sum(math.prod(a.shape) for _, a in shapes)
    mtp = sum(math.prod(a.shape) for path, a in shapes if path[0].key == "mtp")
    assert round((total - mtp) / 1e9) == 671 and round(mtp / 1e8) == 116
