"""``jaxscale train --config FILE [--set KEY=VALUE ...] [--resume]``; ``prepare-data``, ``inspect``, ``plan``.

``report`` plots a run, ``bench`` times the step; ``--help`` lists every command.

The config is read and validated before jax is imported, so that when no
``XLA_FLAGS`` is set the command can ask the host platform for as many
simulated CPU devices as the mesh needs (an ``XLA_FLAGS`` already in the
environment is always kept; the flag only affects the CPU backend), and put
the ``xla.preset`` flags into ``XLA_FLAGS`` or ``LIBTPU_INIT_ARGS``
(:mod:`jaxscale.xla_flags`; flags already set win). A bad
config prints one line naming the key or axis and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxscale import distributed, xla_flags
from jaxscale.config import CONFIG_DIR, ConfigError, check_writable, checkpoint_dir, load_config, requested_devices

DEFAULT_CPU_DEVICES = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxscale", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model")
    train.add_argument("--config", default=str(CONFIG_DIR / "experiments" / "tiny.yaml"), help="experiment YAML file")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--coordinator", help="host:port of process 0 (multi-process; or JAXSCALE_COORDINATOR)")
    train.add_argument("--num-processes", type=int, help="processes in the job (or JAXSCALE_NUM_PROCESSES)")
    train.add_argument("--process-id", type=int, help="this process's index (or JAXSCALE_PROCESS_ID)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint; an error if there is none "
                       "(checkpoint.resume=required)")
    prep = commands.add_parser("prepare-data", help="tokenize text files into a memory-mapped token directory")
    prep.add_argument("inputs", nargs="+", help="plain text files (one document each) or .jsonl files")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or the path of a Hugging Face tokenizer.json")
    prep.add_argument("--text-field", default="text", help="the text field of JSONL records")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for eval")
    prep.add_argument("--eod-token", default=None, help="end-of-document token of a tokenizer.json")
    _inspection_commands(commands)
    convert = commands.add_parser("convert", help="Hugging Face Llama/Mixtral weights to jaxscale and back")
    convert.add_argument("direction", choices=("hf-to-jaxscale", "jaxscale-to-hf"))
    convert.add_argument("--from", dest="source", required=True,
                         help="an HF directory (config.json, *.safetensors), or a jaxscale parameters/run checkpoint")
    convert.add_argument("--to", dest="target", required=True, help="the checkpoint or HF directory to write")
    convert.add_argument("--config", help="a model YAML over the generated one (hf-to-jaxscale), or the checkpoint's")
    convert.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                         help="jaxscale-to-hf: tensor dtype (default: the model's param_dtype)")
    convert.add_argument("--max-shard-mb", type=float, default=2000.0, help="jaxscale-to-hf: MiB per safetensors file")
    _bench_command(commands)
    return parser


def _convert(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host arrays only: no accelerator memory
    from jaxscale import convert

    try:
        print(convert.main(args.direction, args.source, args.target, args.config, args.dtype, args.max_shard_mb))
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from jaxscale.prepare import prepare_data

    try:
        meta = prepare_data(args.inputs, args.out, args.tokenizer, args.text_field, args.val_fraction, args.eod_token)
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
    splits = ", ".join(f"{k} {v['tokens']} tokens in {v['documents']} documents" for k, v in meta["splits"].items())
    print(f"{args.out}: {splits}; vocab_size {meta['vocab_size']}, {meta['dtype']}")
    return 0


def _inspection_commands(commands: argparse._SubParsersAction) -> None:
    """``inspect``, ``plan`` and ``report``: read a layout, choose one, look at a run (jaxscale/commands.py)."""
    inspect = commands.add_parser("inspect", help="compile the train step without running it and report its layout")
    inspect.add_argument("--config", default=str(CONFIG_DIR / "experiments" / "tiny.yaml"), help="experiment YAML")
    inspect.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key (repeatable)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--png", metavar="FILE", help="write a picture of the memory per device")
    plan = commands.add_parser("plan", help="search layouts: fit in memory, reach the batch, rank by step time")
    plan.add_argument("--model", required=True, help="a model YAML (path, or a name in configs/models/)")
    plan.add_argument("--cluster", required=True, help="a cluster YAML (path, or a name in configs/clusters/)")
    plan.add_argument("--set", dest="cluster_overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a cluster key, e.g. --set nodes=8 (repeatable)")
    plan.add_argument("--global-batch-tokens", type=int, required=True, help="tokens per optimizer step")
    plan.add_argument("--seq-len", type=int, required=True, help="sequence length")
    plan.add_argument("--attention", choices=("dot", "blockwise", "ring", "cudnn", "auto"),
                      help="attention to assume (dot keeps s x s scores, the others do not; auto: what the "
                      "cluster's devices would run); default: the model's")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--png", metavar="FILE", help="write a picture of the memory of the ranked layouts")
    plan.add_argument("--write", metavar="FILE", help="write the chosen layout as an experiment file (+ rules file)")
    plan.add_argument("--pick", type=int, default=0,
                      help="which ranked layout --write writes (default: the best this installation can run)")
    plan.add_argument("--verify", type=int, nargs="?", const=3, default=0, metavar="K",
                      help="compile the top K (default 3) on simulated devices: predicted vs compiled")
    report = commands.add_parser("report", help="plot loss, tokens/s and memory of a run from its metrics.jsonl")
    report.add_argument("run_dir", help="the run directory")
    report.add_argument("--out", metavar="FILE", help="the PNG to write (default RUN_DIR/report.png)")
    report.add_argument("--tensorboard", action="store_true", help="also write the metrics as TensorBoard events")


def _bench_command(commands: argparse._SubParsersAction) -> None:
    """``bench``: step time, tokens/s, MFU, compile time and host overhead as JSON (jaxscale/bench.py)."""
    bench = commands.add_parser("bench", help="benchmark the train step: time, throughput, MFU, compile, overhead")
    bench.add_argument("--suite", default="quick", help="quick | full | compile | options (configs/bench/suites.yaml)")
    bench.add_argument("--config", default=str(CONFIG_DIR / "experiments" / "bench.yaml"), help="base experiment")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key of every run (repeatable)")
    bench.add_argument("--models", help="comma-separated runs of the suite to keep (quick, full)")
    bench.add_argument("--variants", help="comma-separated variants of the suite to keep (options)")
    bench.add_argument("--layers", help="comma-separated layer counts to compile (compile; default 2,8,32)")
    bench.add_argument("--steps", type=int, help="timed steps per run (default: the suite's)")
    bench.add_argument("--warmup", type=int, help="untimed steps before them (default: the suite's)")
    bench.add_argument("--rounds", type=int, help="timed rounds; each figure is the best (default: the suite's)")
    bench.add_argument("--suites", default=str(CONFIG_DIR / "bench" / "suites.yaml"), help="the suites table")
    bench.add_argument("--out", default="bench.json", help="the JSON report to write")


def _bench(args: argparse.Namespace) -> int:
    def names(text: str | None) -> list[str] | None:
        return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

    try:
        config = load_config(args.config, args.overrides)
        _simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
        from jaxscale import bench

        layers = names(args.layers)
        if layers is not None and not all(n.isdigit() and int(n) > 0 for n in layers):
            raise ConfigError(f"--layers {args.layers}: expected positive integers separated by commas")
        report = bench.run_suite(
            args.suite, args.config, args.overrides, models=names(args.models), variants=names(args.variants),
            layers=None if layers is None else [int(n) for n in layers], steps=args.steps, warmup=args.warmup,
            rounds=args.rounds, suites=args.suites,
        )
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
    print(bench.table(report))
    print(f"wrote {bench.write(report, args.out)}")
    return 0


def _simulate_cpu_devices(count: int) -> None:
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "prepare-data":
        return _prepare_data(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "bench":
        return _bench(args)
    if args.command != "train":
        from jaxscale import commands

        return commands.run(args, _simulate_cpu_devices)
    try:
        config = load_config(args.config, [*args.overrides, *(["checkpoint.resume=required"] if args.resume else [])])
        if config.checkpoint.every:
            check_writable(checkpoint_dir(config))  # before jax starts: a one-line error in a second
        cluster = distributed.detect(None, args.coordinator, args.num_processes, args.process_id)
        processes = cluster.num_processes or 1
        _simulate_cpu_devices(max((requested_devices(config.mesh) or DEFAULT_CPU_DEVICES) // processes, 1))
        xla_flags.apply(config.xla)
        distributed.initialize(cluster, config.distributed.init_timeout_s, config.distributed.heartbeat_timeout_s)
        import jax

        from jaxscale.checkpoint import CheckpointError
        from jaxscale.loop import NonFiniteError
        from jaxscale.train import Trainer

        trainer = Trainer.build(config)
        with distributed.fail_fast(config.distributed.heartbeat_timeout_s):
            _, history = trainer.fit(progress=not args.no_progress)
            distributed.finish(config.distributed.init_timeout_s)
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
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
            f"{last['tokens_per_sec']:.0f} tokens/s, metrics in {config.run_dir}/metrics.jsonl"
            + (f"; {last['skipped_updates']} updates skipped (non-finite)" if last["skipped_updates"] else "")
        )
    if history and history[-1].get("event") == "preempted":
        saved = "checkpoint saved" if history[-1]["saved"] else "checkpointing is off, nothing saved"
        print(f"preempted (SIGTERM) after {history[-1]['step']} updates; {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
