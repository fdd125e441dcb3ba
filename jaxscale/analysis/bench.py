"""``jaxscale bench``: step time, tokens/s, TFLOP/s, MFU, compile time and host overhead, as JSON.

The suites are data (``configs/bench/suites.yaml``): each entry is a name and ``--set`` overrides of
the base experiment (``configs/experiments/bench.yaml``: the tiny model, FSDP over every device
present, so it runs on any backend). ``quick`` is the tiny model for a few steps (what the test
runs); ``full`` the size ladder tiny, llama-150m, llama-1b (``--models`` picks; on a CPU only the
tiny one is quick); ``compile`` lowers and compiles, without running, the step at 2, 8 and 32
layers of the base model's width (the scanned layer stack should keep it nearly flat);
``options`` runs each option (FP8, TP collective matmul, XLA preset, chunked loss, blockwise
attention) on top of the baseline. A run whose config this build rejects (a key another branch
adds, a value it refuses) is a ``skipped`` row with the one-line :class:`ConfigError`; any other
failure (out of memory, a backend that cannot compile it) an ``error`` row; neither ends the suite.
XLA reads its flags once, when the backend starts, so a row whose ``xla.preset`` or ``xla.flags``
this process started without (the ``xla_preset`` variant) is measured by a child process started
with them. Each row is printed as it finishes. Before anything runs, a suite whose run the analytic
model predicts larger than 0.9 of the machine's memory is refused in one line (:func:`check_memory`).

How one run is measured, through the :class:`~jaxscale.training.trainer.Trainer` API:

1. ``lower_time_s``, ``compile_time_s``: ``trainer.jit_step.lower(abstract state, abstract batch)``
   (tracing to StableHLO) and ``.compile()`` (XLA), timed apart, in wall time and (``*_cpu_time_s``)
   in this process's CPU time, which other work on a shared machine does not inflate; ``memory`` is the compiled
   executable's ``memory_analysis()`` per device (:func:`jaxscale.analysis.xla.memory`) and, where the
   runtime keeps allocator statistics (GPU, TPU), ``device_peak_bytes``: the device's peak so far in
   this process (the runs share the process, so it never goes down from one row to the next).
2. The state is initialised on the devices and one batch (``trainer.batch(0)``) loaded before any
   timing: the input pipeline is not measured. ``warmup`` steps (and one run of the loop of 6) go
   first, untimed. Then 3, 4 and 6 are measured in turn, ``rounds`` times; each figure is the best
   of its rounds (timeit's convention: other work on the machine only ever adds time).
3. ``step_time_blocked_s``: the median of ``steps`` steps each waited for
   (``jax.block_until_ready``): what a loop that reads every step's result before the next sees.
4. ``step_time_s``: ``steps`` steps dispatched back to back, one ``block_until_ready`` at the end,
   wall time / steps: the steady state under asynchronous dispatch, which is how the training loop
   runs (it reads a step's metrics after dispatching the next). ``tokens_per_s``,
   ``tflops_per_device`` and ``mfu`` come from it, with :func:`jaxscale.config.flops.flops_per_token`
   (docs/formulas.md: 6·Ψ_matmul + causal attention; recomputation not counted) and the peak table of
   :mod:`jaxscale.config.flops` (``train.peak_flops`` overrides it). The CPU peak is a nominal 1e11
   FLOP/s: an MFU on CPU is meaningless.
5. ``dispatch_time_s``: the host's time per call in 4 (the call returns once the step is enqueued).
6. ``device_step_time_s``: the same jitted step run ``steps`` times inside one executable
   (``lax.fori_loop`` over ``trainer.jit_step``, one dispatch, one wait), wall time / steps: the
   devices' time per step with no host work between steps, measured without a profiler. XLA
   compiles the loop body as it compiles the step; it may place buffers differently, which is why
   it is reported next to, not instead of, ``step_time_s``.
7. ``host_overhead_s`` = max(0, ``step_time_s`` − ``device_step_time_s``): the time per step the
   devices wait for the host in the steady state (zero when dispatch keeps ahead of the devices);
   ``host_overhead_blocked_s`` = ``step_time_blocked_s`` − ``device_step_time_s``: the gap per step
   when the host waits for each step (dispatch, launch and the wait's round trip).

With ``--predict CLUSTER`` each row also carries the analytic model's figures for the same trainer
(:func:`jaxscale.analysis.predict.predict_trainer` on that cluster file): ``predicted_step_time_s``,
``predicted_mfu``, the predicted parts (``predicted``: matmuls, attention, memory-bound work,
optimizer, recompute, exposed communication) and ``predicted_ratio`` = predicted / measured step time:
how far the plan's cost model is from these devices (``jaxscale plan --calibrate`` writes the file).

MaxText times each step on the host from one step's completion to the next
(``step_time_delta``; its metrics are written one step behind so that the host does not block);
Levanter logs a step's wall ``duration`` next to the host's ``loading_time`` and ``hook_time``; both
leave the devices' idle time to a profiler trace. The fused loop of 6 gets the device's side of
that difference without one. On XLA:CPU the "devices" are threads of the host's own cores, which
the Python thread shares: there the host overhead shows the cost of dispatch, not of a real
accelerator's idle gaps.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import jax

from jaxscale.analysis.bench_suites import SUITES_FILE, Run, load_suites, plan
from jaxscale.analysis.bench_table import header, row_line
from jaxscale.analysis.params import trainer_inputs
from jaxscale.analysis.predict import predict
from jaxscale.analysis.remat import USABLE, resolved
from jaxscale.analysis.xla import memory
from jaxscale.config import flops
from jaxscale.config.mesh_size import requested_devices
from jaxscale.config.read import CONFIG_DIR, ConfigError, load_config
from jaxscale.runtime import xla_flags
from jaxscale.training.trainer import Trainer

SCHEMA = "jaxscale.analysis.bench/1"
BASE_CONFIG = CONFIG_DIR / "experiments" / "bench.yaml"
PARTS = ("matmul", "attention", "memory_bound", "optimizer", "recompute", "exposed", "bubble")
TIMES = (
    "step_time_s", "step_time_blocked_s", "device_step_time_s", "dispatch_time_s", "tokens_per_s",
    "tflops_per_device", "mfu", "host_overhead_s", "host_overhead_blocked_s", "loss",
)












def available_memory(device: jax.Device) -> tuple[int | None, bool]:
    """(bytes, shared): an accelerator's own memory (the runtime's ``bytes_limit``; None where it keeps no
    statistics), or on a CPU the host's available memory (``MemAvailable``), which simulated devices share."""
    if device.platform != "cpu":
        stats = device.memory_stats()
        return (stats.get("bytes_limit") if stats else None), False
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), True
    except (OSError, StopIteration):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), True


