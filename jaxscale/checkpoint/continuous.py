"""Continuous checkpoints and a fast tier: the next asynchronous save starts as soon as the last one committed.

``checkpoint.continuous: true`` is Orbax's continuous checkpointing policy: at every step boundary where no save
is in flight, the loop starts one (its blocking part is the copy off the devices; the write runs in the background
while training goes on), so a failure loses the steps of about one save's write, not up to ``checkpoint.every``.
``checkpoint.continuous_interval_s`` (Orbax's ``minimum_interval_secs``) keeps them that far apart at least: each
save also costs the devices a pause (the loop waits for the step before it copies), and on a CPU host the write
shares the cores that compute.
The persistent saves (every ``checkpoint.every`` steps, at the end, on SIGTERM) go on as before.

``checkpoint.fast_dir``: the continuous saves go there (a fast directory: a node's local NVMe, ``/dev/shm``, a
burst buffer; every process must see it, as orbax commits a step from process 0), keeping the last
:data:`FAST_KEEP`; the persistent tier (``checkpoint.dir``) then holds the interval saves only. Without it they
go to ``checkpoint.dir`` with the others (its ``keep`` policy applies to all).

Resume takes the newest complete step of either tier that reads back (a damaged one is set aside in its own
tier, as :meth:`jaxscale.checkpoint.store.Checkpointer.restore_latest` does), so a host lost after the fast tier's
last commit costs the steps since then.

Several processes must agree on starting a save (each writes its shards of it): process 0 decides (its save
committed) and publishes the answer under the step's key in the coordinator's key-value store, where the others
read it (Orbax's policy does the same); the key of the step :data:`KEPT_KEYS` before is deleted.

One tier's save is in flight at a time: a save into one waits for the other's to finish, and a continuous save
starts only where neither has one in flight. Two orbax managers saving at once in several processes fail on
their shared barrier ("Barrier ThreadSaveMultiHostValueHolder:set_value_start is already ongoing": orbax keys it
by a process-wide operation id), which ended process 1 eight times in a 23-minute run of benchmarks/goodput.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxscale.checkpoint.store import Checkpointer, CheckpointError, Restored, first_line
from jaxscale.config.read import Config, ConfigError, check_writable

FAST_KEEP = 2
KEPT_KEYS = 100
KEY = "jaxscale/continuous/{}"


class Tiers:
    """The run's checkpointers: the persistent one and, with ``checkpoint.fast_dir``, the fast one; what the loop
    asks of a :class:`~jaxscale.checkpoint.store.Checkpointer`, over both."""

    def __init__(self, persistent: Checkpointer, fast: Checkpointer | None = None, interval_s: float = 0.0):
        self.persistent, self.fast, self.interval_s = persistent, fast, interval_s
        self.last_start = -math.inf  # when the last continuous save started (process 0's clock)
        self.all = [persistent] if fast is None else [fast, persistent]
        self.directory = persistent.directory
        self.saved_before_failure: list[int] = []

    @classmethod
    def from_config(cls, config: Config) -> Tiers:
        ck = config.checkpoint
        fast = None
        if ck.fast_dir:
            check_writable(ck.fast_dir)
            fast = Checkpointer(ck.fast_dir, FAST_KEEP, 0, ck.async_save)
        return cls(Checkpointer.from_config(config), fast, ck.continuous_interval_s)

    def latest_step(self) -> int | None:
        """The newest complete step of either tier."""
        return max((s for t in self.all if (s := t.latest_step()) is not None), default=None)

    def _free(self) -> bool:
        """Whether no continuous save is in flight and the last started ``checkpoint.continuous_interval_s`` ago."""
        busy = any(t.manager.is_saving_in_progress() for t in self.all)
        free = not busy and time.monotonic() - self.last_start >= self.interval_s
        if free:
            self.last_start = time.monotonic()
        return free

    def due(self, step: int) -> bool:
        """Whether a continuous save starts after ``step`` updates (process 0's answer, for all: :meth:`_free`)."""
        if jax.process_count() == 1:
            return self._free()
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        if jax.process_index() == 0:
            free = self._free()
            client.key_value_set(KEY.format(step), str(int(free)))
            if step >= KEPT_KEYS:
                client.key_value_delete(KEY.format(step - KEPT_KEYS))
            return free
        return client.blocking_key_value_get(KEY.format(step), 600_000) == "1"

    def save(self, step: int, state: Any, data: dict, loop: dict, config: dict, quick: bool = False) -> None:
        """Start a save of ``step``: a continuous one (``quick``) into the fast tier if any, else the persistent."""
        tier = (self.fast or self.persistent) if quick else self.persistent
        for other in self.all:
            if other is not tier:  # one tier's save in flight at a time: see the module's docstring
                other.manager.wait_until_finished()
        try:
            tier.save(step, state, data, loop, config)
        except CheckpointError:
            self.saved_before_failure = tier.saved_before_failure
            raise

    def committed(self, block: bool = False) -> list[int]:
        """The steps committed since the last call, of either tier (:meth:`Checkpointer.committed`)."""
        done: list[int] = []
        for tier in self.all:
            try:
                done += tier.committed(block)
            except CheckpointError:
                self.saved_before_failure = done + tier.saved_before_failure
                raise
        return sorted(done)

    def remove_uncommitted(self) -> list[str]:
        return [name for tier in self.all for name in tier.remove_uncommitted()]

    def restore_latest(
        self, abstract_for: Callable[[Restored], Any], check: Callable[[Restored], None]
    ) -> tuple[Restored, list[str]]:
        """The newest step of either tier that reads back whole, and a line for each newer one that did not
        (set aside in its tier as ``<step>.damaged``; :meth:`Checkpointer.restore_latest`)."""
        candidates = sorted(((s, k) for k, tier in enumerate(self.all) for s in tier.all_steps()), reverse=True)
        damaged: list[list[tuple[int, str]]] = [[] for _ in self.all]
        for step, k in candidates:
            tier = self.all[k]
            try:
                restored = tier.read_json(step)
                check(restored)
                restored.state = tier.restore_state(abstract_for(restored), step)
            except ConfigError:
                raise
            except Exception as e:
                damaged[k].append((step, first_line(e)))
                continue
            return restored, [line for t, d in zip(self.all, damaged, strict=True) for line in t.set_aside(d, step)]
        reasons = "; ".join(f"step {s}: {why}" for d in damaged for s, why in d)
        where = " or ".join(str(t.directory) for t in self.all)
        raise ConfigError(f"no readable checkpoint in {where} ({reasons})")

    def close(self) -> None:
        for tier in self.all:
            tier.close()
