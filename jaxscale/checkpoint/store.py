"""Checkpoints with orbax: async save, exact resume, restore onto another mesh, preemption.

A checkpoint is one orbax step directory ``<checkpoint.dir>/<step>`` with four items:

- ``state``: the train state (step, parameters, Adam state, fp8 amax histories, and the master
  weights where the compute copy is apart from them: :mod:`jaxscale.precision.policy`) as sharded arrays
  (tensorstore, OCDBT). Bytes on disk: 4Ψ fp32 parameters + 8Ψ Adam moments + a few
  scalars, at most about 12Ψ whatever the layout, or with a bf16 compute copy 2Ψ + 4Ψ
  master + 8Ψ, about 14Ψ (chunks are compressed, so zeros such as the moments of
  embedding rows never seen take less); each array is written once, each process
  writing only the shards it holds (one replica).
- ``data``: the loader's state (next step, sequences read, epoch, identity of the data).
- ``loop``: the loop's counters (updates skipped for a non-finite loss or gradient), and the storage of
  the layer stack (:mod:`jaxscale.checkpoint.restack`: a checkpoint resumes onto another pipeline split, schedule or
  layout, converted on restore).
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

Parameters checkpoints (``checkpoint.init_from``): :mod:`jaxscale.checkpoint.params`; preemption
(SIGTERM, Ctrl-C): :mod:`jaxscale.checkpoint.preemption`.

Failures, in one line each: a ``checkpoint.dir`` that cannot be written is a
:class:`~jaxscale.config.read.ConfigError` before the run starts
(:func:`~jaxscale.config.read.check_writable`); a save that fails in the background (a full disk) is
a :class:`CheckpointError` naming the step and the latest complete one, raised
by the next call that looks (:meth:`Checkpointer.committed`, which the loop
calls every step; orbax's own logs of it are silenced). On resume, a step that
does not read back is set aside as ``<step>.damaged`` (``.damaged.2`` and on when that
name is taken) and the one before it is read (:meth:`Checkpointer.restore_latest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from jaxscale.config.read import Config, ConfigError, checkpoint_dir
from jaxscale.config.schema import schedule_length
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision

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


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (full disk, lost storage): the run stops, naming the step."""


