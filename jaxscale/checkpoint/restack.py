"""A state's layer stack moved between storages: checkpoints resume onto other splits, schedules and layouts.

The parameters keep the model's stacked blocks in a :class:`~jaxscale.config.stage_layers.Storage` (padded slots
for uneven stages, each stage's chunks together for interleaved schedules, the canonical order without a
pipeline). A checkpoint is written as the state stands and records its storage (``layer_storage`` in its
``loop`` item; one written before that is read as :func:`~jaxscale.config.stage_layers.written_before` says).
Restored into another storage, the state is read in its own (each device reading its slice where the saved
slots split over the target's axes, else the whole stack of its shard of the other dimensions) and
converted on the devices, once: the canonical order gathered from the saved slots, then placed in the
trainer's. Every array under a ``blocks`` key moves: the parameters, the master weights and the
optimizer's moments; nothing else changes. Parameters checkpoints (``checkpoint.init_from``) convert the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.config.stage_layers import Storage, written_before

KEY = "layer_storage"  # the loop item's record of the stack's storage
MOVED = ("params", "opt_state", "master", "fp8", "balance")  # the state's fields with the stack in them


def saved_storage(loop: dict[str, Any], config: dict[str, Any]) -> Storage:
    """The storage a checkpoint was written in, from its ``loop`` and ``config`` items."""
    recorded = loop.get(KEY)
    if recorded is not None:
        return Storage.from_dict(recorded)
    return written_before(config["model"], config.get("pipeline") or {})


def same(a: Storage, b: Storage) -> bool:
    """Whether two storages put every unit in the same slot of stacks of one size."""
    return a.size == b.size and bool((a.positions() == b.positions()).all())


def _in_blocks(path: tuple) -> bool:
    return any(getattr(k, "key", None) == "blocks" for k in path)


def _on_blocks(f: Any, tree: Any) -> Any:
    """``f`` on every array of ``tree`` under a ``blocks`` key, the rest as it is."""
    return jax.tree_util.tree_map_with_path(lambda path, x: f(x) if _in_blocks(path) else x, tree)


def _on_state(f: Any, state: Any) -> Any:
    return state._replace(**{k: _on_blocks(f, getattr(state, k)) for k in MOVED})


def moved(w: Any, saved: Storage, target: Storage) -> Any:
    """One stacked array from the ``saved`` storage into the ``target`` one."""
    return target.place(saved.canonical(w))


def _donated(saved: Storage, target: Storage) -> tuple[int, ...]:
    """The input donated where its stacks can hold the output's (a stack of another size cannot)."""
    return (0,) if saved.size == target.size else ()


def placed(storage: Storage, read: Callable[[tuple], Any]) -> Callable[[tuple], Any]:
    """``read`` (a parameter's path -> its array, the model's order) with a block's array placed in ``storage``."""
    return lambda path: storage.place(read(path)) if path[0] == "blocks" else read(path)


def read_as(abstract: Any, saved: Storage, mesh: Mesh) -> Any:
    """ShapeDtypeStructs of a stack in ``saved`` storage for those of another (``abstract``): its slots split
    as the target's where they divide, else whole on each device."""

    def one(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = tuple(a.sharding.spec) + (None,) * (len(a.shape) - len(a.sharding.spec))
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
        if saved.size % int(np.prod([mesh.shape[x] for x in axes], dtype=int)):
            spec = (None, *spec[1:])
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        return jax.ShapeDtypeStruct((saved.size, *a.shape[1:]), a.dtype, sharding=sharding)

    return _on_blocks(one, abstract)


def abstract_state(trainer: Any, saved: Storage) -> Any:
    """The trainer's abstract state, its stack in the ``saved`` storage: what a checkpoint reads into."""
    abstract = trainer.abstract_state()
    if same(saved, trainer.storage):
        return abstract
    return abstract._replace(**{k: read_as(getattr(abstract, k), saved, trainer.mesh) for k in MOVED})


def convert_state(trainer: Any, state: Any, saved: Storage) -> Any:
    """A state read in the ``saved`` storage as the trainer's (donated where it can hold it; the same state
    when they agree)."""
    if same(saved, trainer.storage):
        return state
    convert = jax.jit(lambda s: _on_state(lambda w: moved(w, saved, trainer.storage), s),
                      out_shardings=trainer.state_shardings, donate_argnums=_donated(saved, trainer.storage))
    return convert(state)


def convert_params(params: Any, saved: Storage, target: Storage, shardings: Any) -> Any:
    """Parameters read in the ``saved`` storage in the ``target`` one, laid out as ``shardings``."""
    if same(saved, target):
        return params
    convert = jax.jit(lambda p: _on_blocks(lambda w: moved(w, saved, target), p), out_shardings=shardings,
                      donate_argnums=_donated(saved, target))
    return convert(params)
