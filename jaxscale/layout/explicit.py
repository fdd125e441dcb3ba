"""What ``mesh.axis_types: explicit`` serves, and one line for each thing it does not serve yet (no jax).

With explicit axes (jax's ``AxisType.Explicit``) an array's sharding is part of its type: jax's sharding rules give
each operation's output layout and refuse the operations whose layout they cannot decide, which the code then
states (``out_sharding=`` on a contraction or a gather, ``jax.sharding.reshard``). jaxscale states its own: the
parameters, gradients and optimizer state keep the rules table's layouts
(:func:`jaxscale.layout.collectives.lay_out`: a ``reshard`` where a constraint would be refused),
:func:`jaxscale.layout.sharding.constrain` reshards an activation to its rules, the weight matmuls
(:func:`jaxscale.precision.policy.out_sharding`), the embedding lookup, the norms' scales and the chunked loss's
matmuls state their outputs' layouts (:func:`jaxscale.layout.sharding.stated`). The built-in dense models and
models written for explicit axes then train under the rules tables of data, ZeRO, tensor and sequence parallelism
(``dp``, ``zero1``..``zero3``, ``tp``, ``fsdp_tp``, ``tp_sp``, ``fsdp_tp_sp``; tests/test_sharding_idioms.py: equal
to auto axes).

Refused at build, each in one line naming both settings, because its code still leaves layouts that jax's
rules cannot decide to XLA's partitioner (auto axes):

- pipeline stages (``layers`` on ``stage``: the stage loop's ``shard_map`` takes its inputs as laid out for
  auto axes);
- context parallelism (``length`` split: attention's score matmul over two split sequences);
- mixture-of-experts layers (``model.moe``: the routing's sort and the experts' exchange);
- fp8 projections (``precision.fp8``: their scaled matmuls state no output layout).
"""

from __future__ import annotations

from jaxscale.config.read import Config, ConfigError
from jaxscale.layout.rules import Layout

EXPLICIT = "mesh.axis_types=explicit"
AUTO = "mesh.axis_types=auto"


def check(config: Config, place: Layout) -> None:
    """Raise the one line of the first thing ``config`` asks that explicit axes do not serve yet
    (nothing with ``mesh.axis_types: auto``)."""
    if config.mesh.axis_types != "explicit":
        return
    where = f"rules '{place.name}'"
    refusals = (
        (place.pipelined, f"{where} (layers on stage: {place.stages} pipeline stages)",
         f"the pipeline's stage loop is a shard_map laid out for auto axes; {AUTO}"),
        (bool(place.context_axes), f"{where} (context parallelism: length on {list(place.context_axes)})",
         f"attention over a split sequence leaves its layouts to the partitioner; {AUTO}"),
        (config.model.moe is not None, "model.moe",
         f"the routing and the experts' exchange leave their layouts to the partitioner; {AUTO}"),
        (config.precision.fp8 != "off", f"precision.fp8={config.precision.fp8}",
         f"fp8 matmuls state no output layout; {AUTO}, or precision.fp8=off"),
    )
    for refused, what, why in refusals:
        if refused:
            raise ConfigError(f"{EXPLICIT} with {what}: not served yet, {why}")
