"""What a refusal's predicate and line read (no jax): the config, the rules table on the mesh sizes at build, the
model's parts at the contract check, and the values derived from them that several rows name
(:mod:`jaxscale.config.refusals`: a line's ``{microbatches}`` is :attr:`Context.microbatches`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from jaxscale.config import stage_layers
from jaxscale.config.schema import Config

Needs = Literal["config", "layout", "model"]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a predicate reads: the config, and at build the rules table on the mesh sizes (a
    :class:`jaxscale.layout.rules.Layout`), the mesh axes a pipeline stage with explicit experts would leave to the
    partitioner (``experts_free``), and, at the contract check, the model's parts and its factory's name."""

    config: Config
    layout: Any = None
    experts_free: tuple[str, ...] = ()
    parts: frozenset[str] | None = None
    model_name: str = ""

    @property
    def needs(self) -> Needs:
        """The latest stage this context can check."""
        return "model" if self.parts is not None else "layout" if self.layout is not None else "config"

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<run_dir>/checkpoints``."""
        return Path(self.config.checkpoint.dir or Path(self.config.run_dir) / "checkpoints").absolute()

    @property
    def attention_ring(self) -> int:
        """The devices of ring attention's ring (1 without ``model.attention: ring``)."""
        return self.layout.ring_size if self.config.model.attention == "ring" else 1

    @property
    def pipelined(self) -> bool:
        return bool(self.layout.pipelined)

    @property
    def stages(self) -> int:
        return int(self.layout.stages)

    @property
    def tp_chunk(self) -> int:
        """Each device's tokens of a sequence under sequence parallelism (what a collective-matmul ring passes)."""
        return self.config.train.seq_len // self.layout.ways(("norm_length",))

    @property
    def microbatches(self) -> int:
        """The pipeline's microbatches (``pipeline.microbatches``, else one per stage)."""
        return self.config.pipeline.microbatches or self.stages

    @property
    def rows(self) -> int:
        """The sequences of one accumulation step."""
        return self.config.train.global_batch // self.config.train.microbatches

    @property
    def stacked(self) -> str:
        return stage_layers.stacked_named(self.config.model)

    @property
    def virtual(self) -> int:
        """Virtual pipeline stages: mesh.stage x pipeline.repeats."""
        return self.stages * self.config.pipeline.repeats

    @property
    def listed(self) -> int:
        return len(self.config.pipeline.layers_per_stage or ())

    @property
    def listed_sum(self) -> int:
        return sum(self.config.pipeline.layers_per_stage or ())

    @property
    def free(self) -> list[str]:
        return list(self.experts_free)

    @property
    def entries(self) -> str:
        return f"{self.listed} entr{'y' if self.listed == 1 else 'ies'}"

    @property
    def context_split(self) -> list[str]:
        return list(self.layout.context_axes)

    @property
    def unmapped(self) -> list[str]:
        """The mesh axes of size > 1 that no rule of the parameters' table maps."""
        used = {axis for axes in self.layout.rules.params.values() for axis in axes}
        return [axis for axis, size in self.layout.mesh.items() if size > 1 and axis not in used]

    @property
    def per_group(self) -> int:
        return self.config.model.moe.experts // self.config.model.moe.groups

    @property
    def ring(self) -> int:
        return int(self.layout.ring_size)

    @property
    def ring_chunks(self) -> int:
        return 2 * self.ring

    @property
    def ring_axes(self) -> str:
        return " x ".join(self.layout.axes_of("length"))

    @property
    def ring_divides(self) -> bool:
        """Whether causal ring attention's chunks divide the sequence (else Layout.validate says so)."""
        ring = self.layout.ring_size if self.config.model.attention == "ring" else 1
        return self.config.train.seq_len % (2 * ring if ring > 1 else 1) == 0

    @property
    def context(self) -> list[str]:
        """The mesh axes of size > 1 that split ``length`` inside a pipeline stage."""
        return list(self.layout.mesh_axes(("length",))) if self.pipelined else []

    @property
    def ring_chunk(self) -> int:
        """The tokens of one chunk of causal ring attention (2 x ring chunks of a sequence; all of it unsplit)."""
        ring = self.layout.ring_size if self.config.model.attention == "ring" else 1
        return self.config.train.seq_len // (2 * ring if ring > 1 else 1)

    @property
    def gradients_apart(self) -> str:
        """The logical axes whose gradients the rules split over other mesh axes (of size > 1) than the
        parameters (ZeRO-2's ``gradients`` section), comma-separated; empty when none."""
        names = self.layout.rules.gradients
        return ", ".join(n for n in names if self.layout.mesh_axes((n,), "gradients") != self.layout.mesh_axes((n,)))

    @property
    def blockwise_misfit(self) -> tuple[str, int] | None:
        """The first dimension ``precision.fp8: blockwise`` tiles that ``precision.fp8_block`` does not divide."""
        return self._misfit(self.config.precision.fp8_block)

    @property
    def format_block(self) -> int:
        """The block of ``precision.fp8: mxfp8`` (32) or ``nvfp4`` (16); 1 for the other modes."""
        return {"mxfp8": 32, "nvfp4": 16}.get(self.config.precision.fp8, 1)

    @property
    def block_scaled_misfit(self) -> tuple[str, int] | None:
        """The first dimension the block-scaled formats scale in blocks that their block does not divide."""
        return self._misfit(self.format_block)

    def _misfit(self, block: int) -> tuple[str, int] | None:
        m, p = self.config.model, self.config.precision
        dims = {"model.embed": m.embed, "model.heads x model.head_dim": m.heads * m.head_dim, "model.mlp": m.mlp,
                "model.kv_heads x model.head_dim": m.kv_heads * m.head_dim, "train.seq_len": self.config.train.seq_len}
        if m.moe is not None:  # the routed experts' (and the shared experts') hidden width
            dims["model.moe.mlp"] = m.moe.mlp or m.mlp
        if p.fp8_head:
            dims["model.vocab_size"] = m.vocab_size
        return next(((name, size) for name, size in dims.items() if size % block), None)
