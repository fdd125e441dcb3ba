"""The training loop: resume, train, log, evaluate, checkpoint; stop cleanly on SIGTERM or a non-finite value.

Each pass dispatches the guarded step (:attr:`Trainer.compiled_guarded_step`:
the update is not applied where the loss or gradient norm is not finite) and, while
it runs, reads the metrics of the step before, so the host never holds the
devices up. At a boundary (checkpoint, evaluation, SIGTERM, the end) the step
just dispatched is read too, then:

- evaluation (``train.eval_every``, and at the last step): the mean loss of
  ``train.eval_steps`` held-out batches, logged as ``{"step", "eval_loss"}`` (a mixture's sources each
  apart too: ``eval_loss/<name>``; its training records carry ``share/<name>``, :mod:`jaxscale.data.batches`);
- checkpoint (``checkpoint.every``, and at the end): refused if any value of
  the state is not finite; asynchronous, training goes on while it is written.
  Its ``{"step", "checkpoint"}`` record is logged once the save is committed
  (looked at every step, waited for at the end); a save that failed raises
  :class:`~jaxscale.checkpoint.store.CheckpointError` at the next step. The
  directory is checked for writing before anything compiles. With ``checkpoint.continuous`` a save also starts
  at every boundary where none is in flight, into ``checkpoint.fast_dir`` if set
  (:mod:`jaxscale.checkpoint.continuous`);
- SIGTERM or a first Ctrl-C (SIGINT): a checkpoint (when checkpointing is on), then a normal return
  (the ``preempted`` record names the signal; the command line exits 0 after SIGTERM, 130 after
  Ctrl-C); a second Ctrl-C exits at once (:class:`~jaxscale.checkpoint.preemption.Preemption`).

The run holds the lock of its ``run_dir`` and checkpoint directory throughout
(:mod:`jaxscale.runtime.runlock`): a second run on them stops at once with one line.

A non-finite loss or gradient norm is counted (``skipped_updates`` in every
record; that step's record is always logged) under ``train.nonfinite=skip``
(more than ``train.max_consecutive_skips`` in a row raise :class:`NonFiniteError`),
and raises :class:`NonFiniteError` naming the step under ``stop``. A non-finite value at the
first step of a fresh run (not resumed, not handed a state) is no spike to skip but a configuration
or data problem: it raises under either policy, naming the keys likely at fault.

Resume (``checkpoint.resume=auto``; ``required``, the command line's
``--resume``, is an error without a checkpoint) starts from the latest
complete checkpoint that reads back (a damaged one is set aside, with a
warning line and an ``event`` record): the state is read straight into this
trainer's shardings (whatever its mesh and rules table; a layer stack stored for another pipeline split or
schedule is converted once, :mod:`jaxscale.checkpoint.restack`), the loader's saved
state must describe this data at that step, the schedule must keep its length
(:func:`~jaxscale.checkpoint.store.check_compatible`), and the counters carry on; the temporary directories
of a save that a killed run left uncommitted are deleted (an ``event`` record
names them). A fresh run never writes into a directory that already holds
checkpoints. Resume wins over ``checkpoint.init_from``, which only starts a
new run (step 0, fresh optimizer) from other parameters.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import jax
import numpy as np

from jaxscale.checkpoint import restack
from jaxscale.checkpoint.continuous import Tiers
from jaxscale.checkpoint.params import init_state_from
from jaxscale.checkpoint.preemption import Preemption
from jaxscale.checkpoint.store import CheckpointError, Restored, all_finite, check_compatible
from jaxscale.config import flops
from jaxscale.config.read import Config, ConfigError, check_writable, checkpoint_dir
from jaxscale.config.stage_layers import Storage
from jaxscale.data.batches import Loader
from jaxscale.runtime import compile_cache, runlock
from jaxscale.training import goodput
from jaxscale.training import metrics as metrics_lib

TrainState = Any  # jaxscale.training.step.TrainState: the loop only passes it on


class Trainer(Protocol):
    """What the loop needs of a trainer: :class:`jaxscale.training.trainer.Trainer`, which calls :func:`fit` from
    ``fit``."""

    config: Config
    mesh: jax.sharding.Mesh
    batches: Loader
    eval_batches: Loader
    batch_sharding: jax.sharding.NamedSharding
    compiled_guarded_step: tuple[Any, float]
    flops_per_step: float
    jit_eval_loss: Any
    storage: Storage  # the layer stack's: recorded in checkpoints, converted from theirs on resume
    state_shardings: TrainState

    def abstract_state(self) -> TrainState: ...

    def init_state(self, params: Any = None) -> TrainState: ...

    def batch(self, step: int) -> dict[str, jax.Array]: ...


class NonFiniteError(RuntimeError):
    """Training stopped: a non-finite loss or gradient (``train.nonfinite=stop``), or a non-finite state to save."""


def fit(
    trainer: Trainer, state: TrainState | None = None, progress: bool = True, stop_at: int | None = None,
    steps: int | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Train ``trainer`` to ``train.steps`` (or until ``stop_at`` updates, or ``steps`` more than it starts from,
    the last one saved where checkpoints are on); returns the state and the log.

    With ``state`` None the run resumes from the latest checkpoint when
    ``checkpoint.resume`` is ``auto`` and one exists, else starts fresh
    (from ``checkpoint.init_from``'s parameters if set).
    """
    c = trainer.config
    locked = runlock.run_directories(c) if jax.process_index() == 0 else []
    with runlock.hold(*locked):
        return _fit(trainer, state, progress, stop_at, steps)


