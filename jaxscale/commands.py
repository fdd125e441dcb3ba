"""What each command of :mod:`jaxscale.cli` runs: train, prepare-data, convert, generate, inspect, plan, report, bench.

Each reads and validates its config (or cluster file) before jax is imported, so that when no ``XLA_FLAGS``
is set it can ask the host platform for as many simulated CPU devices as it needs (``train``, ``inspect``,
``bench``: the experiment's mesh; ``plan --verify``: the cluster's devices, at most :data:`MAX_SIMULATED`),
and put the ``xla.preset`` flags into ``XLA_FLAGS`` or ``LIBTPU_INIT_ARGS`` (:mod:`jaxscale.runtime.xla_flags`;
flags already set win; the device-count flag only affects the CPU backend). The modules that import jax are
therefore imported inside the commands, after that point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from jaxscale.analysis import plan, strategy, target
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.params import param_table
from jaxscale.config.mesh_size import requested_devices
from jaxscale.config.read import (
    CONFIG_DIR,
    ConfigError,
    XlaConfig,
    check_writable,
    checkpoint_dir,
    load_config,
    read_yaml,
    resolve_named,
)
from jaxscale.data import prepare
from jaxscale.runtime import compile_cache, distributed, elastic, runlock, xla_flags
from jaxscale.training import goodput, report

DEFAULT_CPU_DEVICES = 8
MAX_SIMULATED = 64
DEFAULT_EXPERIMENT = str(CONFIG_DIR / "experiments" / "tiny.yaml")


def simulate_cpu_devices(count: int) -> None:
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


# -- train -----------------------------------------------------------------------------


def remat_cluster(args: argparse.Namespace) -> Any:
    """The ``--cluster`` file ``model.remat: auto`` weighs ``offload_dots`` on (read before jax starts), or None."""
    return load_cluster(args.cluster) if getattr(args, "cluster", None) else None


def train(args: argparse.Namespace) -> int:
    config = load_config(args.config, [*args.overrides, *(["checkpoint.resume=required"] if args.resume else [])])
    args.remat_cluster = remat_cluster(args)
    if config.checkpoint.every or config.checkpoint.continuous:
        check_writable(checkpoint_dir(config))  # before jax starts: a one-line error in a second
    cluster = distributed.detect(None, args.coordinator, args.num_processes, args.process_id)
    # One run per directory, refused at once: before jax starts (the loop holds the same locks).
    locked = runlock.run_directories(config) if not cluster.process_id else []
    with runlock.hold(*locked):
        return train_locked(args, config, cluster)


def train_locked(args: argparse.Namespace, config: Any, cluster: Any) -> int:
    """:func:`_train` once the run's directories are locked."""
    processes = cluster.num_processes or 1
    simulate_cpu_devices(max((requested_devices(config.mesh) or DEFAULT_CPU_DEVICES) // processes, 1))
    xla_flags.apply(config.xla)
    distributed.initialize(cluster, config.distributed.init_timeout_s, config.distributed.heartbeat_timeout_s)
    compile_cache.enable(config)  # imports jax: after the device count and XLA flags are in the environment
    import jax

    from jaxscale.analysis import shrink_check
    from jaxscale.analysis.remat import resolved
    from jaxscale.checkpoint.store import CheckpointError
    from jaxscale.training.loop import NonFiniteError, fit
    from jaxscale.training.trainer import Trainer

    asked, config = config, elastic.apply(config, jax.device_count())  # distributed.elastic: a lost host's replicas
    shrunk = config is not asked
    try:
        trainer = Trainer.build(resolved(config, cluster=args.remat_cluster))  # model.remat: auto -> by memory
        if shrunk:
            shrink_check.check(trainer)  # the planner's memory on the smaller mesh, before anything compiles
        with distributed.fail_fast(config.distributed.heartbeat_timeout_s):
            state, history = fit(trainer, progress=not args.no_progress,
                                 steps=config.distributed.rejoin_every if shrunk else None)
            distributed.finish(config.distributed.init_timeout_s)
    except NonFiniteError as e:
        print(f"jaxscale: stopped: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 1
    code = train_messages(config, int(state.step), history)
    if code == 0 and shrunk and config.distributed.rejoin_every and int(state.step) < config.train.steps:
        if jax.process_index() == 0:
            print(f"jaxscale: shrunk run saved at step {int(state.step)} (distributed.rejoin_every="
                  f"{config.distributed.rejoin_every}): exit {elastic.REJOIN}, for the launcher to start all "
                  "hosts again", file=sys.stderr)
        return elastic.REJOIN
    return code


def train_messages(config: Any, step: int, history: list[dict[str, Any]]) -> int:
    """Process 0's lines at the end of a training run (at ``step``); the command's exit status."""
    import jax

    steps = [r for r in history if "loss" in r]
    if steps and jax.process_index() == 0:
        first, last = steps[0], steps[-1]
        print(
            f"step {first['step']} loss {first['loss']:.4f} -> step {last['step']} loss {last['loss']:.4f}; "
            f"{last['tokens_per_sec']:.0f} tokens/s, metrics in {Path(config.run_dir) / 'metrics.jsonl'}"
            + (f"; {last['skipped_updates']} updates skipped (non-finite)" if last["skipped_updates"] else "")
        )
    if not steps and step >= config.train.steps and jax.process_index() == 0:
        print(f"run_dir {config.run_dir}: the run is finished: resumed at step {step}, and "
              f"train.steps is {config.train.steps}; nothing to train")
    if history and history[-1].get("event") == "preempted":
        saved = "checkpoint saved" if history[-1]["saved"] else "checkpointing is off, nothing saved"
        if history[-1].get("signal") == "SIGINT":
            print(f"jaxscale: interrupted (Ctrl-C) after {history[-1]['step']} updates; {saved}", file=sys.stderr)
            return 130
        print(f"preempted (SIGTERM) after {history[-1]['step']} updates; {saved}")
    return 0


# -- data and weights ----------------------------------------------------------------------


def prepare_data(args: argparse.Namespace) -> int:
    meta = prepare.prepare_data(
        args.inputs, args.out, args.tokenizer, args.text_field, args.val_fraction, args.eod_token, args.overwrite,
        args.prompt_field, args.response_field,
    )
    splits = ", ".join(f"{k} {v['tokens']} tokens in {v['documents']} documents" for k, v in meta["splits"].items())
    print(f"{args.out}: {splits}; vocab_size {meta['vocab_size']}, {meta['dtype']}")
    return 0


def convert(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host arrays only: no accelerator memory
    # Imports jax: after JAX_PLATFORMS is set.
    from jaxscale.hf import convert

    print(convert.main(args.direction, args.source, args.target, args.config, args.dtype, args.max_shard_mb))
    return 0


def generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ConfigError("generate: --prompt is empty: give the text to continue")
    for name, low in (("max_new_tokens", 1), ("top_k", 0)):
        if getattr(args, name) < low:
            raise ConfigError(f"generate: --{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if args.temperature < 0:
        raise ConfigError(f"generate: --temperature must be 0 (greedy) or more, got {args.temperature}")
    # Imports jax: one device of the default platform.
    from jaxscale.inference import generate

    print(generate.main(args.path, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                        args.tokenizer))
    return 0


# -- inspect, plan, report -----------------------------------------------------------------


def inspect(args: argparse.Namespace) -> int:
    if args.png:
        report.check_pyplot()
    config = load_config(args.config, args.overrides)
    args.remat_cluster = remat_cluster(args)
    if args.target or args.target_spec:
        return inspect_target(args, config)
    simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
    xla_flags.apply(config.xla)
    # Imports jax: after the device count and XLA flags are in the environment.
    from jaxscale.analysis.inspect import format_inspect, inspect_report
    from jaxscale.analysis.remat import resolved
    from jaxscale.training.trainer import Trainer

    trainer = Trainer.build(resolved(config, cluster=args.remat_cluster))
    out = inspect_report(trainer, asked=config)
    print(json.dumps(out, indent=1) if args.json else format_inspect(out))
    if args.png:
        state, mem = out["state"], out["memory"]
        compiled = {"parameters": state["params"], "master": state["master"], "optimizer": state["opt_state"],
                    "batch": state["batch"], "temporaries": mem["temp"]}
        bars = [("compiled", compiled), ("analytic", report.analytic_parts(out["analytic"]["memory"]))]
        report.memory_png(bars, args.png, title=f"{config.rules} on {trainer.mesh.size} devices")
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def inspect_target(args: argparse.Namespace, config: Any) -> int:
    """``inspect --target``: the step compiled for compile-only GPUs or TPU chips (jaxscale.analysis.target)."""
    name = args.target or args.target_spec
    platform = target.platform_of(name)
    if args.png:
        raise ConfigError("inspect --target prints the compiled program; --png draws a simulated run's memory")
    target.prepare(platform)  # before jax starts: the CPU as jax's backend, the plugins compile-only
    if config.xla.preset == "none":
        config.xla.preset = platform  # the target's own preset, as a run on it sets it
    xla_flags.apply(config.xla)
    # Imports jax: after JAX_PLATFORMS and the XLA flags are in the environment.
    from jaxscale.analysis.accelerator import format_target, target_report
    from jaxscale.analysis.remat import USABLE, resolved
    from jaxscale.training.trainer import Trainer

    devices = args.devices or requested_devices(config.mesh) or DEFAULT_CPU_DEVICES
    compile_only = target.compile_only(name, devices, args.hosts, args.target_spec)
    # model.remat: auto by the target's memory (its devices report none), offload_dots by --cluster's host link
    config = resolved(config, list(compile_only.devices), compile_only.hbm_bytes * USABLE, args.remat_cluster)
    trainer = Trainer.build(config, list(compile_only.devices))
    out = target_report(trainer, compile_only)
    print(json.dumps(out, indent=1) if args.json else format_target(out))
    return 0


def plan_command(args: argparse.Namespace) -> int:
    if args.png:
        report.check_pyplot()
    if args.calibrate:
        simulate_cpu_devices(DEFAULT_CPU_DEVICES)  # on a CPU-only host (unless XLA_FLAGS says otherwise)
        # Imports jax: after the simulated device count is in the environment.
        from jaxscale.analysis import calibrate

        written = calibrate.write(calibrate.calibrate(), args.calibrate)
        print(f"wrote {written}", file=sys.stderr)
        args.cluster = args.cluster or str(written)
        if not args.model:
            return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "cluster", "global_batch_tokens", "seq_len")
               if not getattr(args, k)]
    if missing:
        raise ConfigError(f"plan needs {', '.join(missing)} (or --calibrate FILE alone)")
    for name in ("global_batch_tokens", "seq_len", "top", "verify"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    cluster = load_cluster(args.cluster, args.cluster_overrides)
    model_dict = read_yaml(resolve_named(args.model, "models"))
    config = load_config(None, [f"model={args.model}"])
    compile_for = verify_target(cluster) if args.verify else None
    if args.verify and compile_for is None:
        simulate_cpu_devices(min(cluster.devices, MAX_SIMULATED))
    if args.attention:
        config.model.attention = args.attention  # what the analytic model assumes
        model_dict["attention"] = args.attention  # and what a written experiment runs
    if config.model.attention == "auto":  # the kernel the cluster's devices would run (ring comes with CP layouts)
        # Imports jax: after the simulated device count is in the environment.
        from jaxscale.models.attention import resolve_attention

        platform = "tpu" if "tpu" in cluster.device.lower() else "gpu"
        config.model.attention = resolve_attention(config.model, platform, args.seq_len)
    params = param_table(config)
    result = plan.search(config.model, params, cluster, args.global_batch_tokens, args.seq_len, top=args.top,
                         documents=args.documents or "")
    if not args.json:
        print(plan.table(result))
    if args.png and result.candidates:
        bars = [(f"{i}. {c.layout.describe()}", report.analytic_parts(c.memory))
                for i, c in enumerate(result.candidates, 1)]
        report.memory_png(bars, args.png, cluster.budget, title=f"{args.model} on {cluster.devices} x {cluster.device}")
        print(f"wrote {args.png}", file=sys.stderr)
    if args.write:
        pick = args.pick or 1
        if not 1 <= pick <= len(result.candidates):
            raise ConfigError(f"--pick {pick}: the plan has {len(result.candidates)} layouts")
        layout = result.candidates[pick - 1].layout
        path, rules = strategy.write_experiment(layout, model_dict, args.seq_len, args.write)
        print(f"wrote layout {pick} to {path} and {rules}: jaxscale train --config {path}", file=sys.stderr)
    verified = verify(args, result, model_dict, compile_for) if args.verify else None
    if args.json:
        print(json.dumps({**plan.plan_json(result), **({"verify": verified} if verified else {})}, indent=1))
    return 0


def verify_target(cluster: Any) -> tuple[str, int, int] | None:
    """What ``plan --verify`` compiles for: the cluster file's ``compile_target`` (name, devices, hosts) where its
    compiler is installed, set up before jax starts; None (simulated CPU devices) otherwise, saying why."""
    if not cluster.compile_target:
        return None
    platform = target.platform_of(cluster.compile_target)
    try:
        if (why := target.available(platform)) is not None:
            raise ConfigError(why)
        compile_for = target.for_cluster(cluster.compile_target, cluster.devices, cluster.nodes)
    except ConfigError as e:  # no compiler here, or a TPU cluster of several slices
        print(f"jaxscale: plan --verify compiles on simulated CPU devices: {e}", file=sys.stderr)
        return None
    target.prepare(platform)
    xla_flags.apply(XlaConfig(preset=platform))
    return compile_for


def verify(args: argparse.Namespace, result: Any, model_dict: dict, compile_for: tuple | None) -> list[dict]:
    """Compile the top ``--verify`` layouts (for the cluster's compile target, else simulated CPU devices)."""
    # Imports jax: after the device count, JAX_PLATFORMS and the XLA flags are in the environment.
    from jaxscale.analysis.verify import compile_top

    rows, text = compile_top(result.candidates[: args.verify], model_dict, args.seq_len, compile_for)
    if not args.json:
        print(f"\n{text}")
    return rows


def report_command(args: argparse.Namespace) -> int:
    summary = goodput.of_run(args.run_dir)
    print(json.dumps(summary) if args.goodput else "\n".join(goodput.lines(summary)))
    if args.goodput:
        return 0
    print(f"wrote {report.run_png(args.run_dir, args.out)}")
    if args.tensorboard:
        print(f"wrote {report.metrics_to_tensorboard(args.run_dir)}")
    return 0


# -- bench -----------------------------------------------------------------------------------


def bench(args: argparse.Namespace) -> int:
    def names(text: str | None) -> list[str] | None:
        return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

    config = load_config(args.config, args.overrides)
    layers = names(args.layers)
    if layers is not None and not all(n.isdigit() and int(n) > 0 for n in layers):
        raise ConfigError(f"--layers {args.layers}: expected positive integers separated by commas")
    if args.predict is not None:
        load_cluster(args.predict)  # a bad cluster file fails before anything compiles
    simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
    # Imports jax: after the device count is in the environment.
    from jaxscale.analysis import bench, bench_table

    result = bench.run_suite(
        args.suite, args.config, args.overrides, models=names(args.models), variants=names(args.variants),
        layers=None if layers is None else [int(n) for n in layers], steps=args.steps, warmup=args.warmup,
        rounds=args.rounds, suites=args.suites, cluster=args.predict, stream=sys.stdout,
    )
    for line in bench_table.footer(result):
        print(line)
    print(f"wrote {bench_table.write(result, args.out)}")
    return 0


# -- arguments ---------------------------------------------------------------------------------
