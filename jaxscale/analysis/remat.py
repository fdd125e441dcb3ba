"""``model.remat: auto``: the recomputation policy chosen by the predicted memory.

The rule: the least recomputation whose predicted peak per device fits the device's usable memory, in the
order ``none`` (nothing recomputed, fastest), ``save_dots`` (the weight matmuls' outputs kept, norms,
attention and SwiGLU recomputed: 262 vs 289 ms for ``full`` on llama-1b, one H100), ``full`` (the layer
input only). The peak is the planner's (:func:`jaxscale.analysis.memory.memory`'s ``total``: model state,
activations, the backward's transient), the usable memory the device's ``bytes_limit`` times the
planner's ``usable_memory`` (0.9, :class:`jaxscale.analysis.cluster.Cluster`). ``full`` is taken when
nothing fits (the step then fails as it would have). Given a cluster that names its host link
(``host_bandwidth``), ``offload_dots`` stands before ``full``: it keeps on the device what ``full`` keeps (its
backward's peak is lower: it recomputes ``save_dots``' part of a layer, not the whole), and is taken where it fits
and ``full`` does not, or where the planner's step time for it (``save_dots``' recomputation plus the transfers
the compute does not hide, :mod:`jaxscale.analysis.host_link`) is shorter than ``full``'s (the ``jaxscale train``
and ``inspect`` commands take the cluster file as ``--cluster``). Under pipeline parallelism a stage applies no
layer remat (its backward recomputes each chunk once, as the planner has it): ``none``. A device that
reports no memory limit (XLA:CPU) takes ``none``; ``inspect --target`` reads the target's memory.

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
from jaxscale.analysis.predict import predict
from jaxscale.config.read import Config, ModelConfig
from jaxscale.layout.rules import Layout

ORDER = ("none", "save_dots", "full")  # least recomputation first
USABLE = Cluster.usable_memory  # the planner's fraction of a device's memory a step may use


def choose(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, budget: float | None,
           cluster: Cluster | None = None) -> str:
    """The first policy of :data:`ORDER` whose predicted peak per device is within ``budget`` bytes; where
    ``cluster`` names a host link, ``offload_dots`` before ``full`` (kept where ``full`` fits and is faster)."""
    if budget is None or layout.stages > 1:
        return "none"

    def fits(policy: str) -> bool:
        return memory(dataclasses.replace(m, remat=policy), params, layout, step)["total"] <= budget

    linked = cluster is not None and cluster.host_bandwidth > 0
    for policy in ORDER[:-1] + ("offload_dots",) * linked + ORDER[-1:]:
        if fits(policy):
            if policy == "offload_dots" and fits("full") and not offload_faster(m, params, layout, step, cluster):
                return "full"
            return policy
    return ORDER[-1]


def offload_faster(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, cluster: Cluster) -> bool:
    """Whether the planner's step on ``cluster`` is shorter under ``offload_dots`` than under ``full``
    (:func:`jaxscale.analysis.predict.predict`'s ``total``)."""
    seconds = {p: predict(dataclasses.replace(m, remat=p), params, layout, step, cluster).time["total"]
               for p in ("offload_dots", "full")}
    return seconds["offload_dots"] < seconds["full"]


def device_budget(device: Any) -> float | None:
    """The bytes a step may use on ``device``: its ``bytes_limit`` times :data:`USABLE`; None where unknown."""
    stats = device.memory_stats() or {}
    return stats["bytes_limit"] * USABLE if "bytes_limit" in stats else None


def resolved(config: Config, devices: Sequence[Any] | None = None, budget: float | None = None,
             cluster: Cluster | None = None) -> Config:
    """``config`` with ``model.remat: auto`` replaced by :func:`choose`'s policy for these devices (``budget``:
    the bytes per device, else the first local device's :func:`device_budget`; ``cluster``: its host link and time
    model, for ``offload_dots``); any other policy as it is."""
    if config.model.remat != "auto":
        return config
    from jaxscale.training.trainer import Trainer

    probe = dataclasses.replace(config, model=dataclasses.replace(config.model, remat="full"))
    trainer = Trainer.build(probe, devices)
    if budget is None:
        # a device of this process: another process's has no memory_stats in a multi-process run
        budget = device_budget(trainer.mesh.local_devices[0] if devices is None else devices[0])
    params, layout, step = trainer_inputs(trainer)
    policy = choose(trainer.config.model, params, layout, step, budget, cluster)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, remat=policy))
