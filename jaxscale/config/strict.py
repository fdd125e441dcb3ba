"""Strict reading of what users write: YAML without duplicate keys, overrides that switch nothing on,
settings that would be silently ignored.

- :func:`load_yaml`: ``yaml.safe_load`` (nothing read runs code) with a loader that refuses a key
  given twice in one mapping (plain YAML keeps the last one, silently), naming the key and its line;
  bytes that are not UTF-8 are refused naming the byte.
- :func:`check_switched_on`: a dotted override such as ``model.moe.experts=4`` that reaches into a
  section switched off (``model.moe: null``, a dense model) is refused; the section must be switched
  on by name first (``model.moe={}`` or ``model.moe={experts: 4}``).
- :func:`unread`: a setting nothing would read as written: ``model.remat_names`` without
  ``model.remat: save_named`` (the only policy that reads them), an empty ``run_dir`` (which would
  write into the working directory under a name that says nothing).

This module does not import jax; :mod:`jaxscale.config.read` calls it.
"""

from __future__ import annotations

import typing
from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names one key twice."""


class UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that names a key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise DuplicateKeyError(
                    None, None, f"key '{key}' appears twice (lines {seen[key]} and {line})", key_node.start_mark
                )
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(data: bytes | str) -> Any:
    """Parse YAML safely, refusing duplicate keys; raises ``yaml.YAMLError`` or ``UnicodeDecodeError``."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass: nothing read runs code


# Sections that switch a feature on by being there, defaults and all (``mesh.dcn`` of 1s changes nothing).
FEATURES = ("model.moe",)


def check_switched_on(raw: dict[str, Any], keys: list[str]) -> str | None:
    """Why the override at ``keys`` must not apply to ``raw`` (the config read so far): a section of
    :data:`FEATURES` on its path that is off (null or absent), as one line; None if it may apply."""
    for feature in FEATURES:
        parts = feature.split(".")
        if len(keys) <= len(parts) or keys[: len(parts)] != parts:
            continue
        node: Any = raw
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            rest = ".".join(keys[len(parts):])
            return (
                f"{'.'.join(keys)}: {feature} is off (null) in this config; switch it on by name first: "
                f"{feature}={{}} (its defaults) or {feature}={{{rest}: ...}}"
            )
    return None


def unread(config: Any) -> str | None:
    """Why a setting of ``config`` (a :class:`jaxscale.config.read.Config`) would be ignored or misread, as one
    line; None if none is. Which names ``model.remat_names`` may hold is known only once the model is
    traced (:mod:`jaxscale.training.remat_names`)."""
    m = config.model
    if m.remat_names and m.remat != "save_named":
        return (f"model.remat_names: read only by model.remat=save_named, not {m.remat} "
                f"(set model.remat=save_named, or leave model.remat_names out)")
    if m.remat_offload and m.remat != "save_named":
        return (f"model.remat_offload: read only by model.remat=save_named, not {m.remat} "
                f"(set model.remat=save_named, or leave model.remat_offload out)")
    if both := sorted(set(m.remat_names) & set(m.remat_offload)):
        return (f"model.remat_names and model.remat_offload both name {', '.join(map(repr, both))}: an activation "
                f"is kept on the device or offloaded to the host, not both")
    if not str(config.run_dir).strip():
        return "run_dir is empty: name a directory (run_dir=. for the working directory)"
    return None