def _fit(
    trainer: Trainer, state: TrainState | None, progress: bool, stop_at: int | None, steps: int | None
) -> tuple[TrainState, list[dict[str, Any]]]:
    """:func:`fit` with the run's directories locked."""
    c, ck = trainer.config, trainer.config.checkpoint
    if ck.every or ck.continuous:
        check_writable(checkpoint_dir(c))  # before anything compiles, not at the first save
    checkpointer = Tiers.from_config(c) if ck.every or ck.continuous or ck.resume != "off" else None
    with Preemption() as preemption:  # from the start: a SIGTERM while compiling or saving waits for a boundary
        try:
            given, entered = state is not None, time.time()
            state, counters, resumed, removed, damaged = _start(trainer, checkpointer, state)
            start_s = time.time() - entered
            ends = (stop_at, int(state.step) + steps if steps else None)
            last = min([c.train.steps, *(n for n in ends if n is not None)])
            run = _Run(trainer, checkpointer, counters, int(state.step), last, progress, resumed)
            run.fresh = not (given or resumed)
            earlier = goodput.earlier(run.logger.path) if resumed and jax.process_index() == 0 else []
            run.clock = goodput.Clock(entered, start_s, earlier, int(state.step))
            for line in damaged:
                run.logger.log({"step": int(state.step), "event": "damaged_checkpoint", "message": line})
                if jax.process_index() == 0:
                    print(f"jaxscale: warning: {line}", file=sys.stderr, flush=True)
            if removed:
                run.logger.log({"step": int(state.step), "event": "removed_uncommitted", "paths": removed})
            return run.train(state, preemption)
        finally:
            if checkpointer is not None:
                checkpointer.close()


def evaluate(
    trainer: Trainer, params: Any, fp8_state: Any = None, bias: Any = None, loader: Loader | None = None
) -> float:
    """Mean loss over the first ``train.eval_steps`` batches of the held-out data (of ``loader``; None: the
    trainer's ``eval_batches``), fp8 scaled by ``fp8_state``'s histories, experts chosen with the routing
    biases ``bias`` (None: a fresh start's)."""
    loader = trainer.eval_batches if loader is None else loader
    losses = [
        trainer.jit_eval_loss(params, loader.global_batch_arrays(k, trainer.batch_sharding), fp8_state, bias)
        for k in range(trainer.config.train.eval_steps)
    ]
    return float(np.mean(jax.device_get(losses)))


def _start(
    trainer: Trainer, checkpointer: Tiers | None, state: TrainState | None
) -> tuple[Any, dict[str, int], bool, list[str], list[str]]:
    """The state to start from, the loop's counters, whether it was resumed, the uncommitted checkpoint
    directories removed, and a line for each damaged checkpoint passed over."""
    c = trainer.config
    latest = checkpointer.latest_step() if checkpointer is not None else None
    if latest is None:
        if c.checkpoint.resume == "required":
            where = checkpointer.directory if checkpointer is not None else checkpoint_dir(c)
            raise ConfigError(f"--resume: no complete checkpoint in {where} (leave out --resume to start afresh)")
        removed = checkpointer.remove_uncommitted() if checkpointer is not None else []
        if state is None:
            init_from = c.checkpoint.init_from
            state = init_state_from(trainer, init_from) if init_from else trainer.init_state()
        return state, {}, False, removed, []
    if state is not None or c.checkpoint.resume == "off":
        raise ConfigError(
            f"{checkpointer.directory} holds checkpoints (latest step {latest}): continue with --resume "
            "(checkpoint.resume=required), or set another run_dir or checkpoint.dir"
        )

    def check(saved: Restored) -> None:
        check_compatible(saved.config, c, saved.step)
        trainer.batches.check_state(saved.data, saved.step)

    restored, damaged = checkpointer.restore_latest(
        lambda saved: restack.abstract_state(trainer, restack.saved_storage(saved.loop, saved.config)), check
    )
    removed = checkpointer.remove_uncommitted()
    state = restack.convert_state(trainer, restored.state, restack.saved_storage(restored.loop, restored.config))
    return state, restored.loop, True, removed, damaged


