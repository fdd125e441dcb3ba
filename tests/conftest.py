"""Eight simulated CPU devices and fast compiles for every test, set before jax is imported; the session's fixtures."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM's expensive passes off, here and in the jaxscale processes tests start (they inherit the environment):
# compiles take about half the CPU time; the optimised HLO (partitioning, collectives, buffers) is the same,
# and every result is checked against a run compiled the same way. tests/test_calibrate.py, which times
# steps, turns them back on where it times. JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite fully optimised.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One persistent compilation cache for the test session: a new directory made by the process pytest starts in,
# shared through the environment with its xdist workers and every jaxscale process the tests start, so a step
# compiled once is read back elsewhere. Every compile is written. A read-back executable still emits the compile
# event (helpers.compilations counts it); XLA's dumps need a real compile (helpers.partitioned_hlo compiles with
# the cache off). JAX_ENABLE_COMPILATION_CACHE=0 turns it off. JAXSCALE_TEST_JIT_CACHE names a directory kept
# between sessions instead (.ci/run's, one per Python): jax's key hashes the program, the devices, the flags and
# the versions, so only programs compiled before exactly as they are now are read back.
# (jax 0.10's XLA:CPU deadlocked in 4 of 8 runs of the mxfp8 fsdp_tp step read back from the cache, its all-gathers
# inside the conditional lax.platform_dependent left around the block-scaled GEMM: the kernel is chosen when traced
# now, layout.sharding.platform.)
if "PYTEST_XDIST_WORKER" not in os.environ:
    kept = os.environ.get("JAXSCALE_TEST_JIT_CACHE")
    if kept:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = kept
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxscale-tests-jit-")
        atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
# A bounded cache is a locked one: jax then reads and writes each entry holding a file lock (the filelock package).
# Unbounded, it writes an entry in place with no lock, and two processes compiling one program at once (the two
# workers, or a worker and a jaxscale process it started) can leave it torn, or a third read it half written; jax
# checks nothing on reading an executable back. 8 GiB: the least recently used entries go past it.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 * 2**30)

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# After the devices are set up:
from helpers import (  # noqa: E402
    CURVE,
    CURVE_SEEDS,
    CURVE_STEPS,
    Curve,
    Run,
    Trainers,
    loss_curves,
    memory_maps,
    run_steps,
    tiny_config,
)

from jaxscale.data.prepare import prepare_data  # noqa: E402
from jaxscale.training.trainer import Trainer  # noqa: E402

MEASURED_SLOW = Path(__file__).with_name("measured_slow.txt")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests measured as slow on 3.12 (tests/measured_slow.txt): ``-m "not slow"`` leaves them out."""
    listed = {line for line in MEASURED_SLOW.read_text().splitlines() if line and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


SHARED = Trainers()


@pytest.fixture(scope="session")
def trainers() -> Trainers:
    """Built trainers and compiled steps shared by the whole session (:class:`helpers.Trainers`)."""
    return SHARED


# XLA:CPU maps each compiled program's code and data apart: a tiny train step holds about 600 mappings while it
# lives. A worker that keeps every step it compiled (SHARED, jax's own caches) passes Linux's vm.max_map_count
# (65,530 by default) after about a hundred; then the next mmap fails and LLVM's JIT aborts ("Unable to allocate
# section memory") or XLA segfaults, in whatever compiles next. That was the workers' crash at random tests
# (a core file showed 65,532 mappings). Past half the limit, the worker lets them go, and recompiles what it needs.
LIMIT = Path("/proc/sys/vm/max_map_count")
MAX_MAPS = int(LIMIT.read_text()) if LIMIT.exists() else 0


@pytest.fixture(autouse=True)
def bounded_memory_maps():
    """After each test, past half of vm.max_map_count: the shared steps and jax's caches released."""
    yield
    if MAX_MAPS and memory_maps() > MAX_MAPS // 2:
        SHARED.release()


@pytest.fixture(scope="session")
def one_device(trainers) -> Run:
    """The test model (rules dp) on one device, two steps: the run every layout must reproduce."""
    return run_steps(*trainers.step(devices=1))


@pytest.fixture(scope="session")
def curve_batches() -> list:
    """The batches of the loss curves (:data:`helpers.CURVE`), on one device."""
    trainer = Trainer.build(tiny_config(*CURVE), jax.devices()[:1])
    return [trainer.batch(k) for k in range(CURVE_STEPS)]


@pytest.fixture(scope="session")
def bf16_curve() -> Curve:
    """The test model's bf16 curve (compute copy and fp32 master, no fp8) from seed 0 (on :func:`curve_batches`):
    what test_precision holds its variants to."""
    return loss_curves(seeds=1)[0]


@pytest.fixture(scope="session")
def bf16_curves(bf16_curve) -> list[Curve]:
    """The bf16 curves from :data:`helpers.CURVE_SEEDS` seeds (seed 0's is :func:`bf16_curve`): what test_fp8
    holds its variants to. A worker that runs test_precision alone makes seed 0's only."""
    return [bf16_curve, *loss_curves(seeds=range(1, CURVE_SEEDS))]


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    """Byte tokens of 400 documents of 3 to 30 letters: a 32-token sequence holds several, whole or cut."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("docs")
    lines = ["".join(rng.choice(list("abcdefgh"), rng.integers(3, 31))) for _ in range(400)]
    (root / "docs.jsonl").write_text("".join(f'{{"text": "{line}"}}\n' for line in lines))
    prepare_data([root / "docs.jsonl"], root / "tokens", val_fraction=0.0)
    return root / "tokens"
