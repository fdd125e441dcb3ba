"""``model.remat_names`` against the ``checkpoint_name``s the traced step marks.

``model.remat: save_named`` keeps the activations named in ``model.remat_names``
(``jax.checkpoint_policies.save_only_these_names``); a name that nothing marks keeps nothing and is
ignored by jax, silently. Which names exist depends on the model (the built-in ones mark ``query``,
``key``, ``value``, ``attention``, ``attention_out``, ``mlp_hidden``, ``mlp_out``; FP8 projections
``fp8_input``; a user's model its own), so they are read from the step's jaxpr: every ``name``
equation, in every nested jaxpr (remat, scan, shard_map, custom derivatives).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxscale.config.read import ConfigError, ModelConfig


def _jaxprs(value: Any) -> Iterator[Jaxpr]:
    """The jaxprs inside an equation's parameter (one, or a tuple or list of them)."""
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _jaxprs(item)


def marked(jaxpr: Jaxpr | ClosedJaxpr) -> set[str]:
    """The ``checkpoint_name``s marked anywhere in ``jaxpr``."""
    names: set[str] = set()
    stack = list(_jaxprs(jaxpr))
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "name":
                names.add(eqn.params["name"])
            for value in eqn.params.values():
                stack.extend(_jaxprs(value))
    return names


def check(jaxpr: Jaxpr | ClosedJaxpr, model: ModelConfig) -> None:
    """Raise a one-line :class:`ConfigError` if ``model.remat_names`` or ``model.remat_offload`` holds a name
    the step does not mark."""
    if not model.remat_names and not model.remat_offload:
        return
    names = marked(jaxpr)
    for key, listed in (("remat_names", model.remat_names), ("remat_offload", model.remat_offload)):
        _check(key, [n for n in listed if n not in names], names)


def _check(key: str, unknown: list[str], names: set[str]) -> None:
    if unknown:
        raise ConfigError(
            f"model.{key}: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not the "
            f"checkpoint_name of any activation of this model (its names: {', '.join(sorted(names)) or 'none'})"
        )
