"""Context parallelism's collectives in the analytic step: the ring's (:mod:`jaxscale.parallel.ring_attention`)
and Ulysses' all-to-alls (:mod:`jaxscale.parallel.ulysses`), together USP's, per layer, bytes per device.

* ring over ``r`` devices (``length``'s axes but Ulysses'): the key and value blocks ``r−1`` hops forward and
  backward, their fp32 gradients ``r`` hops (the last brings them home); inside a pipeline stage all-gathered
  forward and backward, the gradients reduce-scattered.
* Ulysses over ``u`` devices: four all-to-alls forward (queries, keys, values in, the output back) and their four
  transposes backward, each on the device's ``s/c`` tokens of every local head. Kv heads fewer than ``u`` on a
  device are replicated to ``u`` before theirs (and USP's ring then passes the replicated blocks).
"""

from __future__ import annotations

from jaxscale.analysis.blocks import attention
from jaxscale.analysis.flows import Flow, flow
from jaxscale.analysis.params import dtype_bytes
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import Layout


def kv_replicas(m: ModelConfig, layout: Layout) -> int:
    """How many times Ulysses repeats each of a device's kv heads before its all-to-all (1: none)."""
    u = layout.size(layout.ulysses_axes)
    kv_name = attention(m).kv_name
    local = (m.heads if kv_name == "heads" else m.kv_heads) // layout.ways((kv_name,))
    return max(1, u // local)


def context_flows(m: ModelConfig, layout: Layout, tokens: float, runs: float, in_stage: bool) -> list[Flow]:
    """The ring's and Ulysses' flows; ``tokens`` a microbatch's on a device, ``runs`` a layer's activation
    collectives, ``in_stage``: the ring inside a pipeline stage (gathered)."""
    if not layout.context_axes:
        return []
    att, cbytes, flows = attention(m), dtype_bytes(m.dtype), []
    kv = tokens * (att.k + att.v) / layout.ways((att.kv_name,)) * kv_replicas(m, layout)
    over = layout.ulysses_axes
    heads = tokens * (att.q + att.out) / layout.ways(("heads",))
    for phase in ("forward", "backward"):
        flows += flow("CP Ulysses: queries, keys, values, output", "all-to-all", over, (heads + kv) * cbytes, runs,
                      layout, phase, False)
    return flows + _ring_flows(layout, layout.ring_axes, kv, cbytes, runs, in_stage)


def _ring_flows(layout: Layout, ring: tuple[str, ...], kv: float, cbytes: int, runs: float,
                in_stage: bool) -> list[Flow]:
    """The ring's: keys and values (``kv`` elements a device) round it each layer, their fp32 gradients home in
    c hops. Inside a pipeline stage (``in_stage``) they are all-gathered instead, forward and in the backward
    slot (whose recomputed forward shares the backward's gather), and their fp32 gradients reduce-scattered."""
    c, flows = layout.size(ring), []
    if in_stage:
        for phase in ("forward", "backward"):
            flows += flow("CP (stage): keys, values gathered", "all-gather", ring, kv * cbytes * c, runs,
                          layout, phase, True)
        return flows + flow("CP (stage): key, value gradients (fp32)", "reduce-scatter", ring, kv * 4 * c,
                            runs, layout, "backward", True)
    for phase in ("forward", "backward"):
        flows += flow("CP ring: keys, values", "collective-permute", ring, kv * cbytes, (c - 1) * runs,
                      layout, phase, True)
    return flows + flow("CP ring: key, value gradients (fp32, home in c hops)", "collective-permute", ring,
                        kv * 4, c * runs, layout, "backward", True)
