"""``model.remat: offload_dots`` in the step's time: the transfers to host memory the host link cannot hide.

``offload_dots`` keeps on the device what ``full`` keeps (each layer's input) and moves what ``save_dots``
keeps besides to host memory: each layer's outputs are written to the host during the forward and read back
during the backward (:func:`offloaded_bytes`, per device and step). The backward then recomputes what
``save_dots``' does (the memory-bound forward). Each direction has its own link (PCIe and C2C are full
duplex): the writes hide behind the forward's compute, the reads behind the backward's, and what is longer
than the compute it hides behind is exposed (:func:`exposed_seconds`). The link's speed is the cluster file's
``host_bandwidth`` (bytes/s per device, one way); a cluster without one leaves offload out of the plan.

The state and the compute copy in host memory: :mod:`jaxscale.analysis.host_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import Param, Step
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import Layout


def offloaded_bytes(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step) -> float:
    """Bytes one device writes to host memory in a step under ``offload_dots`` (and reads back): the
    activations ``save_dots`` keeps less those ``full`` keeps, for each microbatch."""
    kept = {p: memory(dataclasses.replace(m, remat=p), params, layout, step)["activations"]
            for p in ("save_dots", "full")}
    return (kept["save_dots"] - kept["full"]) * step.microbatches


def exposed_seconds(nbytes: float, host_bandwidth: float, forward: float, backward: float) -> float:
    """Seconds of moving ``nbytes`` to the host during ``forward`` seconds and back during ``backward`` that
    the compute does not hide."""
    move = nbytes / host_bandwidth
    return max(0.0, move - forward) + max(0.0, move - backward)

