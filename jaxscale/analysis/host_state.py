"""The compute copy and the optimizer's state in host memory (``precision.offload_params``,
``precision.offload_state``): the device memory they leave, and the seconds their transfers add to a step.

**Memory.** ``offload_state``: the master and the moments leave the device between steps; the device holds them
only for the update, after the backward has freed the activations (:func:`state_on_host`). ``offload_params``:
the compute copy leaves it; the layer scan holds a layer's shard at a time, within the layer's transient
(:func:`params_on_host`). ``pipeline.offload_stash``: a stage's stash of kept layer inputs leaves it
(:func:`stash_on_host`).

**Time**, over the cluster's ``host_bandwidth`` (bytes/s per device, each way; PCIe and C2C are full duplex),
what the compute does not hide (:func:`transfer_seconds`):

* ``offload_state``: the state comes in after the backward and goes back after the update, leaf by leaf, the
  two directions at once and each leaf's update overlapping the next leaf's transfer: one way's transfer less
  the update's time.
* ``offload_params``: each layer's shard comes in during the forward, and again during the backward while its
  gradient goes out (the other direction), each behind its pass's compute (the forward a third of the layers'
  time, the backward two thirds, as the FLOPs have it); then the gradients come back for the update while the
  new compute copy goes out, behind the update only.

Without a ``host_bandwidth`` the transfers are not costed (the memory still is).
"""

from __future__ import annotations

from jaxscale.analysis.cluster import Cluster


def state_on_host(mem: dict[str, float]) -> dict[str, float]:
    """Predicted device memory (:func:`jaxscale.analysis.memory.memory`'s parts) with the master and the
    moments in host memory (``host_state``, not in ``total``): on the device only for the update, after the
    backward has freed the activations, so the peak is the larger of the backward's (activations and their
    transient) and the update's (the state)."""
    out = dict(mem)
    held = out["master"] + out["optimizer"]
    out["master"] = out["optimizer"] = 0.0
    out["transient"] = max(out["transient"], held - out["activations"])
    out.pop("total")
    out["total"] = sum(out.values())
    out["host_state"] = held
    return out


def params_on_host(mem: dict[str, float]) -> dict[str, float]:
    """Predicted device memory with the compute copy in host memory (``host_params``, not in ``total``): the
    device holds a layer's shard at a time while the layer scan fetches it (within the layer's transient)."""
    out = dict(mem)
    out["host_params"], out["params"] = out["params"], 0.0
    out["total"] -= out["host_params"]
    return out


def stash_on_host(mem: dict[str, float], stash: float) -> dict[str, float]:
    """Predicted device memory with a pipeline stage's ``stash`` bytes (:func:`jaxscale.analysis.memory.stash`) in
    host memory (``pipeline.offload_stash``; ``host_stash``, not in ``total``)."""
    out = dict(mem)
    out["activations"] -= stash
    out["total"] -= stash
    out["host_stash"] = stash
    return out


def state_seconds(state: float, host_bandwidth: float, update: float) -> float:
    """``offload_state``'s exposed seconds: ``state`` bytes in and out around an ``update`` of that many seconds."""
    return max(0.0, state / host_bandwidth - update)


def params_seconds(params: float, grads: float, host_bandwidth: float, layers: float, update: float) -> float:
    """``offload_params``' exposed seconds: the ``params`` bytes of the compute copy's shard fetched in the forward
    and the backward of ``layers`` seconds, the ``grads`` bytes stored in the backward, both back around the
    update."""
    forward, backward = layers / 3, 2 * layers / 3
    return (max(0.0, params / host_bandwidth - forward) + max(0.0, max(params, grads) / host_bandwidth - backward)
            + max(0.0, max(params, grads) / host_bandwidth - update))


def transfer_seconds(mem: dict[str, float], time: dict[str, float], cluster: Cluster, state: bool,
                     params: bool) -> float:
    """The seconds a step's host transfers add to ``time`` (:func:`jaxscale.analysis.timing.step_time`'s), with
    ``mem`` the memory on the device (:func:`jaxscale.analysis.memory.memory`, before either offload); 0
    without a ``host_bandwidth``."""
    bw = cluster.host_bandwidth
    if bw <= 0:
        return 0.0
    update = time["optimizer"]
    out = state_seconds(mem["master"] + mem["optimizer"], bw, update) if state else 0.0
    if params:
        out += params_seconds(mem["params"], mem["params"], bw, time["compute"] - update, update)
    return out


def with_transfers(time: dict[str, float], seconds: float) -> dict[str, float]:
    """``time`` with ``seconds`` of host transfers (``host_transfers``) in its total, MFU and throughput."""
    out = dict(time, host_transfers=seconds)
    scale = time["total"] / (time["total"] + seconds)
    out["total"] = time["total"] + seconds
    out["mfu"], out["tokens_per_sec"] = time["mfu"] * scale, time["tokens_per_sec"] * scale
    return out
