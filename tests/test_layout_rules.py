"""jaxscale.layout.rules: queries against layouts worked out by hand, and every error of Layout.validate."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import tiny_config

from jaxscale.config.read import MESH_AXES, ConfigError, PipelineConfig
from jaxscale.layout import stage_plan
from jaxscale.layout.rules import Layout, Rules, part_axes
from jaxscale.layout.stage_plan import Blocks, StagePlan

MOE = ("model.moe={experts: 8, top_k: 2}",)


def on(rules: str | Rules, **sizes: int) -> Layout:
    """A preset (or a Rules) on a mesh; unnamed axes have size 1."""
    table = Rules.load(rules) if isinstance(rules, str) else rules
    return Layout(table, {a: sizes.get(a, 1) for a in MESH_AXES})


def edited(preset: str, **changes: str | list[str] | None) -> Rules:
    """A preset's rules with some names mapped elsewhere (``None``: dropped from the table)."""
    base = Rules.load(preset)
    params = {k: v for k, v in base.params.items() if changes.get(k, ...) is not None}
    for name, to in changes.items():
        if to is not None:
            params[name] = (to,) if isinstance(to, str) else tuple(to)
    return Rules(f"{preset}_edited", params, base.optimizer, base.gradients)


def test_layout_and_axis_names_do_not_import_jax():
    modules = ", ".join(["jaxscale.layout.rules", "jaxscale.config.stage_layers", "jaxscale.config.dtypes",
                         "jaxscale.parallel.schedules", "jaxscale.config.axes"])
    code = f"import sys, {modules}; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_fsdp_tp_sp_queries():
    layout = on("fsdp_tp_sp", data=2, fsdp=2, tensor=2)
    assert layout.partition(("batch", "norm_length", "act_embed")) == (("data", "fsdp"), "tensor", None)
    assert layout.mesh_axes(("embed", "mlp")) == ("fsdp", "tensor")
    assert layout.ways(("embed", "mlp")) == 4
    assert layout.batch_axes == ("data", "fsdp") and layout.batch_shards == 4
    assert layout.token_axes == ("data", "fsdp")
    assert layout.sequence_axes == ("tensor",)
    assert layout.tensor_axes == ("tensor",)
    assert layout.context_axes == () and layout.ring_size == 1
    assert layout.expert_axes == () and layout.stages == 1 and not layout.pipelined


def test_size_one_axes_split_nothing():
    """fsdp_tp_sp with tensor=1: no sequence parallelism, though the table names tensor."""
    layout = on("fsdp_tp_sp", fsdp=8)
    assert layout.axes_of("norm_length") == ("tensor",)
    assert layout.sequence_axes == () and layout.tensor_axes == ()
    assert layout.batch_axes == ("fsdp",) and layout.batch_shards == 8
    assert layout.partition(("mlp",)) == ("tensor",)  # the spec keeps the axis; it has one device


def test_optimizer_and_gradient_kinds():
    zero1 = on("zero1", data=8)
    assert zero1.mesh_axes(("embed",)) == ()
    assert zero1.mesh_axes(("embed",), "optimizer") == ("data",)
    assert zero1.ways(("embed", "mlp"), "optimizer") == 8
    assert zero1.mesh_axes(("embed",), "gradients") == ()
    zero2 = on("zero2", data=2, fsdp=4)
    assert zero2.ways(("embed",), "gradients") == 8 and zero2.ways(("embed",)) == 1


def test_context_parallel_queries():
    layout = on("fsdp_tp_cp", fsdp=2, context=2, tensor=2)
    assert layout.context_axes == ("context",) and layout.ring_size == 2
    assert layout.sequence_axes == ("tensor",)  # norm_length [context, tensor], less length's context
    assert layout.token_axes == ("fsdp", "context")
    assert layout.mesh_axes(("embed",)) == ("fsdp", "context")


def test_expert_and_pipeline_queries():
    ep = on("ep_fsdp_tp", fsdp=2, expert=2, tensor=2)
    assert ep.expert_axes == ("expert",)
    assert ep.batch_axes == ("fsdp", "expert") and ep.batch_shards == 4
    assert ep.mesh_axes(("expert", "embed", "expert_mlp")) == ("expert", "fsdp", "tensor")
    pp = on("pp_fsdp", stage=2, data=2, fsdp=2)
    assert pp.pipelined and pp.stages == 2 and pp.stage_axes == ("stage",)
    # data shards no block parameter, fsdp does (embed): the pipeline sums gradients over data only.
    assert pp.data_axes([("layers", "embed", "mlp"), ("layers", "embed")]) == ("data",)
    assert on("pp", stage=2, data=4).data_axes([("layers", "embed", "mlp")]) == ("data", "fsdp")
    assert not on("pp", data=8).pipelined and on("pp", data=8).stages == 1


def test_missing_names_are_replicated_in_queries_and_errors_in_specs():
    layout = on(edited("tp_sp", norm_length=None), tensor=8)
    assert layout.sequence_axes == () and layout.mesh_axes(("norm_length", None)) == ()
    with pytest.raises(ConfigError, match=r"^logical axis 'norm_length' is not in rules table 'tp_sp_edited'$"):
        layout.partition(("batch", "norm_length"))
    with pytest.raises(ConfigError, match=r"mesh axis 'tensor' shards both 'heads' and 'mlp'"):
        layout.partition(("heads", "mlp"))


def test_part_axes():
    assert part_axes(None) == () and part_axes("data") == ("data",) and part_axes(("data", "fsdp")) == ("data", "fsdp")


@pytest.mark.parametrize(
    "rules, mesh, overrides",
    [
        ("fsdp_tp_sp", {"data": 2, "fsdp": 2, "tensor": 2}, ["model.tp_overlap=true"]),
        ("fsdp_tp_cp", {"fsdp": 2, "context": 2, "tensor": 2}, ["model.attention=ring"]),
        ("ep_fsdp_tp", {"fsdp": 2, "expert": 2, "tensor": 2}, [*MOE, "model.attention=blockwise"]),
        ("pp_fsdp_tp", {"stage": 2, "fsdp": 2, "tensor": 2}, []),
        ("pp_tp_cp", {"stage": 4, "context": 2, "tensor": 4}, ["model.attention=ring", "model.layers=4"]),
        ("pp_fsdp_tp_cp", {"stage": 2, "fsdp": 2, "context": 2, "tensor": 2}, ["model.attention=ring"]),
    ],
)
def test_presets_validate(rules, mesh, overrides):
    on(rules, **mesh).validate(tiny_config(*overrides, rules=rules, mesh=mesh))


