"""Where Muon's matrices are (jaxscale/training/muon_layout.py): which parameters are hidden matrices, their owner
layouts
under the shipped rules tables, the bytes the compiled zero3 step moves for them, and bad input."""

from __future__ import annotations

import math

import jax
import pytest
from helpers import fails_early, partitioned_hlo, tiny_config

from jaxscale.analysis import hlo
from jaxscale.layout.rules import Layout
from jaxscale.layout.sharding import Rules, named_params
from jaxscale.training.muon_layout import fans, is_hidden_matrix, owner_layout, owner_partition
from jaxscale.training.trainer import Trainer

MUON = ("train.optimizer=muon", "train.muon.ns_dtype=float32", "train.steps=3")


@pytest.mark.parametrize("axes, hidden", [
    (("layers", "embed", "heads", "head_dim"), True),
    (("layers", "heads", "head_dim", "embed"), True),
    (("layers", "expert", "embed", "expert_mlp"), True),
    ((None, "embed", "heads", "head_dim"), True),  # a user model's stack of q, k, v
    (("vocab", "embed"), False),  # embedding
    (("embed", "vocab"), False),  # head
    (("layers", "embed"), False),  # norm scales
    (("layers", "embed", None), False),  # router
    ((None, "embed"), False),  # learned positions
])
def test_hidden_matrices_are_read_from_logical_axes(axes, hidden):
    assert is_hidden_matrix(axes) is hidden


def test_fans_put_the_residual_stream_last():
    assert fans((2, 64, 8, 16), ("layers", "embed", "heads", "head_dim")) == (64, 128)
    assert fans((2, 8, 16, 64), ("layers", "heads", "head_dim", "embed")) == (128, 64)
    assert fans((2, 4, 64, 32), ("layers", "expert", "embed", "expert_mlp")) == (64, 32)


WQ = ("layers", "embed", "heads", "head_dim")
W_GATE = ("layers", "expert", "embed", "expert_mlp")


@pytest.mark.parametrize("rules, mesh, shape, axes, owner", [
    ("zero3", {"fsdp": 8}, (8, 64, 8, 8), WQ, ("fsdp", None, None, None)),  # one all-to-all each way
    ("zero3", {"fsdp": 8}, (2, 64, 8, 8), WQ, (None, None, None, None)),  # 2 layers over 8: gathered
    ("fsdp_tp", {"fsdp": 4, "tensor": 2}, (2, 64, 8, 8), WQ, ("tensor", None, None, None)),
    ("fsdp_tp", {"fsdp": 4, "tensor": 2}, (8, 64, 8, 8), WQ, (("fsdp", "tensor"), None, None, None)),
    ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, (8, 64, 8, 8), WQ,
     (("stage", "fsdp", "tensor"), None, None, None)),
    ("ep_fsdp", {"fsdp": 4, "expert": 2}, (2, 8, 64, 32), W_GATE, (None, ("expert", "fsdp"), None, None)),
    ("dp", {"data": 8}, (8, 64, 8, 8), WQ, (None, None, None, None)),
])
def test_owner_layouts_of_the_shipped_tables(rules, mesh, shape, axes, owner):
    assert owner_partition(Layout(Rules.load(rules), mesh), shape, axes) == owner


@pytest.mark.parametrize("shape, owner, padded", [
    ((6, 64, 8, 8), ("fsdp", None, None, None), (8, 64, 8, 8)),  # 2·7/8·8/6 = 2.33 shards moved against 7
    ((3, 64, 8, 8), ("fsdp", None, None, None), (8, 64, 8, 8)),  # 2·7/8·8/3 = 4.67 against 7
    ((4, 64, 8, 8), ("fsdp", None, None, None), (8, 64, 8, 8)),  # 2·7/8·8/4 = 3.5 against 7
    ((2, 64, 8, 8), (None, None, None, None), (2, 64, 8, 8)),  # 2·7/8·8/2 = 7 against 7: gathered
])
def test_a_stack_fsdp_does_not_divide_is_padded_where_that_moves_fewer_bytes(shape, owner, padded):
    """Padding L to L' costs 2·(k−1)/k·L'/L shards, gathering (k−1): padded where 2·L' < k·L."""
    assert owner_layout(Layout(Rules.load("zero3"), {"fsdp": 8}), shape, WQ) == (owner, padded)


