"""A layout as data: mesh sizes, ZeRO stage, remat and batch split (:class:`Strategy`), and what runs it.

:func:`rules_for` writes a strategy's rules table (starting from ``configs/rules/dp.yaml``, so every
logical name the model uses is present), :func:`placement` puts it on the strategy's mesh for the analytic
model, :func:`model_for` and :func:`step_for` give the model and step it runs, and :func:`experiment` /
:func:`write_experiment` / :func:`config_for` the experiment file ``jaxscale train`` runs.
:mod:`jaxscale.analysis.plan` searches over strategies. No jax.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxscale.analysis.params import Step
from jaxscale.config.read import (
    CONFIG_DIR,
    DEFAULT_SCHEDULE,
    MESH_AXES,
    Config,
    ModelConfig,
    PipelineConfig,
    load_config,
    read_yaml,
)
from jaxscale.layout.rules import Layout, Rules

TP_NAMES = ("heads", "kv_heads", "mlp", "vocab", "expert_mlp")
FSDP_NAMES = ("embed", "q_lora_up", "kv_lora_up")  # the parameters' dimensions ZeRO shards


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run the step: mesh sizes, ZeRO stage on ``data``, remat and the batch split."""

    data: int = 1
    fsdp: int = 1  # ZeRO-3 when > 1
    tensor: int = 1
    sequence: bool = False  # Megatron SP on the tensor axis
    tp_overlap: bool = False  # SP's collectives as collective matmuls (model.tp_overlap)
    context: int = 1
    stage: int = 1
    expert: int = 1
    zero: int = 0  # over data: 1 shards the optimizer state, 2 the gradients too
    remat: str = "none"
    micro_batch: int = 1  # sequences per data-parallel rank in one forward/backward
    accumulation: int = 1
    pipeline_microbatches: int = 1
    repeats: int = 1
    schedule: str = DEFAULT_SCHEDULE  # pipeline.schedule when stage > 1
    loss_chunk: int = 0  # > 0: chunked cross-entropy (model.loss_chunk)
    layers_per_stage: tuple[int, ...] | None = None  # uneven virtual stages (pipeline.layers_per_stage)
    fsdp_gather: str = "step"  # pipeline.fsdp: a stage's FSDP gathers once a step, per layer visit, or every tick
    ulysses: int = 1  # context parallelism's all-to-all part (mesh.ulysses); ``context`` is the ring's
    documents: str = ""  # rows packed with this corpus's documents (the ring then runs data.ring_balance), or none

    def mesh(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.mesh().values())

    @property
    def cp(self) -> int:
        """The context degree: the ring's devices times the all-to-all's (USP; either alone: ring, Ulysses)."""
        return self.context * self.ulysses

    @property
    def cp_kind(self) -> str:
        """``ring``, ``Ulysses`` or ``USP`` (both), or ``""`` without context parallelism."""
        if self.cp == 1:
            return ""
        return "USP" if self.context > 1 and self.ulysses > 1 else "Ulysses" if self.ulysses > 1 else "ring"

    @property
    def zero_stage(self) -> int:
        return 3 if self.fsdp > 1 else self.zero

    @property
    def family(self) -> str:
        """The combination of strategies, e.g. ``ZeRO-3 + TP + SP``."""
        parts = [["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"][self.zero_stage]]
        parts += ["TP + SP" if self.sequence else "TP"] if self.tensor > 1 else []
        parts += [f"CP ({self.cp_kind})" if self.ulysses > 1 else "CP"] if self.cp > 1 else []
        parts += ["PP"] if self.stage > 1 else []
        parts += ["EP"] if self.expert > 1 else []
        return " + ".join(parts)

    @property
    def mesh_text(self) -> str:
        return " ".join(f"{a}={s}" for a, s in self.mesh().items() if s > 1) or "one device"

    @property
    def strategies(self) -> int:
        """How many parallelisms and options it combines: the simpler layout wins a tie."""
        return (self.family.count("+") + self.tp_overlap + bool(self.loss_chunk)
                + (self.data > 1 and self.fsdp > 1))

    def describe(self) -> str:
        text = self.mesh_text + ("" if not self.sequence else " +sp") + (" +overlap" if self.tp_overlap else "")
        if self.zero and self.data > 1:
            text += f" zero{self.zero}"
        if self.stage > 1:
            text += f" {self.schedule} m={self.pipeline_microbatches}" + (f" v={self.repeats}" if self.repeats > 1
                                                                          else "")
            if self.layers_per_stage:
                text += f" layers {min(self.layers_per_stage)}-{max(self.layers_per_stage)}"
            if self.fsdp > 1:
                text += f" gather/{self.fsdp_gather}"
        if self.loss_chunk:
            text += f" loss_chunk={self.loss_chunk}"
        return text


def base_rules() -> dict[str, Any]:
    """The data-parallel preset: every logical name the model uses, replicated but for the batch."""
    return read_yaml(CONFIG_DIR / "rules" / "dp.yaml")["rules"]


