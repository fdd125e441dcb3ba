"""``model.remat: auto``: the recomputation policy chosen by the predicted memory.

The rule: the least recomputation whose predicted peak per device fits the device's usable memory, in the
order ``none`` (nothing recomputed, fastest), ``save_dots`` (the weight matmuls' outputs kept, norms,
attention and SwiGLU recomputed: 262 vs 289 ms for ``full`` on llama-1b, one H100), ``full`` (the layer
input only). The peak is the planner's (:func:`jaxscale.analysis.memory.memory`'s ``total``: model state,
activations, the backward's transient), the usable memory the device's ``bytes_limit`` times the
planner's ``usable_memory`` (0.9, :class:`jaxscale.analysis.cluster.Cluster`). ``full`` is taken when
nothing fits (the step then fails as it would have). Under pipeline parallelism a stage applies no
layer remat (its backward recomputes each chunk once, as the planner has it): ``none``. A device that
reports no memory limit (XLA:CPU) takes ``none``.

:func:`resolved` is applied before the trainer is built (the ``jaxscale`` command does it;
:meth:`jaxscale.training.trainer.Trainer.build` refuses ``auto``): it builds the trainer once with ``full`` to read
its parameters and layout, which no policy changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxscale.analysis.cluster import Cluster
from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import Param, Step, trainer_inputs
from jaxscale.config.read import Config, ModelConfig
from jaxscale.layout.rules import Layout

ORDER = ("none", "save_dots", "full")  # least recomputation first
USABLE = Cluster.usable_memory  # the planner's fraction of a device's memory a step may use


def choose(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, budget: float | None) -> str:
    """The first policy of :data:`ORDER` whose predicted peak per device is within ``budget`` bytes."""
    if budget is None or layout.stages > 1:
        return "none"
    for policy in ORDER:
        if memory(dataclasses.replace(m, remat=policy), params, layout, step)["total"] <= budget:
            return policy
    return ORDER[-1]


def device_budget(device: Any) -> float | None:
    """The bytes a step may use on ``device``: its ``bytes_limit`` times :data:`USABLE`; None where unknown."""
    stats = device.memory_stats() or {}
    return stats["bytes_limit"] * USABLE if "bytes_limit" in stats else None


def resolved(config: Config, devices: Sequence[Any] | None = None, budget: float | None = None) -> Config:
    """``config`` with ``model.remat: auto`` replaced by :func:`choose`'s policy for these devices (``budget``:
    the bytes per device, else the first device's :func:`device_budget`); any other policy as it is."""
    if config.model.remat != "auto":
        return config
    from jaxscale.training.trainer import Trainer

    probe = dataclasses.replace(config, model=dataclasses.replace(config.model, remat="full"))
    trainer = Trainer.build(probe, devices)
    if budget is None:
        budget = device_budget(trainer.mesh.devices.flat[0] if devices is None else devices[0])
    params, layout, step = trainer_inputs(trainer)
    policy = choose(trainer.config.model, params, layout, step, budget)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, remat=policy))
