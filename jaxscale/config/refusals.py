"""The refusal table: every rule that names two or more config settings, as data (no jax).

Each :class:`Refusal` is one row: the settings it names, the predicate that breaks it, and the one line
:class:`ConfigError` raised when it does (a format string over the config's sections, ``rules`` and the values of
a :class:`~jaxscale.config.refusal_context.Context`). ``needs`` says what the predicate reads: the config alone
(checked when the config is read, :func:`jaxscale.config.read.validate`, and again at build), the rules table on
the mesh (``layout``: :meth:`jaxscale.layout.rules.Layout.validate`, when the trainer is built) or the model's
parts too (``model``: the trainer's contract check). ``docs/compatibility.md`` is generated from this table
(:mod:`jaxscale.config.compatibility`); adding a refusal is adding a row (and its example in
``tests/test_refusals.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from jaxscale.config import dtypes, stage_layers
from jaxscale.config.refusal_context import Context, Needs
from jaxscale.config.schema import INTERLEAVED, ConfigError, Nvfp4Config

STAGES: tuple[Needs, ...] = ("config", "layout", "model")
SECTIONS = ("model", "mesh", "train", "data", "distributed", "checkpoint", "pipeline", "xla", "precision")
AUTO = "mesh.axis_types=auto"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One rule: the settings it names, when it refuses (``broken``), and its one line."""

    name: str
    keys: tuple[str, ...]
    broken: Callable[[Context], bool]
    line: str
    needs: Needs = "config"

    def message(self, context: Context) -> str:
        """The one line, with the values of ``context``."""
        return self.line.format_map(_Names(context))

    def reason(self) -> str:
        """The line with each value left out (``…``), as the docs print it."""
        return re.sub(r"\{[^{}]*\}", "…", self.line)


class _Names(Mapping[str, Any]):
    """A line's fields: a config section (``{model.heads}``), ``rules`` (the table's name), or a context value."""

    def __init__(self, context: Context) -> None:
        self.context = context

    def __getitem__(self, key: str) -> Any:
        config = self.context.config
        if key in SECTIONS:
            return getattr(config, key)
        if key == "rules":
            return self.context.layout.name if self.context.layout is not None else config.rules
        return getattr(self.context, key)

    def __iter__(self) -> Iterator[str]:
        return iter(SECTIONS)

    def __len__(self) -> int:
        return len(SECTIONS)


def _moe(c: Context) -> Any:
    return c.config.model.moe


def _stage_explicit_experts(c: Context) -> bool:
    return c.pipelined and _moe(c) is not None and _moe(c).impl == "shard_map"


def _qk_clip(c: Context) -> bool:
    return c.config.train.qk_clip is not None


def _explicit(c: Context) -> bool:
    return c.config.mesh.axis_types == "explicit"


def _blockwise(c: Context) -> bool:
    return c.config.precision.fp8 == "blockwise"


def _block_scaled(c: Context) -> bool:
    return c.config.precision.fp8 in ("mxfp8", "nvfp4")


def _nvfp4_changed(c: Context) -> bool:
    nv = c.config.precision.nvfp4
    return not (nv.hadamard and nv.weight_2d and nv.stochastic_rounding) or nv.bf16_last != Nvfp4Config.bf16_last


STAGE_EXPERTS = (
    "rules '{rules}': model.moe.impl=shard_map inside a pipeline stage needs the stage's loop manual over every mesh "
    "axis, but {free} would stay with the partitioner (sequence parallelism, pipeline.fsdp=tick, or an axis "
    "sharing a parameter dimension with others); model.moe.impl=partitioner runs the experts there (idle slots "
    "computed and masked)")
