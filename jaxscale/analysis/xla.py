"""A trainer's step compiled from abstract values, and the memory XLA says it takes.

:func:`compile_step` lowers and compiles ``trainer.jit_step`` from the abstract train state and
batch: nothing is materialised, so any model size compiles on simulated devices.
:func:`memory` reads ``compiled.memory_analysis()``; :func:`state_bytes` the bytes per device of
the train state's parts, from their shardings.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def compile_step(trainer: Any) -> Any:
    """The trainer's compiled step, from abstract state and batch (nothing is materialised)."""
    return trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()


def memory(compiled: Any) -> dict[str, int]:
    """Bytes per device from ``compiled.memory_analysis()``; total = arguments + outputs − aliased + temp + code."""
    m = compiled.memory_analysis()
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` (the largest shard's shape)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes(trainer: Any) -> dict[str, int]:
    """Bytes per device of the train state's parts, from their shardings."""
    state = trainer.abstract_state()
    return {
        "params": per_device_bytes(state.params),
        "opt_state": per_device_bytes(state.opt_state),
        "step": per_device_bytes(state.step),
        "batch": per_device_bytes(trainer.abstract_batch()),
    }
