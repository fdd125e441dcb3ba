"""jaxscale's command line: train, prepare-data, convert, generate, inspect, plan, report and bench.

Each command reads and validates its config (or cluster file) before jax is
imported, so that when no ``XLA_FLAGS`` is set it can ask the host platform
for as many simulated CPU devices as it needs (``train``, ``inspect``,
``bench``: the experiment's mesh; ``plan --verify``: the cluster's devices, at
most :data:`MAX_SIMULATED`), and put the ``xla.preset`` flags into
``XLA_FLAGS`` or ``LIBTPU_INIT_ARGS`` (:mod:`jaxscale.runtime.xla_flags`; flags
already set win; the device-count flag only affects the CPU backend). The
modules that import jax are therefore imported inside the commands, after
that point. A bad input prints one line naming the key, axis or file and
exits with code 2 (:func:`main`); ``train`` stopped by a non-finite loss or
state exits with 1, interrupted by Ctrl-C with 130 (after saving at the step boundary; a second
Ctrl-C, or one before training starts, ends it at once with one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxscale.analysis import plan, strategy, target
from jaxscale.analysis.params import param_table
from jaxscale.analysis.timing import load_cluster
from jaxscale.config.read import (
    CONFIG_DIR,
    Attention,
    ConfigError,
    DType,
    XlaConfig,
    check_writable,
    checkpoint_dir,
    load_config,
    read_yaml,
    requested_devices,
    resolve_named,
)
from jaxscale.data import prepare
from jaxscale.runtime import distributed, runlock, xla_flags
from jaxscale.training import report

DEFAULT_CPU_DEVICES = 8
MAX_SIMULATED = 64
DEFAULT_EXPERIMENT = str(CONFIG_DIR / "experiments" / "tiny.yaml")


def main(argv: list[str] | None = None) -> int:
    """Run one command; a :class:`ConfigError` anywhere in it is one line on stderr and exit code 2."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxscale: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except OSError as e:  # storage the command could not use (a full disk, a lost mount): one line, not a traceback
        where = f" {e.filename}" if e.filename else ""
        print(f"jaxscale: error:{where}: {e.strerror or e}", file=sys.stderr)
        return 1


def _simulate_cpu_devices(count: int) -> None:
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


# -- train -----------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config, [*args.overrides, *(["checkpoint.resume=required"] if args.resume else [])])
    if config.checkpoint.every:
        check_writable(checkpoint_dir(config))  # before jax starts: a one-line error in a second
    cluster = distributed.detect(None, args.coordinator, args.num_processes, args.process_id)
    # One run per directory, refused at once: before jax starts (the loop holds the same locks).
    locked = runlock.run_directories(config) if not cluster.process_id else []
    with runlock.hold(*locked):
        return _train_locked(args, config, cluster)


