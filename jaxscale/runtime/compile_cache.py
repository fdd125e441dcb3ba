"""The persistent compilation cache of a training run (``xla.compile_cache``): a restart reads its programs back.

A process that restarts (after a lost peer, a preemption, a launcher's restart) would otherwise compile its step
again: minutes at scale. JAX's own persistent cache (``jax_compilation_cache_dir``) keeps each compiled executable
under a key that hashes the whole program it was compiled from (the StableHLO module: every shape, dtype, sharding,
constant such as the learning-rate schedule, donation), the devices and their topology, the compile options, the
XLA flags (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``), the jax and jaxlib versions and the backend's: a changed config
that changes the program is a new key and compiles anew (``tests/test_compile_cache.py``); one that does not
(``checkpoint.every``, ``train.log_every``) reuses the program, which is then the same program.

``xla.compile_cache``: ``auto`` (the default) is ``<run_dir>/compile_cache``, each run its own cache (it lives and
goes with the run; a restart of the run finds it), except where it is not safe or another cache is in effect:

- ``JAX_COMPILATION_CACHE_DIR`` (or ``jax_compilation_cache_dir``) already set: that cache is used;
- ``JAX_ENABLE_COMPILATION_CACHE=0`` or false: none;
- ``--xla_dump_to`` among the XLA flags: none (the key leaves the dump directory out, so a program read back would
  not be dumped).

``off``: none; any other value: that directory. Only process 0 writes entries (JAX's rule); the others read, so
in a multi-host run the directory must be shared (as ``run_dir`` is for the checkpoints) for them to hit. Every
compile is kept, however short (``jax_persistent_cache_min_compile_time_secs`` 0 unless set in the environment):
a restart's first step waits for the initialisation and evaluation programs too. The directory is trusted code
(JAX's warning): keep it where only the run's owner can write.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

from jaxscale.config.read import Config

DIR_NAME = "compile_cache"
HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
_COUNTS = {HIT: 0, MISS: 0}
_LOCK = threading.Lock()


def directory(config: Config, environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory ``xla.compile_cache`` resolves to in ``environ`` (this module's docstring), or None for none."""
    env = os.environ if environ is None else environ
    setting = config.xla.compile_cache
    if setting == "off" or env.get("JAX_ENABLE_COMPILATION_CACHE", "1").lower() in ("0", "false"):
        return None
    if setting != "auto":
        return Path(setting).absolute()
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"]).absolute()
    if "--xla_dump_to" in env.get("XLA_FLAGS", "") or any("xla_dump_to" in f for f in config.xla.flags):
        return None
    return (Path(config.run_dir) / DIR_NAME).absolute()


def enable(config: Config) -> Path | None:
    """Put the run's compilation cache in effect (before its first compile) and count its hits; its directory."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = directory(config)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # the next compile opens the new directory
    count_events()
    return path


def count_events() -> None:
    """Count the persistent cache's hits and misses in this process (once: a listener of jax's events)."""
    import jax

    if getattr(count_events, "listening", False):
        return

    def listen(event: str, **_: object) -> None:
        if event in _COUNTS:
            with _LOCK:
                _COUNTS[event] += 1

    jax.monitoring.register_event_listener(listen)
    count_events.listening = True  # type: ignore[attr-defined]


def counts() -> tuple[int, int]:
    """The hits and misses of the persistent cache counted so far in this process (counting from the first call)."""
    count_events()
    with _LOCK:
        return _COUNTS[HIT], _COUNTS[MISS]


def outcome(before: tuple[int, int]) -> str:
    """What became of the compiles since ``before`` (:func:`counts`): ``hit`` (all read back), ``miss`` (some
    compiled), or ``off`` (the cache was not asked)."""
    hits, misses = (now - was for now, was in zip(counts(), before, strict=True))
    return "miss" if misses else "hit" if hits else "off"
