"""Preemption: SIGTERM, or a first Ctrl-C, sets a flag that the loop reads at the next step boundary
(with several processes, jax's preemption sync point makes them agree on the step); a second Ctrl-C
exits at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils


class Preemption:
    """A context in which SIGTERM, or a first Ctrl-C (SIGINT), asks the loop to stop at the next step boundary.

    One process: a signal handler sets a flag and keeps the signal's name (the previous handlers come
    back on exit); a second Ctrl-C exits at once (status 130) with one line. Several processes: jax's
    preemption sync point, which the coordination service raises on SIGTERM to any of them, so that
    all stop at the same step (Ctrl-C there is Python's KeyboardInterrupt).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # SIGTERM or SIGINT, once one came
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal == "SIGINT":
            print("jaxscale: interrupted again (Ctrl-C): exiting at once, the step in progress not saved",
                  file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        self.signal = self.signal or signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)

    def reached(self, step: int) -> bool:
        """Whether to stop after ``step`` updates."""
        if jax.process_count() > 1:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = "SIGTERM"
                return True
            return False
        return self.requested
