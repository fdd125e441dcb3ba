"""jaxscale: a JAX/XLA SPMD training stack; layouts are rules tables, not code.

The public API (README "Python API"; the model contract in docs/models.md)::

    import jaxscale

    jaxscale.simulate_devices(8)  # CPU devices for the mesh, before jax starts (no accelerator needed)

    config = jaxscale.load_config("configs/experiments/tiny.yaml", ["rules=zero3"])
    trainer = jaxscale.Trainer.build(config, model=factory)   # factory(config, rngs) -> nnx.Module
    state, history = trainer.fit(progress=False)

Top-level names: ``simulate_devices``, ``load_config``, ``Config``, ``ConfigError``, ``Trainer``,
``TrainState``, ``Rules``, ``Checkpointer``, ``muon`` (the Muon optimizer, an optax transformation); building blocks
for models in :mod:`jaxscale.nn`. Importing
``jaxscale`` imports no jax: the other names load on first use, after ``simulate_devices``.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxscale.runtime.simulate import simulate_devices

_LAZY = {
    "load_config": "jaxscale.config.read",
    "Config": "jaxscale.config.read",
    "ConfigError": "jaxscale.config.read",
    "Trainer": "jaxscale.training.trainer",
    "TrainState": "jaxscale.training.trainer",
    "Rules": "jaxscale.layout.sharding",
    "Checkpointer": "jaxscale.checkpoint.store",
    "muon": "jaxscale.training.muon",
}

__all__ = ["simulate_devices", *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "nn":
        return importlib.import_module("jaxscale.nn")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")