def refuse(layout: Layout, match: str, *overrides: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        layout.validate(tiny_config(*overrides))
    assert "\n" not in str(info.value)


def plan(layout: Layout, blocks: list, experts: str | None = None, fsdp: str = "step") -> StagePlan:
    """The stage plan of a model whose blocks' parameters have these logical axes."""
    return stage_plan.plan(layout, PipelineConfig(fsdp=fsdp), Blocks(tuple(blocks), experts))


def manual(layout: Layout, blocks: list, experts: str | None = None, fsdp: str = "step") -> tuple[str, ...]:
    """The mesh axes of size > 1 (and ``stage``) a stage's loop is manual over."""
    found = plan(layout, blocks, experts, fsdp)
    return (*found.rows, *found.tensor)


def test_what_a_stage_makes_manual_and_when_it_skips_idle_slots():
    """The loop is manual over stage, the batch axes, context and, where nothing else would be left to the
    partitioner, TP's axes: then idle slots are skipped. FSDP's fsdp, which splits block parameters on
    ``embed`` alone, is manual too (the stage gathers its blocks over it once a step). An MoE model, or a
    batch axis splitting a parameter dimension with tensor, leaves axes to the partitioner: masked slots."""
    blocks = [("layers", "embed", "heads", "head_dim")]
    layout = on("pp_tp_cp", stage=2, data=2, context=2)
    assert manual(layout, blocks) == ("stage", "data", "fsdp", "context")
    assert plan(layout, blocks).skip  # the ring gathers: no permute in a conditional
    layout = on("pp_tp_cp", stage=2, context=2, tensor=2)
    assert manual(layout, blocks) == ("stage", "data", "fsdp", "context", "tensor")
    assert plan(layout, blocks).tensor == ("tensor",)
    assert plan(layout, blocks).skip
    # Skipping, the size-1 axes are manual too, after the others.
    assert plan(layout, blocks).manual == ("stage", "data", "fsdp", "context", "tensor", "ulysses", "expert")
    assert plan(on("pp", stage=2, data=4), blocks).skip
    layout = on("pp_fsdp_tp_cp", stage=2, fsdp=2, context=2)
    assert manual(layout, blocks) == ("stage", "data", "fsdp", "context")
    assert plan(layout, blocks).gathered == ("fsdp",)
    assert manual(on("pp_fsdp_tp", stage=2, context=2), blocks) == ("stage", "data", "fsdp")
    assert plan(on("pp_fsdp", stage=2, fsdp=4), blocks).skip
    layout = on("pp_fsdp_tp", stage=2, fsdp=2, tensor=2)
    assert manual(layout, blocks) == ("stage", "data", "fsdp", "tensor")
    assert (plan(layout, blocks).gathered, plan(layout, blocks).free) == (("fsdp",), ())
    # pipeline.fsdp=tick: fsdp left to the partitioner, and tensor with it; idle slots masked.
    ticked = plan(layout, blocks, fsdp="tick")
    assert (ticked.rows, ticked.gathered, ticked.free, ticked.skip) == (("stage", "data"), (), ("fsdp", "tensor"),
                                                                        False)
    # A batch axis that splits a block parameter with an axis outside the batch stays with the partitioner,
    # and tensor with it.
    mixed = on(edited("pp_fsdp_tp", heads=["fsdp", "tensor"]), stage=2, fsdp=2, tensor=2)
    assert manual(mixed, blocks) == ("stage", "data")
    assert plan(mixed, blocks).gathered == ()
    assert plan(mixed, blocks).free == ("fsdp", "tensor")
    assert manual(on("pp_fsdp", stage=2, fsdp=4), blocks, "partitioner") == ("stage",)
    assert plan(on("pp_fsdp_tp", stage=2, fsdp=2, tensor=2), blocks, "partitioner").free == ("fsdp", "tensor")
    # A model whose projections do not write TP's collectives (no explicit_tp) leaves tensor to the partitioner.
    own = stage_plan.plan(layout, PipelineConfig(), Blocks(tuple(blocks), explicit_tp=False))
    assert (own.tensor, own.free) == ((), ("tensor",))
    # Explicit experts (model.moe.impl=shard_map): as a dense model, the experts kept split over expert (never
    # gathered); FSDP's embed gathered; with SP (sequences split) tensor stays free.
    experts = [*blocks, ("layers", "expert", "embed", "expert_mlp")]
    ep = on(edited("pp_ep", embed="fsdp", expert_mlp="tensor", heads="tensor"), stage=2, expert=2, fsdp=2, tensor=2)
    assert manual(ep, experts, "shard_map") == ("stage", "data", "fsdp", "expert", "tensor")
    assert (plan(ep, experts, "shard_map").expert, plan(ep, experts).gathered) == (("expert",), ("fsdp",))
    assert plan(ep, experts, "shard_map").expert_mlp == ("tensor",)
    assert plan(ep, experts).expert == ()
    assert plan(on("pp_tp_sp", stage=2, tensor=2), experts, "shard_map").free == ("tensor",)
    assert plan(on("pp_tp_sp", stage=2, tensor=2), experts).free == ()


def test_validate_and_the_pipeline_plan_one_stage():
    """Layout.validate reads the pipeline settings it is given: pipeline.fsdp=tick leaves fsdp to the
    partitioner, which explicit experts cannot run beside, refused there (once read as step, it was refused
    only when the step was traced); and the model's own parts (no explicit_tp: tensor left to the
    partitioner), as the pipeline's build reads them."""
    layout = on("pp_fsdp", stage=2, fsdp=4)
    explicit = (*MOE, "model.moe.impl=shard_map")
    layout.validate(tiny_config(*explicit))
    refuse(layout, r"^rules 'pp_fsdp': model\.moe\.impl=shard_map inside a pipeline stage needs the stage's loop "
           r"manual over every mesh axis, but \['fsdp'\] would stay with the partitioner \(sequence parallelism, "
           r"pipeline\.fsdp=tick", *explicit, "pipeline.fsdp=tick")
    layout.validate(tiny_config(*MOE, "model.moe.impl=partitioner", "pipeline.fsdp=tick"))
    config = tiny_config(*explicit)
    tp = on("pp_fsdp_tp", stage=2, tensor=2)
    tp.validate(config)  # a built-in model's blocks: their projections write TP's collectives
    with pytest.raises(ConfigError, match=r"^rules 'pp_fsdp_tp': .* but \['tensor'\] would stay with the partitioner"):
        tp.validate(config, Blocks.of(config.model, explicit_tp=False))


def test_pipeline_errors():
    refuse(on(edited("pp", layers=["stage", "data"]), stage=2, data=2, tensor=2),
           r"^rules 'pp_edited': layers maps to \['stage', 'data'\]; a pipeline needs layers on 'stage' alone$")
    refuse(on(edited("pp", norm_length="tensor"), stage=2, tensor=2),
           r"^rules 'pp_edited': model\.tp_overlap \(collective matmuls\) inside a pipeline stage",
           "model.tp_overlap=true")
    cp = r"^rules 'pp_edited': context parallelism \(length on \['context'\]\) inside a pipeline stage needs "
    refuse(on(edited("pp", length="context", norm_length="context"), stage=2, context=2),
           cp + r"model\.attention=ring: the loop is manual over the context axes, so model\.attention=dot would")
    refuse(on(edited("pp", length="context", norm_length="context"), stage=2, context=2),
           cp + r"a dense model", *MOE, "model.moe.impl=partitioner", "model.attention=ring")
    refuse(on(edited("pp", length="context", norm_length="context", embed="context"), stage=2, context=2),
           cp + r"the block parameters unsplit over \['context'\]", "model.attention=ring")
    sp = on("pp_tp_sp", stage=2, tensor=2)
    refuse(sp, r"^rules 'pp_tp_sp': model\.moe\.impl=shard_map inside a pipeline stage needs the stage's loop manual "
           r"over every mesh axis, but \['tensor'\] would stay with the partitioner", *MOE, "model.moe.impl=shard_map")
    refuse(on("pp_ep", stage=2, expert=2), r"^rules 'pp_ep': precision\.fp8=delayed with model\.moe\.impl=shard_map "
           r"inside a pipeline stage is not supported", *MOE, "model.moe.impl=shard_map", "precision.fp8=delayed")
    for impl in ("partitioner", "shard_map"):
        on("pp", stage=2, data=4).validate(tiny_config(*MOE, f"model.moe.impl={impl}"))
    sp.validate(tiny_config(*MOE, "model.moe.impl=partitioner"))


def test_sequence_parallel_errors():
    refuse(on(edited("fsdp_tp_cp", norm_length=["tensor", "context"]), context=2, tensor=2),
           r"^rules 'fsdp_tp_cp_edited': norm_length \['tensor', 'context'\] must start with the mesh axes of "
           r"length \['context'\]$")
    refuse(on("tp", data=2, tensor=4), r"^model\.tp_overlap needs sequence parallelism: rules 'tp' shard norm_length "
           r"over no mesh axis of size > 1", "model.tp_overlap=true")
    refuse(on(edited("tp_sp", heads="data", kv_heads="data"), data=2, tensor=4),
           r"^rules 'tp_sp_edited': sequence parallelism over \('tensor',\) needs the contracted axes "
           r"\('heads', 'head_dim'\)")
    refuse(on(edited("tp_sp", mlp="data"), data=2, tensor=4),
           r"needs the contracted axes \('mlp',\)")
    # An MoE model with no dense MLP has nothing to reduce over mlp.
    on(edited("tp_sp", mlp="data", expert_batch="fsdp"), data=2, tensor=4).validate(tiny_config(*MOE))


def test_attention_errors():
    refuse(on(edited("tp", head_dim="data"), data=2, tensor=4),
           r"^rules 'tp_edited': 'head_dim' must not be sharded for ring/blockwise attention$",
           "model.attention=blockwise")
    refuse(on(edited("tp", kv_heads="data"), data=2, tensor=4),
           r"^rules 'tp_edited': 'heads' and 'kv_heads' must be sharded over the same mesh axes for ring/blockwise "
           r"attention \(got tensor and data\)$", "model.attention=blockwise")
    refuse(on("cp", fsdp=2, context=4), r"^train\.seq_len \(36\) is not divisible by 8: causal ring attention "
           r"over context cuts it into 2 x 4 chunks \(model\.attention=ring under rules 'cp'\)$",
           "model.attention=ring", "train.seq_len=36")
    refuse(on("cp", fsdp=4, context=2), r"^model\.attention_block \(3\) does not divide the 8-token chunks of "
           r"train\.seq_len \(32\)$", "model.attention=ring", "model.attention_block=3")
    refuse(on("dp", data=8), r"^model\.attention_block \(20\) does not divide the 32-token chunks",
           "model.attention=blockwise", "model.attention_block=20")
    on("dp", data=8).validate(tiny_config("model.attention=dot", "model.attention_block=20"))  # dot has no tiles


def test_expert_parallel_errors():
    refuse(on(edited("ep", batch=["data", "fsdp"]), expert=8),
           r"^rules 'ep_edited': expert parallelism over \('expert',\) needs 'batch' sharded over the same", *MOE)
    refuse(on(edited("ep_fsdp_tp", expert_mlp="fsdp"), fsdp=2, expert=2, tensor=2),
           r"^rules 'ep_fsdp_tp_edited': 'expert_mlp' and 'batch' share mesh axes \['fsdp'\]$", *MOE)
    refuse(on(edited("ep", act_embed="tensor"), expert=4, tensor=2),
           r"^rules 'ep_edited': expert parallelism needs 'act_embed' unsharded$", *MOE)
    refuse(on(edited("fsdp_tp_cp", expert_mlp="tensor"), fsdp=2, context=2, tensor=2),
           r"^rules 'fsdp_tp_cp_edited': the sequence \('norm_length' on \('context', 'tensor'\)\) must be sharded "
           r"over all or none of the axes of 'expert_mlp' \(\('tensor',\)\)$", *MOE)
    # The partitioner's dispatch states only layouts: none of these checks apply.
    on(edited("ep", batch=["data", "fsdp"]), expert=8).validate(tiny_config(*MOE, "model.moe.impl=partitioner"))