# The share of a CPU host's available memory the simulated devices' step may use: the host also holds XLA's
# compiler and the runtime's copies beside it. The README's llama-150m run at 1024 tokens, predicted 21.5 GB,
# was still growing at 21.9 GB after 9.5 minutes with 24.5 GB available.
HOST_USABLE = 0.8


def check_memory(runs: list[Run], config: str | Path | None) -> None:
    """Raise :class:`ConfigError` if the analytic model predicts a run of ``runs`` larger than the share of
    the memory it would run in that a step may use (:func:`available_memory` times the planner's
    :data:`~jaxscale.analysis.remat.USABLE`, 0.9, on a device: the rest is the compiler's and the runtime's; on
    a CPU :data:`HOST_USABLE` of the host's, for all its devices together, with activations in float32, as
    XLA:CPU computes a bf16 model). Runs that compile only, and configs this build rejects (their rows say so),
    are not checked."""
    for run in runs:
        if run.compile_only:
            continue
        try:
            cfg = load_config(config, run.overrides)
            devices = jax.devices()[: requested_devices(cfg.mesh) or None]
            with warnings.catch_warnings():  # the run itself warns (XLA flags this process lacks, ...)
                warnings.simplefilter("ignore")
                trainer = Trainer.build(resolved(cfg, devices), devices)  # model.remat: auto by memory
        except ConfigError:
            continue
        device = trainer.mesh.devices.flat[0]
        available, shared = available_memory(device)
        model = replace(cfg.model, dtype="float32") if device.platform == "cpu" else cfg.model
        per_device = predict(model, *trainer_inputs(trainer)).memory["total"]
        need = per_device * (trainer.mesh.size if shared else 1)
        usable = HOST_USABLE if shared else USABLE
        if available is not None and need > available * usable:
            devices = f"{per_device / 1e9:.2f} GB x {trainer.mesh.size} CPU devices" if shared else "per device"
            raise ConfigError(
                f"bench: run '{run.name}' needs {need / 1e9:.1f} GB ({devices}, the analytic model's prediction) but "
                f"a step may use {available * usable / 1e9:.1f} GB ({usable:g} of the {available / 1e9:.1f} GB "
                "available): leave it out (--models, --variants) or shrink it (--set)"
            )


