"""The dtypes of a run, resolved once from ``precision.*`` and ``model.*`` (no jax).

Config validation, the trainer (:mod:`jaxscale.precision.policy`), the analytic memory model and the
communication model all read them from :func:`resolve`:

- ``compute``: the compute copy the model runs with, ``precision.params`` (auto: ``model.dtype``);
  what ZeRO-3/FSDP gathers and what ZeRO-1/2 re-gather after the update;
- ``master``: the weights the optimizer updates, ``precision.master`` (auto: ``model.param_dtype``);
- ``reduce``: ``precision.grads_reduce``, the gradient sums' and the microbatch accumulator's dtype;
- ``activations``: ``model.dtype``, the dtype the layers' matmuls produce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WIDEST_FIRST = ("float32", "bfloat16", "float16")  # bfloat16 before float16: its range is float32's


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """A run's dtypes, by name (``float32``, ``bfloat16``, ``float16``)."""

    compute: str
    master: str
    reduce: str
    activations: str

    @property
    def two_copies(self) -> bool:
        """Whether the state holds a master apart from the compute copy."""
        return self.compute != self.master

    @property
    def weight_grads(self) -> str | None:
        """The dtype the weight-gradient matmuls produce and reduce in: ``reduce`` where it is wider than
        the activations', else None (autodiff's: the activations' dtype)."""
        return self.reduce if BYTES[self.reduce] > BYTES[self.activations] else None

    @property
    def grad_bytes(self) -> int:
        """Bytes of a gradient element as devices sum it: the wider of the activations and ``reduce``."""
        return max(BYTES[self.activations], BYTES[self.reduce])


def resolve(model: Mapping[str, Any], precision: Mapping[str, Any]) -> Dtypes:
    """The dtypes of a config's ``model`` and ``precision`` sections, as mappings (a saved config's too)."""
    params, master = precision.get("params", "auto"), precision.get("master", "auto")
    return Dtypes(
        compute=model["dtype"] if params == "auto" else params,
        master=model["param_dtype"] if master == "auto" else master,
        reduce=precision.get("grads_reduce", "float32"),
        activations=model["dtype"],
    )


def of(config: Any) -> Dtypes:
    """The dtypes of a :class:`jaxscale.config.read.Config`."""
    return resolve(dataclasses.asdict(config.model), dataclasses.asdict(config.precision))
