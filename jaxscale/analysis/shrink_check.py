"""The planner's check of a shrunk mesh (``distributed.elastic``): the step's predicted peak per device within the
device's usable memory, before anything compiles.

Only the ``data`` axis shrinks (:mod:`jaxscale.runtime.elastic`) and a microbatch keeps its rows per device, but
what the rules shard over ``data`` (ZeRO's optimizer state, FSDP over ``data``) grows on each device left. The
peak is :func:`jaxscale.analysis.memory.memory`'s ``total`` under the run's remat policy, the budget
:func:`jaxscale.analysis.remat.device_budget`'s (none on XLA:CPU, which reports no limit: nothing refused).
"""

from __future__ import annotations

from typing import Any

from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import trainer_inputs
from jaxscale.analysis.remat import device_budget
from jaxscale.config.read import ConfigError

GIB = 2**30


def check(trainer: Any, budget: float | None = None) -> None:
    """Refuse, in one line, a shrunk trainer whose predicted peak per device exceeds ``budget`` bytes (None: the
    first local device's usable memory, where it reports one)."""
    budget = device_budget(trainer.mesh.local_devices[0]) if budget is None else budget
    if budget is None:
        return
    params, layout, step = trainer_inputs(trainer)
    peak = memory(trainer.config.model, params, layout, step)["total"]
    if peak > budget:
        raise ConfigError(
            f"distributed.elastic: on a data axis of {trainer.mesh.shape['data']} the planner predicts "
            f"{peak / GIB:.2f} GiB a device, over the {budget / GIB:.2f} GiB usable: the run cannot shrink; "
            "restore on the whole mesh (the newest checkpoint, of the fast tier where newer)"
        )
