"""The bench suites as data: ``configs/bench/suites.yaml`` read and checked, and a suite's runs picked from it.

A suite is a list of runs, each a name and its overrides on top of the base experiment; ``--models`` and
``--variants`` pick rows by name. Jax-free: ``jaxscale bench`` refuses a bad suite before jax starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxscale.config.read import CONFIG_DIR, ConfigError, read_yaml

SUITES_FILE = CONFIG_DIR / "bench" / "suites.yaml"


SUITES = ("quick", "full", "compile", "options", "calibration")


@dataclass
class Run:
    """One row of a suite: its name, the overrides on top of the base experiment, and what to measure."""

    name: str
    overrides: list[str]
    compile_only: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_suites(path: str | Path = SUITES_FILE) -> dict[str, dict[str, Any]]:
    """The suites table, its shape checked (override lists of strings, integer steps and layers)."""
    table = read_yaml(Path(path))
    for suite, spec in table.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{path}: suite '{suite}' is not a mapping")
        for key in ("runs", "variants"):
            for name, items in (spec.get(key) or {}).items():
                if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                    raise ConfigError(f"{path}: {suite}.{key}.{name} is not a list of KEY=VALUE strings")
        for key in ("steps", "warmup", "rounds"):
            if not _is_int(spec.get(key, 0)):
                raise ConfigError(f"{path}: {suite}.{key} is not an integer")
        layers = spec.get("layers", [])
        if not isinstance(layers, list) or not all(_is_int(n) and n > 0 for n in layers):
            raise ConfigError(f"{path}: {suite}.layers is not a list of positive integers")
    return table


def _pick(entries: dict[str, list[str]], names: list[str] | None, what: str) -> dict[str, list[str]]:
    if names is None:
        return entries
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise ConfigError(f"{what} {', '.join(unknown)}: not in the suite (known: {', '.join(entries)})")
    return {n: entries[n] for n in names}


def plan(
    suite: str,
    overrides: list[str],
    table: dict[str, dict[str, Any]],
    models: list[str] | None = None,
    variants: list[str] | None = None,
    layers: list[int] | None = None,
) -> list[Run]:
    """The runs of ``suite``: ``runs`` entries go before the command line's overrides, ``variants``
    after them, ``layers`` set ``model.layers`` last."""
    if suite not in table:
        raise ConfigError(f"--suite {suite}: no such suite (known: {', '.join(table)})")
    spec = table[suite]
    if models is not None and "runs" not in spec:
        raise ConfigError(f"--models: suite '{suite}' has no model runs")
    if variants is not None and "variants" not in spec:
        raise ConfigError(f"--variants: suite '{suite}' has no variants")
    if layers is not None and "layers" not in spec:
        raise ConfigError(f"--layers: suite '{suite}' does not compile by depth")
    runs = [Run(n, [*o, *overrides]) for n, o in _pick(spec.get("runs") or {}, models, "--models").items()]
    runs += [Run(n, [*overrides, *o]) for n, o in _pick(spec.get("variants") or {}, variants, "--variants").items()]
    for n in layers if layers is not None else spec.get("layers", []):
        runs.append(Run(f"layers={n}", [*overrides, f"model.layers={n}"], compile_only=True))
    if not runs:
        raise ConfigError(f"suite '{suite}' has no runs")
    return runs
