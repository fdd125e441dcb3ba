"""The analytic model's one entry point: memory, collectives and time of a layout, without compiling.

:func:`predict` runs :func:`jaxscale.analysis.memory.memory`,
:func:`jaxscale.analysis.communication.communication` and, given a cluster,
:func:`jaxscale.analysis.timing.step_time` on the same inputs; :func:`predict_trainer` reads those
inputs (parameters, placement, step) off a built :class:`jaxscale.training.trainer.Trainer`
(:func:`jaxscale.analysis.params.trainer_inputs`), so what ``jaxscale inspect`` compiles and
what it predicts describe the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxscale.analysis import host_state
from jaxscale.analysis.cluster import Cluster
from jaxscale.analysis.communication import EP_IMBALANCE, communication
from jaxscale.analysis.flows import Flow, summarize_flows
from jaxscale.analysis.memory import memory, stash
from jaxscale.analysis.params import Param, Step, trainer_inputs
from jaxscale.analysis.timing import step_time
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import Layout


@dataclasses.dataclass
class Prediction:
    """Memory (bytes per device), collectives and, given a cluster, time of one layout."""

    memory: dict[str, float]
    flows: list[Flow]
    time: dict[str, float] | None = None

    @property
    def comm(self) -> dict[str, Any]:
        return summarize_flows(self.flows)


def predict(
    m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step, cluster: Cluster | None = None
) -> Prediction:
    imbalance = cluster.ep_imbalance if cluster is not None else EP_IMBALANCE
    flows = communication(m, params, layout, step, imbalance)
    time = step_time(m, flows, layout, step, cluster, params) if cluster is not None else None
    return Prediction(memory(m, params, layout, step), flows, time)


def predict_trainer(trainer: Any, cluster: Cluster | None = None) -> Prediction:
    """The prediction for a built :class:`jaxscale.training.trainer.Trainer`; ``precision.offload_state`` and
    ``precision.offload_params``: their bytes in host memory and, over the cluster's host link, their transfers'
    seconds; ``pipeline.offload_stash``: the stage's stash in host memory (:mod:`jaxscale.analysis.host_state`)."""
    prediction = predict(trainer.config.model, *trainer_inputs(trainer), cluster)
    p = trainer.config.precision
    on_device = prediction.memory
    if p.offload_state:
        prediction.memory = host_state.state_on_host(prediction.memory)
    if p.offload_params:
        prediction.memory = host_state.params_on_host(prediction.memory)
    model, layout, step = trainer.config.model, *trainer_inputs(trainer)[1:]
    if trainer.config.pipeline.offload_stash and layout.pipelined:
        prediction.memory = host_state.stash_on_host(prediction.memory, stash(model, layout, step))
    if prediction.time is not None and (p.offload_state or p.offload_params):
        seconds = host_state.transfer_seconds(on_device, prediction.time, cluster, p.offload_state, p.offload_params)
        prediction.time = host_state.with_transfers(prediction.time, seconds)
    return prediction