def _train_locked(args: argparse.Namespace, config: Any, cluster: Any) -> int:
    """:func:`_train` once the run's directories are locked."""
    processes = cluster.num_processes or 1
    _simulate_cpu_devices(max((requested_devices(config.mesh) or DEFAULT_CPU_DEVICES) // processes, 1))
    xla_flags.apply(config.xla)
    distributed.initialize(cluster, config.distributed.init_timeout_s, config.distributed.heartbeat_timeout_s)
    # Imports jax: after the device count and XLA flags are in the environment.
    import jax

    from jaxscale.analysis.remat import resolved
    from jaxscale.checkpoint.store import CheckpointError
    from jaxscale.training.loop import NonFiniteError, fit
    from jaxscale.training.trainer import Trainer

    try:
        trainer = Trainer.build(resolved(config))  # model.remat: auto -> by the predicted memory
        with distributed.fail_fast(config.distributed.heartbeat_timeout_s):
            state, history = fit(trainer, progress=not args.no_progress)
            distributed.finish(config.distributed.init_timeout_s)
    except NonFiniteError as e:
        print(f"jaxscale: stopped: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 1
    steps = [r for r in history if "loss" in r]
    if steps and jax.process_index() == 0:
        first, last = steps[0], steps[-1]
        print(
            f"step {first['step']} loss {first['loss']:.4f} -> step {last['step']} loss {last['loss']:.4f}; "
            f"{last['tokens_per_sec']:.0f} tokens/s, metrics in {Path(config.run_dir) / 'metrics.jsonl'}"
            + (f"; {last['skipped_updates']} updates skipped (non-finite)" if last["skipped_updates"] else "")
        )
    if not steps and int(state.step) >= config.train.steps and jax.process_index() == 0:
        print(f"run_dir {config.run_dir}: the run is finished: resumed at step {int(state.step)}, and "
              f"train.steps is {config.train.steps}; nothing to train")
    if history and history[-1].get("event") == "preempted":
        saved = "checkpoint saved" if history[-1]["saved"] else "checkpointing is off, nothing saved"
        if history[-1].get("signal") == "SIGINT":
            print(f"jaxscale: interrupted (Ctrl-C) after {history[-1]['step']} updates; {saved}", file=sys.stderr)
            return 130
        print(f"preempted (SIGTERM) after {history[-1]['step']} updates; {saved}")
    return 0


# -- data and weights ----------------------------------------------------------------------


def _prepare_data(args: argparse.Namespace) -> int:
    meta = prepare.prepare_data(
        args.inputs, args.out, args.tokenizer, args.text_field, args.val_fraction, args.eod_token, args.overwrite,
        args.prompt_field, args.response_field,
    )
    splits = ", ".join(f"{k} {v['tokens']} tokens in {v['documents']} documents" for k, v in meta["splits"].items())
    print(f"{args.out}: {splits}; vocab_size {meta['vocab_size']}, {meta['dtype']}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host arrays only: no accelerator memory
    # Imports jax: after JAX_PLATFORMS is set.
    from jaxscale.hf import convert

    print(convert.main(args.direction, args.source, args.target, args.config, args.dtype, args.max_shard_mb))
    return 0


def _generate(args: argparse.Namespace) -> int:
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


def _inspect(args: argparse.Namespace) -> int:
    if args.png:
        report.check_pyplot()
    config = load_config(args.config, args.overrides)
    if args.target or args.target_spec:
        return _inspect_target(args, config)
    _simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
    xla_flags.apply(config.xla)
    # Imports jax: after the device count and XLA flags are in the environment.
    from jaxscale.analysis.inspect import format_inspect, inspect_report
    from jaxscale.analysis.remat import resolved
    from jaxscale.training.trainer import Trainer

    trainer = Trainer.build(resolved(config))
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


def _inspect_target(args: argparse.Namespace, config: Any) -> int:
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
    from jaxscale.training.trainer import Trainer

    devices = args.devices or requested_devices(config.mesh) or DEFAULT_CPU_DEVICES
    compile_only = target.compile_only(name, devices, args.hosts, args.target_spec)
    trainer = Trainer.build(config, list(compile_only.devices))
    out = target_report(trainer, compile_only)
    print(json.dumps(out, indent=1) if args.json else format_target(out))
    return 0


def _plan(args: argparse.Namespace) -> int:
    if args.png:
        report.check_pyplot()
    if args.calibrate:
        _simulate_cpu_devices(DEFAULT_CPU_DEVICES)  # on a CPU-only host (unless XLA_FLAGS says otherwise)
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
    compile_for = _verify_target(cluster) if args.verify else None
    if args.verify and compile_for is None:
        _simulate_cpu_devices(min(cluster.devices, MAX_SIMULATED))
    if args.attention:
        config.model.attention = args.attention  # what the analytic model assumes
        model_dict["attention"] = args.attention  # and what a written experiment runs
    if config.model.attention == "auto":  # the kernel the cluster's devices would run (ring comes with CP layouts)
        # Imports jax: after the simulated device count is in the environment.
        from jaxscale.models.attention import resolve_attention

        platform = "tpu" if "tpu" in cluster.device.lower() else "gpu"
        config.model.attention = resolve_attention(config.model, platform, args.seq_len)
    params = param_table(config)
    result = plan.search(config.model, params, cluster, args.global_batch_tokens, args.seq_len, top=args.top)
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
    verified = _verify(args, result, model_dict, compile_for) if args.verify else None
    if args.json:
        print(json.dumps({**plan.plan_json(result), **({"verify": verified} if verified else {})}, indent=1))
    return 0


def _verify_target(cluster: Any) -> tuple[str, int, int] | None:
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


def _verify(args: argparse.Namespace, result: Any, model_dict: dict, compile_for: tuple | None) -> list[dict]:
    """Compile the top ``--verify`` layouts (for the cluster's compile target, else simulated CPU devices)."""
    # Imports jax: after the device count, JAX_PLATFORMS and the XLA flags are in the environment.
    from jaxscale.analysis.verify import compile_top

    rows, text = compile_top(result.candidates[: args.verify], model_dict, args.seq_len, compile_for)
    if not args.json:
        print(f"\n{text}")
    return rows


def _report(args: argparse.Namespace) -> int:
    print(f"wrote {report.run_png(args.run_dir, args.out)}")
    if args.tensorboard:
        print(f"wrote {report.metrics_to_tensorboard(args.run_dir)}")
    return 0


# -- bench -----------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    def names(text: str | None) -> list[str] | None:
        return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

    config = load_config(args.config, args.overrides)
    layers = names(args.layers)
    if layers is not None and not all(n.isdigit() and int(n) > 0 for n in layers):
        raise ConfigError(f"--layers {args.layers}: expected positive integers separated by commas")
    if args.predict is not None:
        load_cluster(args.predict)  # a bad cluster file fails before anything compiles
    _simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
    # Imports jax: after the device count is in the environment.
    from jaxscale.analysis import bench

    result = bench.run_suite(
        args.suite, args.config, args.overrides, models=names(args.models), variants=names(args.variants),
        layers=None if layers is None else [int(n) for n in layers], steps=args.steps, warmup=args.warmup,
        rounds=args.rounds, suites=args.suites, cluster=args.predict, stream=sys.stdout,
    )
    for line in bench.footer(result):
        print(line)
    print(f"wrote {bench.write(result, args.out)}")
    return 0


# -- arguments ---------------------------------------------------------------------------------


def _choices(literal: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` type of :mod:`jaxscale.config.read`."""
    return typing.get_args(literal)


def _command(
    commands: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], summary: str
) -> argparse.ArgumentParser:
    """A subcommand that runs ``run(args)``."""
    parser = commands.add_parser(name, help=summary, description=summary)
    parser.set_defaults(run=run)
    return parser


def _experiment_args(parser: argparse.ArgumentParser, default: str, help_set: str) -> None:
    parser.add_argument("--config", default=default, help="experiment YAML file")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help=help_set)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxscale", description=__doc__.split("\n")[0],
        epilog="'jaxscale COMMAND --help' for a command's arguments; every config key --set can change is in "
        "docs/config.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = _command(commands, "train", _train, "train a model")
    _experiment_args(train, DEFAULT_EXPERIMENT,
                     "override config keys, e.g. --set train.steps=20 model.dtype=bfloat16 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--coordinator", help="host:port of process 0 (multi-process; or JAXSCALE_COORDINATOR)")
    train.add_argument("--num-processes", type=int, help="processes in the job (or JAXSCALE_NUM_PROCESSES)")
    train.add_argument("--process-id", type=int, help="this process's index (or JAXSCALE_PROCESS_ID)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint; an error if there is none "
                       "(checkpoint.resume=required)")

    prep = _command(commands, "prepare-data", _prepare_data, "tokenize text files into a memory-mapped token directory")
    prep.add_argument("inputs", nargs="+", help="plain text files (one document each), .jsonl, .parquet or .arrow "
                      "files, saved datasets directories")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or the path of a Hugging Face tokenizer.json")
    prep.add_argument("--text-field", default="text", help="the text field of JSONL, Parquet and Arrow records")
    prep.add_argument("--prompt-field", default=None, help="with --response-field: train on the response only")
    prep.add_argument("--response-field", default=None, help="the response field of prompt/response records")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for eval")
    prep.add_argument("--eod-token", default=None, help="end-of-document token of a tokenizer.json")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace an existing --out directory (once the new one is complete)")

    inspect = _command(commands, "inspect", _inspect, "compile the train step without running it and report its layout")
    _experiment_args(inspect, DEFAULT_EXPERIMENT, "override config keys (several after one --set, or repeated)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--png", metavar="FILE", help="write a picture of the memory per device")
    inspect.add_argument("--target", help="compile for this GPU or TPU instead (h100, h200, b200, a100, ..., or a "
                         "TPU topology such as v5e:2x4): needs the gpu-compile or tpu-compile extra")
    inspect.add_argument("--target-spec", metavar="FILE", help="a GPU target given as a GpuTargetConfigProto file")
    inspect.add_argument("--devices", type=int, help="GPUs to compile for (default: the mesh's, else 8)")
    inspect.add_argument("--hosts", type=int, default=1, help="hosts the GPUs are spread over (default 1)")

    plan_ = _command(commands, "plan", _plan, "search layouts: fit in memory, reach the batch, rank by step time")
    plan_.add_argument("--model", help="a model YAML (path, or a name in configs/models/)")
    plan_.add_argument("--cluster", help="a cluster YAML (path, or a name in configs/clusters/)")
    plan_.add_argument("--calibrate", metavar="FILE", help="measure the devices present (matmuls, attention, memory, "
                       "collectives), write them as a cluster file and plan with it (jaxscale/analysis/calibrate.py)")
    plan_.add_argument("--set", dest="cluster_overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                       help="override cluster keys, e.g. --set nodes=8 (several after one --set, or repeated)")
    plan_.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    plan_.add_argument("--seq-len", type=int, help="sequence length")
    plan_.add_argument("--attention", choices=_choices(Attention),
                       help="attention to assume (dot keeps s x s scores, the others do not; auto: what the "
                       "cluster's devices would run); default: the model's")
    plan_.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan_.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_.add_argument("--png", metavar="FILE", help="write a picture of the memory of the ranked layouts")
    plan_.add_argument("--write", metavar="FILE", help="write the chosen layout as an experiment file (+ rules file)")
    plan_.add_argument("--pick", type=int, default=0,
                       help="which ranked layout --write writes (default: the best this installation can run)")
    plan_.add_argument("--verify", type=int, nargs="?", const=3, metavar="K",
                       help="compile the top K (default 3) for the cluster's compile_target where its compiler is "
                       "installed, else on simulated CPU devices: predicted vs compiled memory")

    report_ = _command(commands, "report", _report,
                       "plot losses, mixture shares, tokens/s and memory of a run from its metrics.jsonl")
    report_.add_argument("run_dir", help="the run directory")
    report_.add_argument("--out", metavar="FILE", help="the PNG to write (default RUN_DIR/report.png)")
    report_.add_argument("--tensorboard", action="store_true", help="also write the metrics as TensorBoard events")

    convert = _command(commands, "convert", _convert, "Hugging Face Llama/Mixtral weights to jaxscale and back")
    convert.add_argument("direction", choices=("hf-to-jaxscale", "jaxscale-to-hf"))
    convert.add_argument("--from", dest="source", required=True,
                         help="an HF directory (config.json, *.safetensors), or a jaxscale parameters/run checkpoint")
    convert.add_argument("--to", dest="target", required=True, help="the checkpoint or HF directory to write")
    convert.add_argument("--config", help="a model YAML over the generated one (hf-to-jaxscale), or the checkpoint's")
    convert.add_argument("--dtype", choices=_choices(DType),
                         help="jaxscale-to-hf: tensor dtype (default: the model's param_dtype)")
    convert.add_argument("--max-shard-mb", type=float, default=2000.0, help="jaxscale-to-hf: MiB per safetensors file")

    gen = _command(commands, "generate", _generate, "continue a prompt with a run's or a converted checkpoint's model")
    gen.add_argument("path", help="a run directory, a checkpoint directory, or a converted checkpoint (params/, "
                     "model.yaml)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (fewer at end of document)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample softmax(logits / T)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed")
    gen.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, or the checkpoint's "
                     "tokenizer.json)")

    bench = _command(commands, "bench", _bench, "benchmark the train step: time, throughput, MFU, compile, overhead")
    _experiment_args(bench, str(CONFIG_DIR / "experiments" / "bench.yaml"),
                     "override config keys of every run (several after one --set, or repeated)")
    bench.add_argument("--suite", default="quick", help="quick | full | compile | options | calibration "
                       "(configs/bench/suites.yaml)")
    bench.add_argument("--models", help="comma-separated runs of the suite to keep (quick, full)")
    bench.add_argument("--variants", help="comma-separated variants of the suite to keep (options)")
    bench.add_argument("--layers", help="comma-separated layer counts to compile (compile; default 2,8,32)")
    bench.add_argument("--steps", type=int, help="timed steps per run (default: the suite's)")
    bench.add_argument("--warmup", type=int, help="untimed steps before them (default: the suite's)")
    bench.add_argument("--rounds", type=int, help="timed rounds; each figure is the best (default: the suite's)")
    bench.add_argument("--suites", default=str(CONFIG_DIR / "bench" / "suites.yaml"), help="the suites table")
    bench.add_argument("--out", default="bench.json", help="the JSON report to write")
    bench.add_argument("--predict", metavar="CLUSTER", help="a cluster YAML (path, or a name in configs/clusters/): "
                       "each row also gets the plan's predicted step time and MFU on it")
    return parser


if __name__ == "__main__":
    sys.exit(main())