def rules_for(layout: Strategy, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rules file (``rules``, ``optimizer``, ``gradients`` sections) that runs ``layout``."""
    rules = dict(base_rules() if base is None else base)
    batch = ["data", "fsdp"] + (["expert"] if layout.expert > 1 else [])
    rules["batch"] = batch
    if layout.fsdp > 1:  # the parameters' FSDP dimension: embed, MLA's up projections' latent input
        rules.update(dict.fromkeys(FSDP_NAMES, "fsdp"))
    if layout.tensor > 1:
        for name in TP_NAMES:
            if name in rules:
                rules[name] = "tensor"
    length = [a for a in ("context", "ulysses") if getattr(layout, a) > 1]  # the ring's axis, then the a2a's
    norm = length + (["tensor"] if layout.sequence else [])
    rules["norm_length"] = norm[0] if len(norm) == 1 else norm or None
    if length:
        rules["length"] = length[0] if len(length) == 1 else length
    if layout.ulysses > 1:
        rules["ulysses"] = "ulysses"
    if layout.stage > 1:
        rules["layers"] = "stage"
    if layout.expert > 1 and "expert" in rules:
        rules["expert"] = "expert"
    out: dict[str, Any] = {"rules": rules}
    if layout.zero >= 1 and layout.data > 1:
        out["optimizer"] = {name: ["data", "fsdp"] for name in FSDP_NAMES}
    if layout.zero >= 2 and layout.data > 1:
        out["gradients"] = {name: ["data", "fsdp"] for name in FSDP_NAMES}
    return out


def placement(layout: Strategy, base: dict[str, Any] | None = None) -> Layout:
    """The rules table of ``layout`` on its mesh sizes: what the analytic model and the runtime both ask."""
    return Layout(Rules.from_dict(layout.family, rules_for(layout, base)), layout.mesh(),
                  pipeline=PipelineConfig(fsdp=layout.fsdp_gather))


def model_for(m: ModelConfig, layout: Strategy) -> ModelConfig:
    """The model config the layout runs: its remat policy; ring attention under context parallelism."""
    out = copy.copy(m)
    out.remat = layout.remat
    out.tp_overlap = layout.tp_overlap
    if layout.loss_chunk:
        out.loss_chunk = layout.loss_chunk
    if layout.cp > 1:
        out.attention = context_kernel(m.attention, layout)
    return out


def context_kernel(attention: str, layout: Strategy) -> str:
    """The attention kernel under context parallelism: the ring's (ring, USP), or under Ulysses alone the model's
    fused kernel on whole sequences (``cudnn`` if planned so, else ``blockwise``: no s x s scores)."""
    if layout.context > 1:
        return "ring"
    return "cudnn" if attention == "cudnn" else "blockwise"


def step_for(layout: Strategy, seq_len: int) -> Step:
    rows = layout.micro_batch * layout.pipeline_microbatches * layout.accumulation
    return Step(rows * layout.data * layout.fsdp * layout.expert, seq_len, layout.accumulation,
                layout.pipeline_microbatches, layout.repeats, layout.schedule,
                layers_per_stage=layout.layers_per_stage, documents=layout.documents,
                ring_balance=bool(layout.documents) and layout.context > 1)


def experiment(layout: Strategy, model: dict[str, Any], seq_len: int, rules_path: str) -> dict[str, Any]:
    """The experiment ``jaxscale train`` runs for ``layout``: the model inline, the rules file by path."""
    overrides: dict[str, Any] = {"remat": layout.remat}
    if layout.tp_overlap:
        overrides["tp_overlap"] = True
    if layout.loss_chunk:
        overrides["loss_chunk"] = layout.loss_chunk
    if layout.cp > 1:
        overrides["attention"] = context_kernel(model.get("attention", "dot"), layout)
    out: dict[str, Any] = {
        "run_dir": "runs/plan",
        "rules": rules_path,
        "model": {**model, **overrides},
        "mesh": layout.mesh(),
        "train": {
            "global_batch": layout.micro_batch * layout.pipeline_microbatches * layout.accumulation
            * layout.data * layout.fsdp * layout.expert,
            "seq_len": seq_len,
            "microbatches": layout.accumulation,
        },
    }
    if layout.documents:
        out["data"] = {"documents": True, "ring_balance": layout.context > 1}
    if layout.stage > 1:
        out["pipeline"] = {
            "microbatches": layout.pipeline_microbatches,
            "repeats": layout.repeats,
            "schedule": layout.schedule,
        }
        if layout.layers_per_stage:
            out["pipeline"]["layers_per_stage"] = list(layout.layers_per_stage)
        if layout.fsdp > 1:
            out["pipeline"]["fsdp"] = layout.fsdp_gather
    return out


def write_experiment(layout: Strategy, model: dict[str, Any], seq_len: int, path: str | Path) -> tuple[Path, Path]:
    """Write ``path`` (the experiment) and ``<stem>.rules.yaml`` next to it; returns both paths."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rules_path = path.with_name(path.stem + ".rules.yaml")
    header = f"# {layout.family}: {layout.describe()}, remat {layout.remat}; written by jaxscale plan\n"
    rules_path.write_text(header + yaml.safe_dump(rules_for(layout), sort_keys=False))
    exp = experiment(layout, model, seq_len, rules_path.name)  # relative to the experiment file
    path.write_text(header + yaml.safe_dump(exp, sort_keys=False))
    return path, rules_path


def config_for(layout: Strategy, model: dict[str, Any], seq_len: int, overrides: Sequence[str] = ()) -> Config:
    """The experiment of ``layout`` as a :class:`Config` (its rules written to a temporary file)."""
    directory = Path(tempfile.mkdtemp(prefix="jaxscale-plan-"))
    path, _ = write_experiment(layout, model, seq_len, directory / "experiment.yaml")
    return load_config(path, [f"run_dir={directory / 'run'}", *overrides])