class _Run:
    """One call of :func:`fit`: the compiled step, the metrics logger, timing and counters."""

    def __init__(
        self,
        trainer: Trainer,
        checkpointer: Tiers | None,
        counters: dict[str, int],
        first: int,
        last: int,
        progress: bool,
        resumed: bool,
    ):
        c, t = trainer.config, trainer.config.train
        self.trainer, self.checkpointer = trainer, checkpointer
        self.skipped = int(counters.get("skipped_updates", 0))
        self.in_a_row = int(counters.get("skipped_in_a_row", 0))  # consecutive skipped updates
        self.save_started: dict[int, float] = {}  # saves not yet committed: step -> start time
        self.first, self.last = first, last
        self.fresh = False  # started from the run's own initial (or init_from) parameters
        self.tokens_per_step = t.global_batch * t.seq_len
        self.peak = flops.peak_flops(trainer.mesh.devices.flat[0], t.peak_flops) * trainer.mesh.size
        resume_step = first if resumed else None
        self.logger = metrics_lib.MetricsLogger(
            c.run_dir, t.steps, bar=progress, resume_step=resume_step, tensorboard=t.tensorboard
        )
        # Compiled only with a step to run: a finished run resumed says so without compiling.
        before, start = compile_cache.counts(), time.perf_counter()
        self.step_fn, self.compile_s = trainer.compiled_guarded_step if first < last else (None, 0.0)
        # This attempt's wait for its step (none where the trainer had it) and whether the persistent cache had it.
        self.compile_wait_s, self.cache = time.perf_counter() - start, compile_cache.outcome(before)
        self.clock: goodput.Clock | None = None  # set by _fit
        self.flops_per_step = trainer.flops_per_step if first < last else 0.0
        self.mark(first)

    def mark(self, step: int) -> None:
        """Start timing the steps from ``step`` on."""
        self.last_time, self.last_step = time.perf_counter(), step

    def train(self, state: TrainState, preemption: Preemption) -> tuple[TrainState, list[dict[str, Any]]]:
        t, ck = self.trainer.config.train, self.trainer.config.checkpoint
        saving = self.checkpointer is not None and (ck.every > 0 or ck.continuous)
        pending = None
        try:
            for step in range(self.first, self.last):
                state, out = self.step_fn(state, self.trainer.batch(step))
                if self.save_started:
                    self.log_committed()
                if pending is not None:
                    self.account(*pending)
                pending = (step, out)
                done = step + 1
                stop = preemption.reached(done)
                save = saving and ((ck.every and done % ck.every == 0) or done == self.last or stop)
                quick = ck.continuous and not save and self.checkpointer.due(done)
                evaluate = t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)
                if not (save or quick or evaluate or stop or done == self.last):
                    continue
                self.account(*pending)
                pending = None
                if evaluate:
                    self.evaluate(done, state)
                if save or quick:
                    self.save(done, state, quick)
                if stop:
                    self.log_committed(block=True)
                    self.logger.log({"step": done, "event": "preempted", "saved": save, "signal": preemption.signal})
                    break
            self.log_committed(block=True)
        finally:
            self.logger.close()
        return state, self.logger.history

    def account(self, step: int, out: dict[str, jax.Array]) -> None:
        """Read a finished step's metrics: count or refuse a skipped update, log when due."""
        t = self.trainer.config.train
        out = jax.device_get(out)
        finite = bool(out["finite"])
        if not finite:
            if step == 0 and self.fresh:
                raise NonFiniteError(self.first_step_message(out))
            if t.nonfinite == "stop":
                raise NonFiniteError(
                    f"step {step}: loss {float(out['loss'])}, gradient norm {float(out['grad_norm'])} "
                    "(not applied; train.nonfinite=skip skips such updates)"
                )
            self.skipped += 1
            self.in_a_row += 1
            if self.in_a_row > t.max_consecutive_skips:
                raise NonFiniteError(
                    f"step {step}: {self.in_a_row} updates in a row skipped for a non-finite loss or gradient "
                    f"(train.max_consecutive_skips={t.max_consecutive_skips}; {self.skipped} skipped in all)"
                )
        else:
            self.in_a_row = 0
        if finite and step % t.log_every and step not in (t.steps - 1, self.last - 1):
            return
        now = time.perf_counter()
        step_time = (now - self.last_time) / max(step + 1 - self.last_step, 1)
        self.logger.log({
            "step": step,
            "loss": float(out["loss"]),
            "grad_norm": float(out["grad_norm"]),
            "skipped_updates": self.skipped,
            "tokens_per_sec": self.tokens_per_step / step_time,
            "step_time_s": step_time,
            "tflops_per_device": self.flops_per_step / step_time / self.trainer.mesh.size / 1e12,
            "mfu": self.flops_per_step / step_time / self.peak,
            "memory_bytes": metrics_lib.device_memory_in_use(),
            "compile_s": self.compile_s,
            **{k: np.asarray(v).tolist() if np.ndim(v) else float(v)  # MoE load: a list, one per MoE layer
               for k, v in out.items() if k not in ("loss", "grad_norm", "finite")},
            **self.trainer.batches.metrics(self.last_step, step + 1),
            **(self.clock.fields(step + 1 - self.last_step, step_time, self.compile_wait_s, self.cache)
               if self.clock else {}),
        })
        self.last_time, self.last_step = now, step + 1

    def first_step_message(self, out: dict[str, Any]) -> str:
        """Why a fresh run's first step is not finite: the parameters it starts from, the model's
        settings or the data, not an update (named by the keys to look at)."""
        c = self.trainer.config
        keys = ["model.init_std", "model.rope_theta", "model.norm_eps", "model.dtype"]
        if c.checkpoint.init_from:
            keys.insert(0, f"checkpoint.init_from ({c.checkpoint.init_from}: weights not finite?)")
        if c.data.source == "tokens":
            keys.append(f"data.path (token ids against model.vocab_size={c.model.vocab_size})")
        return (
            f"step 0: loss {float(out['loss'])}, gradient norm {float(out['grad_norm'])} before any update: "
            f"a configuration or data problem, not a spike to skip; look at {', '.join(keys)}"
        )

    def evaluate(self, done: int, state: TrainState) -> None:
        start = time.perf_counter()
        loss = evaluate(self.trainer, state.params, state.fp8, state.balance)
        parts = {f"eval_loss/{name}": evaluate(self.trainer, state.params, state.fp8, state.balance, loader)
                 for name, loader in self.trainer.eval_batches.by_source().items()}
        self.logger.log({"step": done, "eval_loss": loss, **parts, "eval_s": time.perf_counter() - start})
        self.mark(done)

    def save(self, done: int, state: TrainState, quick: bool = False) -> None:
        assert self.checkpointer is not None
        if not all_finite(state):
            raise NonFiniteError(
                f"the state after {done} updates is not finite: not saved "
                f"(the latest checkpoint is step {self.checkpointer.latest_step()})"
            )
        start = time.perf_counter()
        data = self.trainer.batches.state(done)
        loop = {"skipped_updates": self.skipped, "skipped_in_a_row": self.in_a_row,
                restack.KEY: self.trainer.storage.to_dict()}
        try:
            self.checkpointer.save(done, state, data, loop, self.trainer.config.to_dict(), quick)
        except CheckpointError:  # the save before failed (orbax waits for it first)
            self.log_saved(self.checkpointer.saved_before_failure)
            raise
        self.save_started[done] = time.perf_counter() - start
        self.mark(done)

    def log_committed(self, block: bool = False) -> None:
        """Log the saves committed by now (``block``: wait for all): a checkpoint record means the
        step is on disk; a failed save raises :class:`CheckpointError` instead."""
        if self.checkpointer is None:
            return
        try:
            self.log_saved(self.checkpointer.committed(block))
        except CheckpointError:
            self.log_saved(self.checkpointer.saved_before_failure)
            raise

    def log_saved(self, steps: list[int]) -> None:
        for step in steps:
            self.logger.log({"step": step, "checkpoint": step, "save_blocking_s": self.save_started.pop(step)})
