"""Checkpoints with orbax: async save, exact resume, restore onto another mesh, preemption.

A checkpoint is one orbax step directory ``<checkpoint.dir>/<step>`` with four items:

- ``state``: the train state (step, fp32 parameters, Adam state, fp8 amax histories) as sharded arrays
  (tensorstore, OCDBT). Bytes on disk: 4Ψ parameters + 8Ψ Adam moments + a few
  scalars, at most about 12Ψ whatever the layout (chunks are compressed, so
  zeros such as the moments of embedding rows never seen take less); each array
  is written once, each process writing only the shards it holds (one replica).
- ``data``: the loader's state (next step, sequences read, epoch, identity of the data).
- ``loop``: the loop's counters (updates skipped for a non-finite loss or gradient).
- ``config``: the resolved config.

What it communicates: saving copies each process's shards device -> host (the
only blocking part; :meth:`Checkpointer.save` returns then) and writes them in a
background thread while training goes on. Restoring reads, for every device,
only the slice its new sharding asks for: the targets are the new trainer's
abstract state, so a checkpoint saved under one mesh and rules table (``zero3``
on 8 devices) restores under another (``tp`` on 4, ``dp`` on 1) without
gathering the state on one host.

Atomicity (orbax): a step is written into ``<step>.orbax-checkpoint-tmp`` and
renamed to ``<step>`` only after every item is committed; ``latest_step`` lists
finalized steps only, and a run that goes on writing into the directory
(fresh into an empty one, or resuming) first deletes the temporary
directories a killed process left. Older steps are deleted (the
keep policy: the last ``keep``, plus every ``keep_every``-th step) only after a
newer one is finalized, so a crash never leaves fewer complete checkpoints.

Preemption: SIGTERM sets a flag that the loop reads at the next step boundary
(with several processes, jax's preemption sync point makes them agree on the step).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from jaxscale import fp8
from jaxscale.config import Config, ConfigError, checkpoint_dir

ITEMS = ("state", "data", "loop", "config")
# The model settings that decide the shapes and dtypes of the saved arrays.
SHAPE_KEYS = ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp", "tie_embeddings", "param_dtype")


@dataclasses.dataclass
class Restored:
    """A checkpoint read back: the train state in the target shardings and the JSON items."""

    step: int
    state: Any
    data: dict[str, Any]
    loop: dict[str, Any]
    config: dict[str, Any]


class Checkpointer:
    """An orbax ``CheckpointManager`` for one run's directory."""

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
    ):
        self.directory = Path(directory).absolute()
        keep_policies: list[Any] = [policies.LatestN(keep)]
        if keep_every:
            keep_policies.append(policies.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=policies.AnyPreservationPolicy(keep_policies),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    @classmethod
    def from_config(cls, config: Config) -> Checkpointer:
        ck = config.checkpoint
        return cls(checkpoint_dir(config), ck.keep, ck.keep_every, ck.async_save)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, if any."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data: dict, loop: dict, config: dict) -> None:
        """Start an asynchronous save of ``step``; returns once the state has been copied off the devices."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_stored(state)),
            data=ocp.args.JsonSave(data),
            loop=ocp.args.JsonSave(loop),
            config=ocp.args.JsonSave(config),
        )
        self.manager.save(step, args=args, force=True)

    def read_json(self, step: int) -> Restored:
        """The JSON items of ``step`` (no arrays read)."""
        items = self.manager.restore(
            step,
            args=ocp.args.Composite(data=ocp.args.JsonRestore(), loop=ocp.args.JsonRestore(),
                                    config=ocp.args.JsonRestore()),
        )
        return Restored(step, None, items.data, items.loop, items.config)

    def restore_state(self, abstract_state: Any, step: int) -> Any:
        """The train state of ``step``, read into the shardings of ``abstract_state`` (ShapeDtypeStructs)."""
        items = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_stored(abstract_state)))
        )
        return type(abstract_state)(**items.state)

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
        """Everything of ``step`` (default: the latest complete one), the state in ``abstract_state``'s shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"no complete checkpoint in {self.directory}")
        restored = self.read_json(step)
        restored.state = self.restore_state(abstract_state, step)
        return restored

    def remove_uncommitted(self) -> list[str]:
        """Delete the step directories a killed process left uncommitted (orbax never lists them as steps).

        For the run about to write here only. Synchronous, unlike orbax's own
        ``cleanup_tmp_directories`` (a background task that ``close`` does not
        wait for, so two managers opened one after the other on a directory
        could both be deleting the same files).
        """
        removed = []
        if jax.process_index() == 0 and self.directory.is_dir():
            for path in sorted(self.directory.iterdir()):
                if path.is_dir() and ocp.utils.is_tmp_checkpoint(path):
                    shutil.rmtree(path)
                    removed.append(path.name)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxscale: uncommitted checkpoints removed")
        return removed

    def wait(self) -> None:
        """Block until every started save is finalized."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _stored(state: Any) -> dict[str, Any]:
    """The state's fields as saved: an empty one (``fp8`` with precision.fp8=off) is left out, so such
    checkpoints are those of a train state without it, and restore on either side of it."""
    return {k: v for k, v in state._asdict().items() if not (isinstance(v, dict) and not v)}


def check_compatible(saved: dict[str, Any], config: Config, step: int) -> None:
    """Raise if the checkpoint's model would not restore into ``config``'s shapes."""
    current = config.to_dict()["model"]
    for key in SHAPE_KEYS:
        if saved["model"].get(key) != current[key]:
            raise ConfigError(
                f"resume: checkpoint step {step} has model.{key}={saved['model'].get(key)!r}, "
                f"the config has {current[key]!r}"
            )
    fp8.check_resume(saved, config.precision, step)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree: Any) -> bool:
    """Whether every floating-point value of ``tree`` is finite (one fused reduction on the devices)."""
    return bool(_all_finite(tree))


class Preemption:
    """A context in which SIGTERM asks the loop to stop at the next step boundary.

    One process: a signal handler sets a flag (the previous handler comes back on
    exit). Several processes: jax's preemption sync point, which the coordination
    service raises on SIGTERM to any of them, so that all stop at the same step.
    """

    def __init__(self) -> None:
        self.requested = False
        self.installed = False
        self.previous: Any = None

    def __enter__(self) -> Preemption:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)

    def reached(self, step: int) -> bool:
        """Whether to stop after ``step`` updates."""
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested
