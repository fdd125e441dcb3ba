"""The run's persistent compilation cache: where it is, that a restart reads the step back, and that a changed
config compiles its own program (its result that config's, not the cached one's)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiny_config
from jax.experimental.compilation_cache import compilation_cache

from jaxscale.config.read import ConfigError
from jaxscale.runtime import compile_cache
from jaxscale.training.trainer import Trainer


@pytest.mark.parametrize(
    ("setting", "env", "flags", "want"),
    [
        ("auto", {}, [], "RUN/compile_cache"),
        ("auto", {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}, [], "/elsewhere"),
        ("auto", {"JAX_ENABLE_COMPILATION_CACHE": "0"}, [], None),
        ("auto", {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, [], None),
        ("auto", {}, ["--xla_dump_to=/tmp/d"], None),
        ("off", {}, [], None),
        ("/mine", {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}, [], "/mine"),
    ],
)
def test_where_the_cache_is(tmp_path, setting, env, flags, want):
    config = tiny_config(f"run_dir={tmp_path}", f"xla.compile_cache={setting}", f"xla.flags={flags}")
    got = compile_cache.directory(config, env)
    assert got == (None if want is None else Path(want.replace("RUN", str(tmp_path))))


def test_off_in_yaml_and_an_empty_setting(tmp_path):
    assert tiny_config("xla.compile_cache=off").xla.compile_cache == "off"
    with pytest.raises(ConfigError, match=r"xla\.compile_cache: give auto, off or a directory"):
        tiny_config("xla.compile_cache=' '")


@pytest.fixture
def run_cache(tmp_path):
    """``xla.compile_cache`` pointing at a fresh directory for the test; the session's cache back after it."""
    before = jax.config.jax_compilation_cache_dir
    yield tmp_path / "cache"
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def compiled(*overrides: str) -> tuple[Trainer, str]:
    """A new trainer of the tiny config on one device, its step compiled; whether the cache answered."""
    trainer = Trainer.build(tiny_config("mesh.data=1", *overrides), jax.devices()[:1])
    before = compile_cache.counts()
    _ = trainer.compiled_guarded_step
    return trainer, compile_cache.outcome(before)


def first_lr(trainer: Trainer) -> float:
    """The learning rate the compiled step reports at step 0 (its program's schedule)."""
    step, _ = trainer.compiled_guarded_step
    _, out = step(trainer.init_state(), trainer.batch(0))
    return float(out["lr"])


def test_a_restart_reads_the_step_back_and_a_changed_config_compiles_anew(run_cache):
    cache = [f"xla.compile_cache={run_cache}"]
    assert compile_cache.enable(tiny_config(*cache)) == run_cache
    first, how = compiled(*cache)
    assert how == "miss"
    entries = set(run_cache.iterdir())
    again, how = compiled(*cache)  # a restarted process: a new trainer, the same config
    assert how == "hit"
    assert set(run_cache.iterdir()) == entries
    # A changed learning rate changes the program (the schedule is in it): compiled anew, and the step reports
    # that config's rate (warmup of 1 step from 0: the rate at step 0 is 0; the peak is at step 1).
    other, how = compiled(*cache, "train.learning_rate=0.02", "train.warmup_steps=0")
    assert how == "miss"
    assert first_lr(other) == pytest.approx(0.02)
    assert first_lr(again) == pytest.approx(0.0)
    # A changed shape: compiled anew too.
    _, how = compiled(*cache, "model.mlp=64")
    assert how == "miss"
    # A change the program does not see (how often to log) reuses it.
    _, how = compiled(*cache, "train.log_every=3")
    assert how == "hit"
    # The executable read back computes what the compiled one does.
    state = first.init_state()
    a = jax.device_get(first.compiled_guarded_step[0](first.init_state(), first.batch(0))[1]["loss"])
    b = jax.device_get(again.compiled_guarded_step[0](state, again.batch(0))[1]["loss"])
    np.testing.assert_array_equal(a, b)