R = Refusal
RULES: tuple[Refusal, ...] = (
    # -- the model
    R("moe-top-k", ("model.moe.top_k", "model.moe.experts"), lambda c: _moe(c) is not None
      and _moe(c).top_k > _moe(c).experts, "model.moe.top_k ({model.moe.top_k}) is more than model.moe.experts "
      "({model.moe.experts})"),
    R("moe-every", ("model.layers", "model.moe.every_n_layers"), lambda c: _moe(c) is not None
      and c.config.model.layers % max(_moe(c).every_n_layers, 1) > 0,
      "model.layers ({model.layers}) is not divisible by model.moe.every_n_layers ({model.moe.every_n_layers})"),
    R("moe-groups", ("model.moe.groups", "model.moe.experts"), lambda c: _moe(c) is not None
      and (_moe(c).groups < 1 or _moe(c).experts % _moe(c).groups > 0),
      "model.moe.groups ({model.moe.groups}) must divide model.moe.experts ({model.moe.experts})"),
    R("top-groups", ("model.moe.top_groups", "model.moe.groups", "model.moe.top_k"), lambda c: _moe(c) is not None
      and _moe(c).groups > 1 and not (1 <= _moe(c).top_groups <= _moe(c).groups
                                      and _moe(c).top_groups * _moe(c).experts // _moe(c).groups >= _moe(c).top_k),
      "model.moe.top_groups ({model.moe.top_groups}) must be in [1, model.moe.groups] and hold model.moe.top_k "
      "({model.moe.top_k}) experts ({per_group} per group)"),
    R("quantile-top-k", ("model.moe.balance", "model.moe.top_k", "model.moe.experts"), lambda c: _moe(c) is not None
      and _moe(c).balance == "quantile" and _moe(c).top_k == _moe(c).experts,
      "model.moe.balance=quantile needs model.moe.top_k < model.moe.experts (a token's cutoff is its (k+1)-th "
      "score)"),
    R("quantile-groups", ("model.moe.balance", "model.moe.groups"), lambda c: _moe(c) is not None
      and _moe(c).balance == "quantile" and _moe(c).groups > 1,
      "model.moe.balance=quantile: not with group-limited routing (model.moe.groups > 1)"),
    R("deepseek-moe", ("model.deepseek", "model.moe"), lambda c: c.config.model.deepseek is not None
      and _moe(c) is None,
      "model.deepseek: needs model.moe (the blocks after model.deepseek.dense_layers are MoE)"),
    R("deepseek-every", ("model.deepseek", "model.moe.every_n_layers"), lambda c: c.config.model.deepseek
      is not None and _moe(c) is not None and _moe(c).every_n_layers != 1,
      "model.deepseek: every block after the dense ones is MoE (model.moe.every_n_layers: 1)"),
    R("deepseek-dense", ("model.deepseek.dense_layers", "model.layers"), lambda c: c.config.model.deepseek
      is not None and c.config.model.deepseek.dense_layers >= c.config.model.layers,
      "model.deepseek.dense_layers ({model.deepseek.dense_layers}) must be below model.layers ({model.layers})"),
    R("heads-kv", ("model.heads", "model.kv_heads"), lambda c: c.config.model.kv_heads > 0
      and c.config.model.heads % c.config.model.kv_heads > 0,
      "model.heads ({model.heads}) is not divisible by model.kv_heads ({model.kv_heads})"),
    R("cudnn-float32", ("model.attention", "model.dtype"), lambda c: c.config.model.attention == "cudnn"
      and c.config.model.dtype == "float32",
      "model.attention: 'cudnn' needs model.dtype bfloat16 or float16, got float32"),
    R("qk-clip-cudnn", ("train.qk_clip", "model.attention"), lambda c: _qk_clip(c)
      and c.config.model.attention == "cudnn",
      "train.qk_clip: model.attention 'cudnn' hands out no attention scores, whose largest per head QK-clip reads: "
      "use 'blockwise' (flash-style, the maxima for free), 'dot' or 'auto' (which then never picks cudnn)"),
    R("qk-clip-qk-norm", ("train.qk_clip", "model.qk_norm"), lambda c: _qk_clip(c) and c.config.model.qk_norm,
      "train.qk_clip: with model.qk_norm the heads' queries and keys are RMS-normed after their projections, so "
      "scaling the projections' weights leaves the logits as they were"),
    R("qk-clip-fused", ("train.qk_clip", "model.fused_projections"), lambda c: _qk_clip(c)
      and c.config.model.fused_projections,
      "train.qk_clip: not with model.fused_projections yet (QK-clip scales wq and wk; w_qkv holds them in one "
      "tensor): model.fused_projections=false"),
    # Checked on jax 0.12.0.1: jax.nn.dot_product_attention(implementation="cudnn") takes query_seq_lengths and
    # key_value_seq_lengths ([batch]: one document a row) or a dense mask (an s x s bias); the packed form (segment
    # offsets, q_offsets/kv_offsets) is only in the private jax._src.cudnn.fused_attention_stablehlo.
    R("cudnn-documents", ("data.documents", "model.attention"), lambda c: c.config.data.documents
      and c.config.model.attention == "cudnn",
      "data.documents: model.attention 'cudnn' does not mask across documents (jax's public cuDNN attention takes "
      "one length per sequence): use 'blockwise', flash-style with the tiles across documents skipped, or 'auto' "
      "(docs/attention.md)"),
    R("ring-balance-documents", ("data.ring_balance", "data.documents"), lambda c: c.config.data.ring_balance
      and not c.config.data.documents, "data.ring_balance: needs data.documents=true (it arranges each row's "
      "documents)"),
    R("ring-balance-ring", ("data.ring_balance", "model.attention"), lambda c: c.config.data.ring_balance
      and c.attention_ring < 2, "data.ring_balance: needs ring attention over 2 or more devices (model.attention="
      "{model.attention}, a ring of {attention_ring} under rules '{rules}')", "layout"),
    R("mtp-documents-ring", ("model.deepseek.mtp_depth", "data.documents", "model.attention"),
      lambda c: bool(c.config.data.documents and c.config.model.deepseek and c.config.model.deepseek.mtp_depth
                     and c.attention_ring > 1),
      "model.deepseek.mtp_depth: not with data.documents under model.attention=ring over a ring of "
      "{attention_ring} (rules '{rules}': the rows zig-zagged over it, and their logical order is not to be read "
      "from positions that restart at each document); Ulysses alone keeps the rows in order", "layout"),
    R("loss-chunk", ("model.loss_chunk", "train.seq_len"), lambda c: c.config.model.loss_chunk > 0
      and c.config.train.seq_len % c.config.model.loss_chunk > 0,
      "model.loss_chunk ({model.loss_chunk}) does not divide train.seq_len ({train.seq_len})"),
    R("stage-layers-sum", ("pipeline.layers_per_stage", "model.layers"),
      lambda c: c.listed > 0 and sum(c.config.pipeline.layers_per_stage) != stage_layers.stacked(c.config.model),
      "pipeline.layers_per_stage {pipeline.layers_per_stage}: sums to {listed_sum}, not {stacked}"),
    R("stage-layers-unit", ("pipeline.layers_per_stage", "model.moe.every_n_layers"),
      lambda c: any(n % stage_layers.unit(c.config.model) for n in c.config.pipeline.layers_per_stage or ()),
      "pipeline.layers_per_stage {pipeline.layers_per_stage}: each entry must be a multiple of "
      "model.moe.every_n_layers ({model.moe.every_n_layers})"),
    # -- the data
    R("vocab-bytes", ("model.vocab_size", "data.source"), lambda c: c.config.data.source in ("builtin", "stdlib")
      and c.config.model.vocab_size < 256,
      "model.vocab_size ({model.vocab_size}) is below the 256 byte tokens of data.source={data.source}"),
    R("prompt-response", ("data.prompt_field", "data.response_field"),
      lambda c: (c.config.data.prompt_field is None) != (c.config.data.response_field is None),
      "data.prompt_field and data.response_field go together (prompt/response records)"),
    R("mixture-tokens", ("data.mixture", "data.source", "data.path"), lambda c: c.config.data.mixture is not None
      and (c.config.data.source != "tokens" or c.config.data.path is not None),
      "data.mixture: needs data.source=tokens and no data.path (the mixture names the sources)"),
    R("documents-tokens", ("data.documents", "data.source"), lambda c: c.config.data.documents
      and c.config.data.source != "tokens",
      "data.documents: needs data.source=tokens (documents of a prepare-data directory)"),
    R("first-fit-documents", ("data.packing", "data.documents"), lambda c: c.config.data.packing == "first_fit"
      and not c.config.data.documents,
      "data.packing=first_fit: needs data.documents=true (the packed documents kept apart)"),
    R("tokens-path", ("data.path", "data.source"), lambda c: c.config.data.source == "tokens"
      and not c.config.data.path and not c.config.data.mixture,
      "data.path: required with data.source=tokens (a directory from jaxscale prepare-data)"),
    # -- the batch and the pipeline's settings
    R("batch-microbatches", ("train.global_batch", "train.microbatches"), lambda c: c.config.train.microbatches > 0
      and c.config.train.global_batch % c.config.train.microbatches > 0,
      "train.global_batch ({train.global_batch}) is not divisible by train.microbatches ({train.microbatches})"),
    R("repeats-schedule", ("pipeline.repeats", "pipeline.schedule"), lambda c: c.config.pipeline.schedule
      not in INTERLEAVED and c.config.pipeline.repeats != 1,
      "pipeline.repeats ({pipeline.repeats}) needs pipeline.schedule=circular or interleaved_1f1b "
      "({pipeline.schedule} runs each stage's layers once)"),
    R("schedule-repeats", ("pipeline.schedule", "pipeline.repeats"), lambda c: c.config.pipeline.schedule
      in INTERLEAVED and c.config.pipeline.repeats < 2,
      "pipeline.schedule={pipeline.schedule} needs pipeline.repeats >= 2 (with 1 it is gpipe or 1f1b)"),
    # -- precision
    R("fused-fp8", ("model.fused_projections", "precision.fp8"), lambda c: c.config.model.fused_projections
      and c.config.precision.fp8 != "off",
      "model.fused_projections: not supported with precision.fp8 (fp8 scales each projection)"),
    R("fp8-head-off", ("precision.fp8_head", "precision.fp8"), lambda c: c.config.precision.fp8_head
      and c.config.precision.fp8 == "off",
      "precision.fp8_head needs precision.fp8 on (delayed, current, blockwise, mxfp8 or nvfp4)"),
    R("fp8-head-loss-chunk", ("precision.fp8_head", "model.loss_chunk"), lambda c: c.config.precision.fp8_head
      and c.config.model.loss_chunk > 0,
      "precision.fp8_head: not supported with model.loss_chunk (it reads the head in bf16)"),
    R("blockwise-dims", ("precision.fp8", "precision.fp8_block"), lambda c: _blockwise(c)
      and c.blockwise_misfit is not None,
      "precision.fp8=blockwise: {blockwise_misfit[0]} ({blockwise_misfit[1]}) is not divisible by "
      "precision.fp8_block ({precision.fp8_block})"),
    R("block-scaled-dims", ("precision.fp8", "model.embed"), lambda c: _block_scaled(c)
      and c.block_scaled_misfit is not None,
      "precision.fp8={precision.fp8}: {block_scaled_misfit[0]} ({block_scaled_misfit[1]}) is not a whole number of "
      "the format's {format_block}-element blocks"),
    R("nvfp4-settings", ("precision.nvfp4", "precision.fp8"), lambda c: _nvfp4_changed(c)
      and c.config.precision.fp8 != "nvfp4",
      "precision.nvfp4 (the NVFP4 recipe's parts) changed with precision.fp8={precision.fp8}: it applies to "
      "precision.fp8=nvfp4 only"),
    R("nvfp4-bf16-pipeline", ("precision.nvfp4.bf16_last", "rules"), lambda c: c.pipelined
      and stage_layers.plain_units(c.config) > 0,
      "precision.nvfp4.bf16_last={precision.nvfp4.bf16_last} keeps the stack's last units in bf16, not yet inside "
      "the pipeline stages of rules '{rules}' (every stage runs one program): precision.nvfp4.bf16_last=0 there",
      "layout"),
    R("master-narrower", ("precision.master", "precision.params"), lambda c: dtypes.WIDEST_FIRST.index(
        dtypes.of(c.config).master) > dtypes.WIDEST_FIRST.index(dtypes.of(c.config).compute),
      "precision.master ({precision.master}) is narrower than the compute copy precision.params "
      "({precision.params})"),
    R("offload-params-gradients", ("precision.offload_params", "rules"), lambda c: c.config.precision.offload_params
      and bool(c.gradients_apart),
      "precision.offload_params: rules '{rules}' lay the gradients of {gradients_apart} out apart from the "
      "parameters (ZeRO-2): a gradient goes to host memory in its parameter's layout, so it would be all-reduced, "
      "not reduce-scattered; rules splitting the parameters as their gradients (ZeRO-3: zero3, fsdp_tp) hold them",
      "layout"),
    R("offload-params-pipeline", ("precision.offload_params", "rules"), lambda c: c.config.precision.offload_params
      and c.pipelined,
      "precision.offload_params: rules '{rules}' run {stages} pipeline stages, whose program holds its slots' "
      "layers on the device (it fetches none from host memory); precision.offload_state moves the state there",
      "layout"),
    R("offload-stash-pipeline", ("pipeline.offload_stash", "rules"), lambda c: c.config.pipeline.offload_stash
      and not c.pipelined,
      "pipeline.offload_stash: rules '{rules}' on this mesh run no pipeline (layers on 'stage' of size > 1), so "
      "there is no stage stash; model.remat_offload or offload_dots move a layer scan's activations", "layout"),
    # -- what mesh.axis_types: explicit does not serve yet (its code leaves layouts jax's rules cannot decide)
    R("explicit-pipeline", ("mesh.axis_types", "rules"), lambda c: _explicit(c) and c.pipelined,
      "mesh.axis_types=explicit with rules '{rules}' (layers on stage: {stages} pipeline stages): not served yet, "
      f"the pipeline's stage loop is a shard_map laid out for auto axes; {AUTO}", "layout"),
    R("explicit-context", ("mesh.axis_types", "rules"), lambda c: _explicit(c) and bool(c.layout.context_axes),
      "mesh.axis_types=explicit with rules '{rules}' (context parallelism: length on {context_split}): not served "
      f"yet, attention over a split sequence leaves its layouts to the partitioner; {AUTO}", "layout"),
    R("explicit-moe", ("mesh.axis_types", "model.moe"), lambda c: _explicit(c) and _moe(c) is not None,
      "mesh.axis_types=explicit with model.moe: not served yet, the routing and the experts' exchange leave their "
      f"layouts to the partitioner; {AUTO}", "layout"),
    R("explicit-fp8", ("mesh.axis_types", "precision.fp8"), lambda c: _explicit(c)
      and c.config.precision.fp8 != "off",
      "mesh.axis_types=explicit with precision.fp8={precision.fp8}: not served yet, fp8 matmuls state no output "
      f"layout; {AUTO}, or precision.fp8=off", "layout"),
    # -- the rules table on the mesh
    R("blockwise-tp-overlap", ("precision.fp8", "model.tp_overlap", "precision.fp8_block"), lambda c: _blockwise(c)
      and c.config.model.tp_overlap and c.tp_chunk % c.config.precision.fp8_block > 0,
      "precision.fp8=blockwise with model.tp_overlap: each device's part of the sequence ({tp_chunk} tokens under "
      "rules '{rules}') must be a multiple of precision.fp8_block ({precision.fp8_block}): the ring passes whole "
      "tiles", "layout"),
    # Collective matmuls are shard_maps of their own: XLA (Shardy and GSPMD alike) cannot lower them nested in the
    # pipeline's partly manual loop (SP and explicit experts write their collectives in the loop's manual axes).
    R("qk-clip-pipeline", ("train.qk_clip", "rules"), lambda c: _qk_clip(c) and c.pipelined,
      "train.qk_clip with rules '{rules}' (layers on stage: {stages} pipeline stages): not served yet, the "
      "pipeline's stage program carries no per-head attention logits out of its loop", "layout"),
    R("pipeline-tp-overlap", ("rules", "model.tp_overlap"), lambda c: c.pipelined and c.config.model.tp_overlap,
      "rules '{rules}': model.tp_overlap (collective matmuls) inside a pipeline stage nests a shard_map in the "
      "pipeline's partly manual loop, which XLA cannot lower yet; sequence parallelism without it runs there "
      "(model.tp_overlap=false)", "layout"),
    R("pipeline-context-moe", ("rules", "model.moe"), lambda c: bool(c.context) and _moe(c) is not None,
      "rules '{rules}': context parallelism (length on {context}) inside a pipeline stage needs a dense model "
      "(model.moe: null): the loop is manual over the context axes, and an MoE layer's routing statistics span "
      "the whole microbatch", "layout"),
    R("pipeline-context-ring", ("rules", "model.attention"), lambda c: bool(c.context)
      and c.config.model.attention != "ring",
      "rules '{rules}': context parallelism (length on {context}) inside a pipeline stage needs "
      "model.attention=ring: the loop is manual over the context axes, so model.attention={model.attention} would "
      "see only each device's blocks of the sequence", "layout"),
    R("visit-fp8", ("pipeline.fsdp", "precision.fp8"), lambda c: c.pipelined and c.config.pipeline.fsdp == "visit"
      and c.config.precision.fp8 in ("delayed", "current"),
      "pipeline.fsdp=visit: not supported with precision.fp8={precision.fp8} (the e4m3 copies are made once a step "
      "of whole weights): pipeline.fsdp=step or tick, or precision.fp8=blockwise", "layout"),
    R("stage-experts-manual", ("rules", "model.moe.impl", "pipeline.fsdp"), lambda c: _stage_explicit_experts(c)
      and bool(c.experts_free), STAGE_EXPERTS, "layout"),
    R("stage-experts-fp8", ("rules", "precision.fp8", "model.moe.impl"), lambda c: _stage_explicit_experts(c)
      and c.config.precision.fp8 != "off",
      "rules '{rules}': precision.fp8={precision.fp8} with model.moe.impl=shard_map inside a pipeline stage is not "
      "supported (the experts' scales are not split with them there); model.moe.impl=partitioner runs fp8 "
      "experts in a stage", "layout"),
    R("layers-per-stage-pipeline", ("pipeline.layers_per_stage", "rules"), lambda c: c.listed > 0
      and not c.pipelined,
      "pipeline.layers_per_stage: rules '{rules}' on this mesh run no pipeline (layers on 'stage' of size > 1)",
      "layout"),
    R("layers-per-stage-count", ("pipeline.layers_per_stage", "mesh.stage", "pipeline.repeats"),
      lambda c: c.listed > 0 and c.pipelined and c.listed != c.virtual,
      "pipeline.layers_per_stage has {entries}; it needs one per virtual stage, mesh.stage ({stages}) x "
      "pipeline.repeats ({pipeline.repeats}) = {virtual}", "layout"),
    R("stage-slots", ("model.layers", "mesh.stage", "pipeline.repeats"), lambda c: c.pipelined and not c.listed
      and stage_layers.stack_size(c.config) % c.virtual > 0,
      "{stacked} is not divisible by mesh.stage ({stages}) x pipeline.repeats ({pipeline.repeats}); "
      "pipeline.layers_per_stage splits them unevenly", "layout"),
    R("microbatches-stages", ("pipeline.microbatches", "mesh.stage"), lambda c: c.pipelined
      and c.microbatches < c.stages,
      "pipeline.microbatches ({microbatches}) is fewer than the {stages} pipeline stages (mesh.stage)", "layout"),
    R("interleaved-groups", ("pipeline.schedule", "pipeline.microbatches", "mesh.stage"), lambda c: c.pipelined
      and c.config.pipeline.schedule == "interleaved_1f1b" and c.microbatches % c.stages > 0,
      "pipeline.schedule=interleaved_1f1b sends microbatches in groups of mesh.stage ({stages}): "
      "pipeline.microbatches ({microbatches}) must be a multiple of it", "layout"),
    R("pipeline-rows", ("train.global_batch", "train.microbatches", "pipeline.microbatches"), lambda c: c.pipelined
      and c.rows % c.microbatches > 0,
      "the batch of {rows} sequences (train.global_batch / train.microbatches) is not divisible by "
      "pipeline.microbatches ({microbatches})", "layout"),
    R("tp-overlap-sequence", ("model.tp_overlap", "rules", "mesh.tensor"), lambda c: c.config.model.tp_overlap
      and not c.layout.sequence_axes,
      "model.tp_overlap needs sequence parallelism: rules '{rules}' shard norm_length over no mesh axis of size > 1 "
      "that does not shard length (use tp_sp or fsdp_tp_sp with mesh.tensor > 1, or model.tp_overlap=false)",
      "layout"),
    R("ulysses-mesh-axis", ("mesh.ulysses", "rules"), lambda c: c.layout.mesh.get("ulysses", 1) > 1
      and "ulysses" not in c.layout.ulysses_axes,
      "mesh.ulysses ({mesh.ulysses}) is the all-to-all part of context parallelism: rules '{rules}' must map length "
      "and ulysses to it (rules usp), or mesh.ulysses=1", "layout"),
    R("ulysses-unmapped", ("rules", "mesh.expert"), lambda c: bool(c.layout.axes_of("ulysses")) and bool(c.unmapped),
      "rules '{rules}' map nothing to mesh axes {unmapped} of size > 1 (each of their devices would repeat the "
      "others' work): USP's all-to-all part is mesh.ulysses (it was mesh.expert before), mesh.expert splits experts",
      "layout"),
    R("ring-chunks", ("train.seq_len", "model.attention", "rules"), lambda c: c.config.model.attention == "ring"
      and c.layout.ring_size > 1 and not c.ring_divides,
      "train.seq_len ({train.seq_len}) is not divisible by {ring_chunks}: causal ring attention over {ring_axes} cuts "
      "it into 2 x {ring} chunks (model.attention=ring under rules '{rules}')", "layout"),
    R("attention-block", ("model.attention_block", "train.seq_len"), lambda c: c.config.model.attention
      in ("blockwise", "ring") and c.ring_divides and c.ring_chunk % min(c.config.model.attention_block,
                                                                        c.ring_chunk) > 0,
      "model.attention_block ({model.attention_block}) does not divide the {ring_chunk}-token chunks of "
      "train.seq_len ({train.seq_len})", "layout"),
    # -- the model's parts
    R("pipeline-fp8-outside", ("rules", "precision.fp8"), lambda c: c.pipelined and c.config.precision.fp8 != "off"
      and bool({"prefix", "ahead"} & c.parts),
      "rules '{rules}' (layers on stage: {stages} pipeline stages): precision.fp8={precision.fp8} with model "
      "{model_name}'s prefix or ahead, which run outside the pipeline's stack: the loop keeps fp8 amax histories "
      "for the stack only", "model"),
    # -- checkpoints
    R("continuous-async", ("checkpoint.continuous", "checkpoint.async_save"), lambda c: c.config.checkpoint.continuous
      and not c.config.checkpoint.async_save, "checkpoint.continuous needs checkpoint.async_save: true (a "
      "synchronous save every step would hold the devices up)"),
    R("fast-dir-continuous", ("checkpoint.fast_dir", "checkpoint.continuous"), lambda c: c.config.checkpoint.fast_dir
      is not None and not c.config.checkpoint.continuous, "checkpoint.fast_dir holds the continuous saves: set "
      "checkpoint.continuous: true"),
    R("interval-continuous", ("checkpoint.continuous_interval_s", "checkpoint.continuous"), lambda c:
      bool(c.config.checkpoint.continuous_interval_s) and not c.config.checkpoint.continuous,
      "checkpoint.continuous_interval_s spaces the continuous saves: set checkpoint.continuous: true"),
    R("fast-dir-dir", ("checkpoint.fast_dir", "checkpoint.dir"), lambda c: c.config.checkpoint.fast_dir is not None
      and Path(c.config.checkpoint.fast_dir).absolute() == c.checkpoint_dir,
      "checkpoint.fast_dir is checkpoint.dir ({checkpoint_dir}): give another directory"),
)


def check(context: Context, needs: tuple[Needs, ...] | None = None, about: str = "") -> None:
    """Raise the one line of the first rule ``context`` breaks, among those of the stages ``needs`` (default:
    every stage up to the context's own, e.g. config and layout rules when it has the layout) that name a
    setting starting with ``about`` (``model.``: the rows a model's constructor checks)."""
    stages = needs or STAGES[: STAGES.index(context.needs) + 1]
    for rule in RULES:
        named = any(key.startswith(about) for key in rule.keys)
        if rule.needs in stages and named and rule.broken(context):
            raise ConfigError(rule.message(context))


def by_name(name: str) -> Refusal:
    """The row called ``name``."""
    return next(rule for rule in RULES if rule.name == name)


__all__ = ["AUTO", "RULES", "SECTIONS", "STAGE_EXPERTS", "Context", "Refusal", "by_name", "check"]