def timed_compile(trainer: Trainer) -> tuple[Any, dict[str, float]]:
    """The trainer's step lowered and compiled from abstract values; the two times apart, each as wall
    time and as this process's CPU time (all its threads: what other processes on the machine do not inflate)."""
    state, batch = trainer.abstract_state(), trainer.abstract_batch()
    start, start_cpu = time.perf_counter(), time.process_time()
    lowered = trainer.jit_step.lower(state, batch)
    lowered_at, lowered_cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    return compiled, {
        "lower_time_s": lowered_at - start,
        "compile_time_s": time.perf_counter() - lowered_at,
        "compile_cpu_time_s": time.process_time() - lowered_cpu,
        "lower_cpu_time_s": lowered_cpu - start_cpu,
    }


def device_loop(trainer: Trainer, steps: int) -> Any:
    """``steps`` train steps in one executable (``lax.fori_loop`` over ``trainer.jit_step``), compiled."""

    def run(state: Any, batch: dict[str, jax.Array]) -> Any:
        return jax.lax.fori_loop(0, steps, lambda _, s: trainer.jit_step(s, batch)[0], state)

    batch_shardings = dict.fromkeys(("inputs", "targets", "positions"), trainer.batch_sharding)
    jitted = jax.jit(
        run,
        in_shardings=(trainer.state_shardings, batch_shardings),
        out_shardings=trainer.state_shardings,
        donate_argnums=0,
    )
    return jitted.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()


def _memory(compiled: Any, trainer: Trainer) -> dict[str, int | None]:
    stats = trainer.mesh.devices.flat[0].memory_stats()
    peak = stats.get("peak_bytes_in_use") if stats else None
    return {**memory(compiled), "device_peak_bytes": None if peak is None else int(peak)}


