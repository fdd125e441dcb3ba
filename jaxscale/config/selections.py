"""The silent selections: where jaxscale picks among ways to run a config without saying so in an error (no jax).

Beside the refusals (:mod:`jaxscale.config.refusals`), each :class:`Selection` is one row: the settings it
reads, what it picks and when (``docs/compatibility.md`` prints both tables), and the line ``jaxscale inspect``
prints when a built trainer took it (:func:`taken`). :func:`wide_grads` is the one predicate the trainer reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxscale.config import dtypes
from jaxscale.config.schema import Config


@dataclasses.dataclass(frozen=True)
class Facts:
    """A built trainer's choices: the config as asked (``model.attention`` or ``model.remat`` may be ``auto``),
    the config it runs (resolved), its rules table on the mesh (a :class:`jaxscale.layout.rules.Layout`), and
    whether its model is the built-in one."""

    asked: Config
    config: Config
    layout: Any
    builtin: bool


def takes_wide(config: Config) -> bool:
    """Whether the weight gradients are wider than ``model.dtype`` (``precision.grads_reduce``) with the compute
    copy in ``model.dtype`` (:func:`jaxscale.precision.policy.takes_wide`)."""
    d = dtypes.of(config)
    return d.weight_grads is not None and d.compute == config.model.dtype


def wide_grads(config: Config, layout: Any, builtin: bool) -> bool:
    """Whether the step differentiates the fp32 master, not the compute copy (its cast): a master apart from the
    compute copy, weight gradients wider than ``model.dtype`` (``precision.grads_reduce``) with the compute copy in
    ``model.dtype``, the built-in model, no axis splitting the tokens, no sequence parallelism, no pipeline and no
    fp8, and neither copy in host memory (:attr:`jaxscale.training.trainer.Trainer.wide_grads`)."""
    p = config.precision
    if not (dtypes.of(config).two_copies and takes_wide(config) and builtin) or p.offload_params or p.offload_state:
        return False
    return not (layout.token_axes or layout.sequence_axes or layout.pipelined or config.precision.fp8 != "off")


@dataclasses.dataclass(frozen=True)
class Selection:
    """One silent choice: the settings it reads, what it picks when (``rule``), and the line of the choice a
    trainer took (``taken``: None where it did not apply)."""

    name: str
    keys: tuple[str, ...]
    rule: str
    taken: Callable[[Facts], str | None]


def _attention(f: Facts) -> str | None:
    kernel = f.config.model.attention
    return f"model.attention: auto -> {kernel}" if f.asked.model.attention == "auto" else None


def _remat(f: Facts) -> str | None:
    return f"model.remat: auto -> {f.config.model.remat}" if f.asked.model.remat == "auto" else None


def _stage_remat(f: Facts) -> str | None:
    remat = f.config.model.remat
    if not f.layout.pipelined or remat == "none":
        return None
    return f"model.remat={remat}: not applied inside the pipeline's stages (each layer runs forward twice there)"


def _wide(f: Facts) -> str | None:
    if not wide_grads(f.config, f.layout, f.builtin):
        return None
    return (f"wide gradients: the step differentiates the {dtypes.of(f.config).master} master "
            f"(precision.grads_reduce={f.config.precision.grads_reduce}), not the {f.config.model.dtype} copy")


SELECTIONS: tuple[Selection, ...] = (
    Selection("attention-auto", ("model.attention", "rules", "data.documents", "model.dtype", "model.head_dim",
                                 "train.seq_len", "train.qk_clip"),
              "`model.attention: auto` is one of four kernels, chosen once at build: `ring` when the rules split "
              "the sequence; else `cudnn` on GPU with a bf16/fp16 `model.dtype`, a `model.head_dim` cuDNN takes "
              "and neither `data.documents` nor `train.qk_clip`; else `blockwise` above 4 `model.attention_block` "
              "tiles of `train.seq_len`; else `dot`", _attention),
    Selection("remat-auto", ("model.remat", "mesh", "rules"),
              "`model.remat: auto` is the least recomputation whose predicted peak fits the device "
              "(`jaxscale/analysis/remat.py`), chosen before the trainer is built", _remat),
    Selection("remat-in-stage", ("model.remat", "rules"),
              "inside a pipeline stage `model.remat` is not applied: each layer runs forward twice already (the "
              "forward slot, then the backward slot's `vjp`), so no layer is recomputed twice", _stage_remat),
    Selection("wide-grads", ("precision.master", "precision.params", "precision.grads_reduce", "model.dtype",
                             "precision.fp8", "precision.offload_params", "precision.offload_state", "rules"),
              "the step differentiates the fp32 master instead of the compute copy when six things hold: a "
              "master apart from the compute copy, `precision.grads_reduce` wider than `model.dtype` with the "
              "compute copy in `model.dtype`, the built-in model, no pipeline, sequence parallelism or axis "
              "splitting the tokens, `precision.fp8: off`, and neither copy in host memory "
              "(`precision.offload_params`, `precision.offload_state`)", _wide),
)


def taken(facts: Facts) -> list[str]:
    """The lines of the selections a built trainer took."""
    return [line for line in (s.taken(facts) for s in SELECTIONS) if line is not None]