def test_a_rules_muon_section_names_the_owners():
    rules = Rules.from_dict("own", {"rules": {"layers": None, "embed": "fsdp", "heads": None, "head_dim": None},
                                    "muon": {"layers": "fsdp", "embed": None}})
    assert owner_partition(Layout(rules, {"fsdp": 8}), (8, 64, 8, 8), WQ) == ("fsdp", None, None, None)
    split = Rules.from_dict("split", {"rules": {"layers": None, "embed": "fsdp", "heads": None, "head_dim": None},
                                      "muon": {"layers": "fsdp"}})
    with fails_early(r"^rules 'split' muon: .*: mesh axis 'fsdp' shards both 'layers' and 'embed' of "):
        owner_partition(Layout(split, {"fsdp": 8}), (8, 64, 8, 8), WQ)
    whole = Rules.from_dict("whole", {"rules": {"layers": None, "embed": "fsdp", "heads": None, "head_dim": None},
                                      "muon": {"layers": "fsdp", "embed": None, "heads": "tensor"}})
    with fails_early(r"^rules 'whole' muon: .* keeps a matrix dimension split over tensor: Newton-Schulz needs whole"):
        owner_partition(Layout(whole, {"fsdp": 8, "tensor": 1}), (8, 64, 8, 8), WQ)


def test_zero3_moves_each_hidden_matrix_by_two_all_to_alls(trainers):
    """8 layers over fsdp = 8: each device owns one layer of every stack. The optimizer's collectives are two
    all-to-alls per stack, each of (n - 1) / n of the device's shard (fp32 here: XLA:CPU widens bf16 ones)."""
    trainer, compiled = trainers.step(*MUON, "model.layers=8", rules="zero3", mesh={"fsdp": 8})
    update = [c for c in hlo.collectives(compiled.as_text(), trainer.mesh) if c.phase == "update"]
    stacks = [leaf for _, leaf, axes in named_params(trainer.abstract_params, trainer.axes) if is_hidden_matrix(axes)]
    assert {c.kind for c in update} == {"all-to-all"} and {c.axes for c in update} == {("fsdp",)}
    assert len(update) == 2 * len(stacks) == 14
    n = trainer.mesh.size
    shard = sum(math.prod(leaf.shape) * 4 for leaf in stacks) / n
    assert sum(c.wire_bytes for c in update) == 2 * (n - 1) / n * shard


@pytest.mark.slow
def test_the_moves_are_in_the_iterations_dtype(tmp_path):
    """ns_dtype bfloat16 (the default): the partitioned step moves bf16 to and from the owners (XLA:CPU's later
    passes widen them to fp32, so the partitioner's HLO is read)."""
    trainer = Trainer.build(tiny_config("train.optimizer=muon", "model.layers=8", rules="zero3", mesh={"fsdp": 8}))
    moves = [line for line in partitioned_hlo(trainer, tmp_path).splitlines()
             if " all-to-all(" in line and "sharding_constraint" in line]
    assert len(moves) == 14 and all(line.split("=", 1)[1].lstrip().startswith("bf16[") for line in moves)


def test_bad_muon_settings_are_one_line():
    with fails_early(r"^train\.muon\.ns_steps must be at least 1, got 0$"):
        tiny_config("train.optimizer=muon", "train.muon.ns_steps=0")
    with fails_early(r"^train\.muon\.momentum must be in \[0, 1\), got 1\.0$"):
        tiny_config("train.muon.momentum=1.0")
    with fails_early(r"^train\.muon\.adamw_axes: 'vocabulary' is not a logical axis \(batch, "):
        tiny_config("train.muon.adamw_axes=[vocabulary]")
    with fails_early(r"train\.optimizer"):
        tiny_config("train.optimizer=sgd")


def test_a_muon_section_that_splits_a_matrix_is_refused_at_build(tmp_path):
    path = tmp_path / "split.yaml"
    path.write_text("rules:\n  batch: [data, fsdp]\n" + "".join(
        f"  {a}: null\n" for a in ("length", "norm_length", "act_embed", "heads", "kv_heads", "head_dim", "mlp",
                                   "expert", "expert_mlp", "expert_batch", "vocab", "layers", "q_lora", "kv_lora",
                                   "q_lora_up", "kv_lora_up")) + "  embed: fsdp\nmuon:\n  layers: fsdp\n")
    with fails_early(r"^param blocks\.attn\.wk: rules 'split' muon: \('layers', 'embed', 'kv_heads', 'head_dim'\): "
                     r"mesh axis 'fsdp' shards both 'layers' and 'embed' of "):
        Trainer.build(tiny_config(*MUON, "model.layers=8", rules=str(path), mesh={"fsdp": 8}), jax.devices())
