"""What ``mesh.axis_types: explicit`` serves, and one line for each thing it does not serve yet (no jax).

With explicit axes (jax's ``AxisType.Explicit``) an array's sharding is part of its type: jax's sharding rules
give each operation's output layout and refuse the operations whose layout they cannot decide, which the model
then states (``out_sharding=`` on a contraction or a gather, ``jax.sharding.reshard``). The trainer's own part of
the step is written for both kinds of axes: the parameters, gradients and optimizer state keep the rules
table's layouts (:func:`jaxscale.precision.lay_out`: a ``reshard`` where a constraint would be refused),
:func:`jaxscale.sharding.constrain` (``jaxscale.nn.constrain``) reshards an activation to its rules, and the
default objective's cross-entropy runs on the model's logits as laid out. A model written for explicit axes
trains under the rules tables that lay out parameters and batches only: ``dp``, ``zero1``/``zero2``/``zero3``,
``tp`` and ``fsdp_tp`` (tests/test_sharding_idioms.py: equal to auto axes).

Refused at build, each in one line naming both settings, because its code leaves layouts to XLA's partitioner
(auto axes) or runs in ``shard_map`` regions written and tested for auto axes only:

- the built-in models (their embedding gathers, norms and projections state no output layouts);
- pipeline stages (``layers`` on ``stage``), sequence parallelism (``norm_length`` split apart from ``length``),
  context parallelism (``length`` split: ring attention);
- mixture-of-experts layers (``model.moe``: the exchange and the routing's layouts);
- fp8 projections (``precision.fp8``: their scales and amax histories).
"""

from __future__ import annotations

from jaxscale.config import Config, ConfigError
from jaxscale.layout import Layout

EXPLICIT = "mesh.axis_types=explicit"
AUTO = "mesh.axis_types=auto"


def check(config: Config, place: Layout, builtin_model: bool) -> None:
    """Raise the one line of the first thing ``config`` asks that explicit axes do not serve yet
    (nothing with ``mesh.axis_types: auto``); ``builtin_model``: the model is one of the built-in ones."""
    if config.mesh.axis_types != "explicit":
        return
    where = f"rules '{place.name}'"
    refusals = (
        (builtin_model, "the built-in model (Trainer.build without model=)",
         f"its layers leave their layouts to XLA's partitioner; {AUTO}, or a model written for explicit axes "
         "(docs/models.md)"),
        (place.pipelined, f"{where} (layers on stage: {place.stages} pipeline stages)",
         f"the pipeline's stage loop is a shard_map written for auto axes; {AUTO}"),
        (bool(place.sequence_axes), f"{where} (sequence parallelism: norm_length on {list(place.sequence_axes)})",
         f"its shard_map regions are written for auto axes; {AUTO}, or rules without sequence parallelism"),
        (bool(place.context_axes), f"{where} (context parallelism: length on {list(place.context_axes)})",
         f"ring attention is a shard_map written for auto axes; {AUTO}"),
        (config.model.moe is not None, "model.moe",
         f"the experts' exchange and routing are written for auto axes; {AUTO}"),
        (config.precision.fp8 != "off", f"precision.fp8={config.precision.fp8}",
         f"fp8 projections keep their scales for auto axes; {AUTO}, or precision.fp8=off"),
    )
    for refused, what, why in refusals:
        if refused:
            raise ConfigError(f"{EXPLICIT} with {what}: not served yet, {why}")
