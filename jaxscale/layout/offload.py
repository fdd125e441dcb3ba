"""Host memory as a tier: named activations, and the optimizer's state with the master, kept in host memory.

**Activations** (``model.remat: save_named``): each ``checkpoint_name`` of a layer is recomputed in the
backward, kept on the device (``model.remat_names``) or offloaded to host memory (``model.remat_offload``):
:func:`remat_policy`, jax's ``save_and_offload_only_these_names``. ``model.remat: offload_dots`` offloads what
``save_dots`` keeps, the weight matmuls' outputs (:func:`dots_policy`, MaxText's ``minimal_offloaded``).
The forward writes an offloaded activation into a host buffer of all the layers (the scan's stacked
residual, ``pinned_host``); the backward reads each layer's slice back. On XLA:GPU and TPU the writes and
reads are asynchronous copies (``dynamic-update-slice-start``/``dynamic-slice-start`` on ``S(5)`` buffers)
that the scheduler overlaps with the layers' compute; the device keeps B·(width)·tokens bytes per layer less
for each offloaded name. XLA:CPU has one memory for all three kinds: the program compiles and computes the
same values, with no copy. A move changes no value, so an offloaded run equals the run keeping the same
names on the device exactly.

**Optimizer state and master** (``precision.offload_state``): Adam's moments and the fp32 master (its
optimizer's leaves, laid out by the rules table's ``optimizer`` rules, ZeRO's shards unchanged) live in
``pinned_host`` memory between steps: the step's arguments and results in host memory (:func:`on_host`). The
update runs on the device: :func:`fetch` brings the state to the device after the backward, the update reads
it there at the device's memory bandwidth (the host would run Adam at the host's, a step's time over again),
and :func:`store` puts the new state back. XLA schedules each leaf's copy on its own, so a leaf's update
overlaps the next leaf's transfer; the device holds the state only while the update runs, after the
backward has freed the activations. The device's arguments shrink by the state's bytes
(:func:`argument_bytes` reads them from the compiled program).

**Parameters** (``precision.offload_params``): the compute copy lives in ``pinned_host`` memory between steps,
laid out by the parameter rules (under ZeRO-3 each device's shard). The parameters outside the layer stack
(embedding, head, final norm) come to the device whole at the top of the objective (:func:`fetch_outside`); the
model's layer scan brings each layer's shard to the device inside the scan's body (:func:`to_device`), where
the all-gather reads it, so the device holds a layer or two of weights at a time. The layer's remat policy
never saves a fetched weight (:func:`fetching`): the backward fetches the layer again. The transpose of a
fetch is a store: each layer's gradient, reduce-scattered on the device as ever, is written to host memory in
the backward, and the step brings the gradients back for the update, which runs on the device and stores the
new parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxscale.layout.rules import is_axes

HOST = "pinned_host"
DEVICE = "device"


def remat_policy(saved: Sequence[str], offloaded: Sequence[str]) -> Callable:
    """The ``jax.checkpoint`` policy keeping the ``saved`` names on the device, moving the ``offloaded``
    names to host memory, and recomputing every other value."""
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
        offload_src=DEVICE, offload_dst=HOST,
    )


def dots_policy(weight_dot: str) -> Callable:
    """``model.remat: offload_dots``: what ``save_dots`` keeps (the outputs of the matmuls without batch
    dimensions and the projections named ``weight_dot``) moved to host memory; the rest recomputed."""
    dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims(DEVICE, HOST)
    named = remat_policy([], [weight_dot])
    recompute = dots(None)  # what a policy answers for a value it neither saves nor offloads

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        out = dots(prim, *args, **params)
        return out if out is not recompute else named(prim, *args, **params)

    return policy


def to_device(tree: Any) -> Any:
    """Inside a trace: ``tree`` (in host memory) moved to device memory, each leaf's layout kept."""
    return jax.device_put(tree, jax.memory.Space.Device)


def layer_to_device(layer: nnx.Module) -> nnx.Module:
    """Inside a layer scan's body: the layer (its slice of the stack, in host memory) on the device."""
    graphdef, state = nnx.split(layer)
    return nnx.merge(graphdef, to_device(state))


def fetch_outside(params: Any, axes: Any, stacked: str = "layers") -> Any:
    """Inside a trace: the parameters whose logical ``axes`` do not name the ``stacked`` axis moved to device
    memory; the stack's stay in host memory for the layer scan to fetch layer by layer."""
    return jax.tree.map(lambda a, x: x if stacked in a else to_device(x), axes, params,
                        is_leaf=is_axes)


def fetching(policy: Callable | None) -> Callable:
    """A layer's remat ``policy`` (None: everything saved) that never saves a weight fetched from host memory
    (:func:`to_device`): the backward fetches it again rather than keep every layer's weights on the device."""

    def fetched(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "device_put":
            return False
        return True if policy is None else policy(prim, *args, **params)

    return fetched


def _in(shardings: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def on_host(shardings: Any) -> Any:
    """``shardings`` (a tree of :class:`NamedSharding`) in host memory: the same layouts, ``pinned_host``."""
    return _in(shardings, HOST)


def fetch(tree: Any, shardings: Any) -> Any:
    """Inside a trace: ``tree`` (held in host memory) moved to the device, laid out as ``shardings``."""
    return jax.device_put(tree, _in(shardings, DEVICE))


def store(tree: Any, shardings: Any) -> Any:
    """Inside a trace: ``tree`` moved to host memory, laid out as ``shardings``."""
    return jax.device_put(tree, on_host(shardings))


def argument_bytes(hlo: str) -> dict[str, int]:
    """The bytes of a compiled program's arguments per memory, per device, from its text's
    ``entry_computation_layout``: ``host`` those laid out in memory space 5 (``S(5)``, host memory), ``device``
    the rest. (XLA:CPU's ``memory_analysis`` counts both as arguments.)"""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo)
    if layout is None:
        raise ValueError("no entry_computation_layout in the program's text")
    out = {"device": 0, "host": 0}
    for dtype, dims, tiling in re.findall(r"(\w+)\[([\d,]*)\](\{[^}]*\})?", layout.group(1)):
        size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
        out["host" if ":S(5)" in tiling else "device"] += size
    return out


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
