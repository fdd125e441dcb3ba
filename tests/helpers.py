"""What several test modules share: the tiny test model, tree comparisons, the compile monitor,
the subprocess environment, and a cache of built trainers (the ``trainers`` fixture of conftest.py).

Imported after conftest.py has set up the simulated devices.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxscale.config.read import Config, ConfigError, load_config
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5  # fp32 agreement of a layout with one device

# A model small enough to compile in seconds, with every dimension divisible by 8.
TINY = [
    "model.vocab_size=256",
    "model.embed=64",
    "model.layers=2",
    "model.heads=8",
    "model.kv_heads=4",
    "model.head_dim=8",
    "model.mlp=128",
    "train.global_batch=16",
    "train.seq_len=32",
    "train.steps=2",
    "train.warmup_steps=1",
    "train.learning_rate=0.01",
    "data.max_bytes=200000",
]


def tiny_config(*overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None) -> Config:
    """The test model with a rules preset and mesh sizes (unnamed axes are 1)."""
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 1, **(mesh or {})}
    mesh_args = [f"mesh.{k}={v}" for k, v in sizes.items()]
    return load_config(None, [*TINY, f"rules={rules}", *mesh_args, *overrides])


class Trainers:
    """Trainers and compiled train steps made once per test session, keyed by their :func:`tiny_config`
    arguments and device count (the ``trainers`` fixture).

    For tests that only read a trainer, or run steps from states of their own: a step compiled for
    one test module is not compiled again for the next.
    """

    def __init__(self) -> None:
        self._built: dict[tuple[Any, ...], Trainer] = {}
        self._compiled: dict[tuple[Any, ...], Any] = {}

    @staticmethod
    def _key(overrides: tuple[str, ...], rules: str, mesh: dict[str, int] | None, devices: int | None) -> tuple:
        return overrides, rules, tuple(sorted((mesh or {}).items())), devices

    def get(
        self, *overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None, devices: int | None = None
    ) -> Trainer:
        key = self._key(overrides, rules, mesh, devices)
        if key not in self._built:
            chosen = None if devices is None else jax.devices()[:devices]
            self._built[key] = Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh), chosen)
        return self._built[key]

    def step(
        self, *overrides: str, rules: str = "dp", mesh: dict[str, int] | None = None, devices: int | None = None
    ) -> tuple[Trainer, Any]:
        """The trainer and its train step compiled from the abstract state and batch."""
        trainer = self.get(*overrides, rules=rules, mesh=mesh, devices=devices)
        key = self._key(overrides, rules, mesh, devices)
        if key not in self._compiled:
            self._compiled[key] = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        return trainer, self._compiled[key]

    def release(self) -> None:
        """Forget every trainer and compiled step, empty jax's caches and collect, so their executables (and
        XLA:CPU's memory mappings) go; the next use builds anew (tests/conftest.py's map guard)."""
        self._built.clear()
        self._compiled.clear()
        jax.clear_caches()
        gc.collect()


def memory_maps() -> int:
    """How many memory mappings this process holds (the lines of /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as maps:
        return maps.read().count(b"\n")


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(tree: Any, ref: Any, rtol: float = RTOL) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for (path, x), r in zip(flat, jax.tree.leaves(ref), strict=True):
        err = rel_err(jax.device_get(x), jax.device_get(r))
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol:.0e}"


def assert_trees_equal(tree: Any, ref: Any) -> None:
    """Every leaf of ``tree`` bit for bit that of ``ref``."""
    for a, b in zip(jax.tree.leaves(jax.device_get(tree)), jax.tree.leaves(jax.device_get(ref)), strict=True):
        np.testing.assert_array_equal(a, b)


def subprocess_env(xla_flags: str | None = "--xla_force_host_platform_device_count=8") -> dict[str, str]:
    """The environment for a jaxscale subprocess: this checkout's code, CPU devices as asked."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return env


# Timed around XLA's compile or the read of its executable from the persistent compilation cache: both count.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# Generous: a failing build takes well under a second; compiling the train step takes several.
MAX_SECONDS = 10.0


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """The names of the functions XLA compiles inside the block."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE:
            compiled.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def fails_early(match: str) -> Iterator[pytest.ExceptionInfo[ConfigError]]:
    """Expect a one-line ConfigError matching ``match``, raised quickly and with nothing compiled.

    Errors raised while jax traces the step carry a note about filtered frames, which
    ``pytest.raises`` matches too: patterns for those do not end in ``$``. The CLI prints
    ``str(error)`` alone, which must be one line.
    """
    start = time.perf_counter()
    with compilations() as compiled, pytest.raises(ConfigError, match=match) as info:
        yield info
    elapsed = time.perf_counter() - start
    assert compiled == [], f"compiled {compiled} before raising: {info.value}"
    assert elapsed < MAX_SECONDS, f"took {elapsed:.1f}s to raise: {info.value}"
    assert "\n" not in str(info.value), f"message is not one line: {info.value!r}"