def first_line(error: BaseException) -> str:
    """An orbax or tensorstore error in one line: its type and first line, without the store's spec."""
    text = str(error).strip().split(" See full TensorStore details")[0]  # then a repr of the store's spec
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class _QuietOrbax(logging.Filter):
    """Drop orbax's own error logs (tracebacks from its threads), and asyncio's "exception never
    retrieved" logs of orbax's write tasks: :class:`Checkpointer` reports each failure once, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__ if error else None)]
        return not any("orbax" in f for f in [record.pathname, *files])


class _LateWrites:
    """An unraisable-exception hook that drops the "Event loop is closed" errors tensorstore reports
    (from its own threads) when the writes still in flight of a failed save complete after orbax
    closed their event loop, and the errors of orbax's own coroutines left unfinished when a read
    failed (collected later: "Exception ignored in: <coroutine ...>", once per array); everything
    else goes to the previous hook. Each such failure was already reported once, in one line."""

    def __init__(self, hook: Callable[[Any], None]):
        self.hook = hook

    def __call__(self, unraisable: Any) -> None:
        value, culprit = unraisable.exc_value, unraisable.object
        late_write = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        code = getattr(culprit, "cr_code", None)
        orbax_coroutine = code is not None and "orbax" in code.co_filename
        if not (late_write or orbax_coroutine):
            self.hook(unraisable)


class Checkpointer:
    """An orbax ``CheckpointManager`` for one run's directory.

    Errors are one line: a directory orbax cannot open is a :class:`ConfigError`, a save that fails
    (in the background thread of an async save, or at once) a :class:`CheckpointError` naming the step.
    """

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
        for name in ("absl", "orbax", "asyncio"):
            if not any(isinstance(f, _QuietOrbax) for f in logging.getLogger(name).filters):
                logging.getLogger(name).addFilter(_QuietOrbax())
        if not isinstance(sys.unraisablehook, _LateWrites):
            sys.unraisablehook = _LateWrites(sys.unraisablehook)
        self.failed: CheckpointError | None = None
        self.unconfirmed: list[int] = []  # saves started, not yet known to be committed
        self.saved_before_failure: list[int] = []  # those of them found committed when one failed
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.dir {self.directory}: cannot open it: {first_line(e)}") from e

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
        try:
            self.manager.save(step, args=args, force=True)  # waits for the save before: its error shows here
        except Exception as e:
            self._fail(e, [*self.unconfirmed, step])
        self.unconfirmed.append(step)

    def _fail(self, error: BaseException, started: list[int]) -> NoReturn:
        """Raise the :class:`CheckpointError` of the first of ``started`` that is not on disk (those
        that are go to :attr:`saved_before_failure`)."""
        on_disk = self.all_steps()
        self.saved_before_failure = [s for s in started if s in on_disk]
        step = next((s for s in started if s not in on_disk), started[-1])
        self.unconfirmed = []
        done = [s for s in on_disk if s < step]
        self.failed = CheckpointError(
            f"checkpoint step {step} was not saved in {self.directory}: {first_line(error)} "
            f"(the latest complete checkpoint is {f'step {done[-1]}' if done else 'none'})"
        )
        raise self.failed from error

    def committed(self, block: bool = False) -> list[int]:
        """The steps whose saves were committed since the last call (all started ones with ``block``;
        else only if no save is in progress); raises :class:`CheckpointError` if one failed."""
        if not self.unconfirmed or (not block and self.manager.is_saving_in_progress()):
            return []
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:
            self._fail(e, self.unconfirmed)
        done, self.unconfirmed = self.unconfirmed, []
        return done

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

    def restore_latest(
        self, abstract_for: Callable[[Restored], Any], check: Callable[[Restored], None]
    ) -> tuple[Restored, list[str]]:
        """The newest checkpoint that reads back whole, and a line for each newer one that did not.

        ``check`` vets a step's JSON items before its arrays are read (its :class:`ConfigError`, a
        checkpoint of another run, stops the search); the arrays are read into ``abstract_for(items)``
        (the layer stack in the storage the checkpoint records: :mod:`jaxscale.checkpoint.restack`). A damaged step
        (unreadable JSON or arrays) is renamed ``<step>.damaged`` (``.damaged.<k>`` when taken: kept, but no
        longer a step, so new saves can take its number) and the step before it is tried; if none reads, a
        :class:`ConfigError` lists why.
        """
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                restored = self.read_json(step)
            except Exception as e:
                damaged.append((step, first_line(e)))
                continue
            check(restored)
            try:
                restored.state = self.restore_state(abstract_for(restored), step)
            except Exception as e:
                damaged.append((step, first_line(e)))
                continue
            return restored, self.set_aside(damaged, step)
        reasons = "; ".join(f"step {s}: {why}" for s, why in damaged)
        raise ConfigError(f"no readable checkpoint in {self.directory} ({reasons})")

    def set_aside(self, damaged: list[tuple[int, str]], restored: int) -> list[str]:
        """Rename the damaged ``(step, why)`` of ``damaged`` ``<step>.damaged`` (process 0; all processes wait for
        it), the restore having taken step ``restored``; one line each, saying so."""
        kept = {}
        for step, _ in damaged:
            kept[step] = _free_name(self.directory, f"{step}.damaged")
            if jax.process_index() == 0:
                (self.directory / str(step)).rename(self.directory / kept[step])
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxscale: damaged checkpoints set aside")
        if damaged:
            self.manager.reload()
        return [
            f"checkpoint step {step} is damaged ({why}): kept as {kept[step]}; resuming from step {restored}"
            for step, why in damaged
        ]

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
        self.committed(block=True)

    def close(self) -> None:
        """Finish the saves in flight and let go of the directory (after a failure: at once, quietly)."""
        if self.failed is not None:
            with contextlib.suppress(Exception):
                self.manager.close()
            return
        try:
            self.committed(block=True)
        finally:
            self.manager.close()


def _free_name(directory: Path, name: str) -> str:
    """``name``, or ``name.2``, ``name.3``, ... : the first not taken in ``directory`` (a step damaged again)."""
    k, free = 1, name
    while (directory / free).exists():
        k += 1
        free = f"{name}.{k}"
    return free


def _stored(state: Any) -> dict[str, Any]:
    """The state's fields as saved: an empty one (``fp8`` with precision.fp8=off, ``master`` with one copy)
    is left out, so such checkpoints are those of a train state without it, and restore on either side of it."""
    return {k: v for k, v in state._asdict().items() if not (isinstance(v, dict) and not v)}


def check_compatible(saved: dict[str, Any], config: Config, step: int) -> None:
    """Raise if the checkpoint's model would not restore into ``config``'s shapes, or if its learning-rate
    schedule would change length without ``train.schedule_steps`` saying so. (Another pipeline split,
    schedule or layout is converted on restore: :mod:`jaxscale.checkpoint.restack`.)"""
    current = config.to_dict()["model"]
    for key in SHAPE_KEYS:
        if saved["model"].get(key) != current[key]:
            raise ConfigError(
                f"resume: checkpoint step {step} has model.{key}={saved['model'].get(key)!r}, "
                f"the config has {current[key]!r}"
            )
    fp8.check_resume(saved, config.precision, step)
    precision.check_resume(saved, config, step)
    t = saved["train"]
    if t.get("optimizer", "adamw") != config.train.optimizer:
        raise ConfigError(
            f"resume: checkpoint step {step} holds the state of train.optimizer={t.get('optimizer', 'adamw')}, the "
            f"config asks for {config.train.optimizer} (checkpoint.init_from starts a new run from its parameters)"
        )
    was = t["steps"] if t.get("schedule_steps") is None else t["schedule_steps"]
    now = schedule_length(config.train)
    if was != now and config.train.schedule_steps is None:
        raise ConfigError(
            f"resume: checkpoint step {step} follows a learning-rate schedule of {was} steps, this config's "
            f"would be {now} (train.steps): set train.schedule_steps={was} to keep it (past its end the rate "
            f"stays at its final value), or train.schedule_steps={now} to stretch it from step {step} on"
        )


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree: Any) -> bool:
    """Whether every floating-point value of ``tree`` is finite (one fused reduction on the devices)."""
    return bool(_all_finite(tree))