def measure(trainer: Trainer, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Compile, then time ``steps`` steps three ways, ``rounds`` times (see the module docstring); the row's
    figures, each the best of its rounds."""
    compiled, times = timed_compile(trainer)
    loop = device_loop(trainer, steps)
    state = trainer.init_state()
    batch = trainer.batch(0)
    for _ in range(warmup):
        state, out = compiled(state, batch)
    state = jax.block_until_ready(loop(state, batch))  # the first run of an executable pays for its setup

    blocked, pipelined, dispatch, device = [], [], [], []
    for _ in range(rounds):
        each = []
        for _ in range(steps):
            start = time.perf_counter()
            state, out = compiled(state, batch)
            jax.block_until_ready((state, out))
            each.append(time.perf_counter() - start)
        blocked.append(statistics.median(each))

        calls = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            call = time.perf_counter()
            state, out = compiled(state, batch)
            calls += time.perf_counter() - call
        jax.block_until_ready((state, out))
        pipelined.append((time.perf_counter() - start) / steps)
        dispatch.append(calls / steps)

        start = time.perf_counter()
        state = jax.block_until_ready(loop(state, batch))
        device.append((time.perf_counter() - start) / steps)
    loss = float(out["loss"])
    step_time, blocked_time, device_time = min(pipelined), min(blocked), min(device)

    t, n = trainer.config.train, trainer.mesh.size
    tokens = t.global_batch * t.seq_len
    model_flops = flops.flops_per_token(trainer.config.model, t.seq_len) * tokens
    peak = flops.peak_flops(trainer.mesh.devices.flat[0], t.peak_flops)
    return {
        **times,
        "step_time_s": step_time,
        "step_time_blocked_s": blocked_time,
        "device_step_time_s": device_time,
        "dispatch_time_s": min(dispatch),
        "tokens_per_s": tokens / step_time,
        "tflops_per_device": model_flops / step_time / n / 1e12,
        "mfu": model_flops / step_time / (peak * n),
        "host_overhead_s": max(0.0, step_time - device_time),
        "host_overhead_blocked_s": blocked_time - device_time,
        "loss": loss,
        "memory": _memory(compiled, trainer),
    }


def _describe(trainer: Trainer) -> dict[str, Any]:
    c = trainer.config
    m = c.model
    model = {k: getattr(m, k) for k in ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab_size",
                                        "dtype", "remat", "attention")}
    return {
        "model": model,
        "params": flops.param_count(m)["total"],
        "mesh": {axis: int(size) for axis, size in trainer.mesh.shape.items()},
        "rules": trainer.rules.name,
        "global_batch": c.train.global_batch,
        "seq_len": c.train.seq_len,
    }


def predicted(trainer: Trainer, cluster: str | Path, step_time: float) -> dict[str, Any]:
    """The analytic model's step time, MFU and parts for ``trainer`` on the cluster file, against ``step_time``."""
    from jaxscale.analysis.cluster import load_cluster
    from jaxscale.analysis.predict import predict_trainer

    time_ = predict_trainer(trainer, load_cluster(str(cluster))).time
    assert time_ is not None
    return {
        "predicted_step_time_s": time_["total"],
        "predicted_mfu": time_["mfu"],
        "predicted_ratio": time_["total"] / step_time,
        "predicted": {k: time_[k] for k in PARTS},
    }


def run_one(
    suite: str, run: Run, config: str | Path | None, steps: int, warmup: int, rounds: int = 1,
    cluster: str | Path | None = None,
) -> dict[str, Any]:
    """One result row, on as many of the devices as the mesh asks for (all where an axis is -1); a rejected
    config is ``skipped``, any other failure ``error``, with its message; with a ``cluster`` file, the
    analytic model's prediction beside the measurement (:func:`predicted`)."""
    row: dict[str, Any] = {
        "suite": suite, "name": run.name, "model": None, "params": None, "overrides": run.overrides,
        "mesh": None, "rules": None, "global_batch": None, "seq_len": None,
        "steps": 0 if run.compile_only else steps, "rounds": 0 if run.compile_only else rounds,
        "lower_time_s": None, "compile_time_s": None,
        "lower_cpu_time_s": None, "compile_cpu_time_s": None,
        **dict.fromkeys(TIMES), "memory": None, "status": "ok", "error": None,
    }
    try:
        cfg = load_config(config, run.overrides)
        fresh = xla_flags.environment(cfg.xla, os.environ)
        if any(os.environ.get(var) != value for var, value in fresh.items()):
            return _in_fresh_process(row, suite, run, config, steps, warmup, rounds, fresh, cluster)
        devices = jax.devices()[: requested_devices(cfg.mesh) or None]
        trainer = Trainer.build(resolved(cfg, devices), devices)  # model.remat: auto by memory
        row.update(_describe(trainer))
        if run.compile_only:
            compiled, times = timed_compile(trainer)
            row.update(times, memory=_memory(compiled, trainer))
        else:
            row.update(measure(trainer, steps, warmup, rounds))
            if cluster is not None:
                row.update(predicted(trainer, cluster, row["step_time_s"]))
    except ConfigError as e:
        row.update(status="skipped", error=str(e))
    except Exception as e:  # one failing run (out of memory, an op the backend lacks) must not end the suite
        message = str(e).strip().splitlines()
        row.update(status="error", error=f"{type(e).__name__}: {message[0] if message else ''}")
    gc.collect()
    return row


def _in_fresh_process(
    row: dict[str, Any], suite: str, run: Run, config: str | Path | None, steps: int, warmup: int, rounds: int,
    flags: dict[str, str], cluster: str | Path | None,
) -> dict[str, Any]:
    """``run`` measured by a child process started with ``flags`` in its environment: XLA reads its flags
    once, when the backend starts, so a row with other flags (``xla.preset``, ``xla.flags``) than this
    process's cannot run here."""
    request = json.dumps({"suite": suite, "name": run.name, "overrides": run.overrides, "compile_only":
                          run.compile_only, "config": None if config is None else str(config), "steps": steps,
                          "warmup": warmup, "rounds": rounds, "cluster": None if cluster is None else str(cluster)})
    done = subprocess.run([sys.executable, "-m", "jaxscale.analysis.bench", request], env={**os.environ, **flags},
                          capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {**row, "status": "error", "error": f"child process: {last}"}
    for line in done.stderr.splitlines():  # its warnings (a preset with no effect on this backend), not its logs
        if "Warning: " in line:
            print(line, file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_suite(
    suite: str,
    config: str | Path | None = BASE_CONFIG,
    overrides: list[str] | None = None,
    *,
    models: list[str] | None = None,
    variants: list[str] | None = None,
    layers: list[int] | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    rounds: int | None = None,
    suites: str | Path = SUITES_FILE,
    cluster: str | Path | None = None,
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """Run a suite on the present devices; the report object (``schema`` ``jaxscale.analysis.bench/1``); with a
    ``cluster`` file, each row's prediction too. With a ``stream``, :func:`table`'s header goes to it before
    the first run and each row's line as that row finishes (flushed)."""
    table = load_suites(suites)
    runs = plan(suite, overrides or [], table, models, variants, layers)
    spec = table[suite]
    steps = steps if steps is not None else spec.get("steps", 5)
    warmup = warmup if warmup is not None else spec.get("warmup", 2)
    rounds = rounds if rounds is not None else spec.get("rounds", 3)
    if steps < 1 or warmup < 0 or rounds < 1:
        raise ConfigError(
            f"--steps and --rounds must be at least 1 and --warmup at least 0, got {steps}, {rounds} and {warmup}"
        )
    check_memory(runs, config)
    report = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "jax_version": jax.__version__,
        "config": str(config) if config is not None else None,
        "cluster": str(cluster) if cluster is not None else None,
        "results": [],
    }
    if stream is not None:
        print("\n".join(header(report)), file=stream, flush=True)
    if runs[0].compile_only:
        run_one(suite, runs[0], config, steps, warmup)  # compiles once untimed: one-time costs out of the first row
    for run in runs:
        report["results"].append(run_one(suite, run, config, steps, warmup, rounds, cluster))
        if stream is not None:
            print(row_line(report["results"][-1]), file=stream, flush=True)
    return report
















if __name__ == "__main__":  # one row, for _in_fresh_process: the request as JSON in, the row as JSON out
    _request = json.loads(sys.argv[1])
    _run = Run(_request["name"], _request["overrides"], _request["compile_only"])
    print(json.dumps(run_one(_request["suite"], _run, _request["config"], _request["steps"], _request["warmup"],
                             _request["rounds"], _request["cluster"])))