@contextlib.contextmanager
def no_compilation_cache() -> Iterator[None]:
    """XLA compiles what is compiled inside the block: the session's persistent compilation cache (conftest.py),
    whose keys leave out ``xla_dump_to``, would answer a compiled program without dumping it."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def partitioned_hlo(trainer: Trainer, directory: str | Path) -> str:
    """The train step's HLO right after SPMD partitioning, dumped by XLA into ``directory``: the collectives in
    the dtypes the model asks for (XLA:CPU's later passes widen bf16 collectives to f32)."""
    options = {"xla_dump_to": str(directory), "xla_dump_hlo_pass_re": "^spmd-partitioning$"}
    with no_compilation_cache():
        trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile(compiler_options=options)
    (path,) = Path(directory).glob("*train_step*after_spmd-partitioning*.txt")
    return path.read_text()


class Run(NamedTuple):
    """A few steps of a trainer from its initial state."""

    trainer: Trainer
    loss: float  # at the initial parameters, on batch 0
    grads: Any  # likewise
    params: Any  # after the steps
    metrics: list[dict[str, Any]]  # of each step, on the host
    hlo: str  # the compiled step's optimised HLO


def run_steps(trainer: Trainer, compiled: Any = None, steps: int = 2) -> Run:
    """Loss and gradients at the initial parameters, then ``steps`` steps of the compiled train step
    (``compiled``, or compiled here)."""
    state = trainer.init_state()
    loss, grads = trainer.loss_and_grads(state.params, trainer.batch(0))
    if compiled is None:
        compiled = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    metrics = []
    for step in range(steps):
        state, out = compiled(state, trainer.batch(step))
        metrics.append(jax.device_get(out))
    return Run(trainer, float(loss), grads, state.params, metrics, compiled.as_text())


# The loss curves of tests/test_fp8.py and tests/test_precision.py: the test model in bf16 learning for 200 steps.
CURVE_STEPS = 200
# One run's curve moves by up to 0.08 (20-step means) when 3 elements of its initial weights move a bf16 ulp
# (loss_curve): a variant is compared with bf16 on the mean over seeds of the two curves' difference.
CURVE_SEEDS = 4
CURVE = ("model.dtype=bfloat16", f"train.steps={CURVE_STEPS}", "train.learning_rate=0.003", "train.warmup_steps=10")


class Curve(NamedTuple):
    losses: np.ndarray  # of each step (float64)
    state: Any  # after the last step


@contextlib.contextmanager
def optimized_codegen() -> Iterator[None]:
    """LLVM's expensive passes on for what compiles inside the block (conftest.py turns them off)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def loss_curve(*overrides: str, batches: list[dict[str, jax.Array]]) -> Curve:
    """:data:`CURVE` with ``overrides`` on one device, a step on each of ``batches``. The step runs 200 times:
    compiled with LLVM's optimisations, it takes less CPU time in all (on 2 cores: 7 s to compile, 4 s for
    the steps, against 4 s and 11 s without). The initial state too, as jaxscale makes it: on jax 0.12 the
    initialisation compiled without them rounds 3 elements of the bf16 compute copy to the neighbouring
    value, which moves the bf16 curve by up to 0.135 nats at a step and its 20-step means by 0.08 (a
    delayed fp8 curve then 0.106 from bf16's where it is 0.059)."""
    trainer = Trainer.build(tiny_config(*CURVE, *overrides), jax.devices()[:1])
    with optimized_codegen():
        step = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        state = trainer.init_state()
    return _curve(step, state, batches)


def loss_curves(*overrides: str, seeds: int | range) -> list[Curve]:
    """:func:`loss_curve` from each of ``seeds`` (an int n: seeds 0 to n - 1; ``train.seed``: the initial weights
    and the batches), the step compiled once (its program is the same for every seed)."""
    step, curves = None, []
    for seed in range(seeds) if isinstance(seeds, int) else seeds:
        trainer = Trainer.build(tiny_config(*CURVE, *overrides, f"train.seed={seed}"), jax.devices()[:1])
        with optimized_codegen():
            step = step or trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
            state = trainer.init_state()
        curves.append(_curve(step, state, [trainer.batch(k) for k in range(CURVE_STEPS)]))
    return curves


def _curve(step: Any, state: Any, batches: list[dict[str, jax.Array]]) -> Curve:
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return Curve(np.asarray(jax.device_get(losses), np.float64), state)
