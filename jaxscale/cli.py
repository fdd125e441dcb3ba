"""jaxscale's command line: train, prepare-data, convert, generate, inspect, plan, report and bench.

Here: the arguments of each command and :func:`main`; what each command runs is in :mod:`jaxscale.commands`
(config read and checked before jax is imported). A bad input prints one line naming the key, axis or file and
exits with code 2 (:func:`main`); ``train`` stopped by a non-finite loss or state exits with 1, interrupted by
Ctrl-C with 130 (after saving at the step boundary; a second Ctrl-C, or one before training starts, ends it at
once with one line).
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable
from typing import Any

from jaxscale import commands as do
from jaxscale.config.read import (
    CONFIG_DIR,
    Attention,
    ConfigError,
    DType,
)


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


def _remat_cluster(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="a cluster YAML (path, or a name in configs/clusters/) whose host link "
                        "(host_bandwidth) lets model.remat: auto take offload_dots where the planner has it faster")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxscale", description=__doc__.split("\n")[0],
        epilog="'jaxscale COMMAND --help' for a command's arguments; every config key --set can change is in "
        "docs/config.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = _command(commands, "train", do.train, "train a model")
    _experiment_args(train, do.DEFAULT_EXPERIMENT,
                     "override config keys, e.g. --set train.steps=20 model.dtype=bfloat16 (repeatable)")
    _remat_cluster(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--coordinator", help="host:port of process 0 (multi-process; or JAXSCALE_COORDINATOR)")
    train.add_argument("--num-processes", type=int, help="processes in the job (or JAXSCALE_NUM_PROCESSES)")
    train.add_argument("--process-id", type=int, help="this process's index (or JAXSCALE_PROCESS_ID)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint; an error if there is none "
                       "(checkpoint.resume=required)")

    prep = _command(commands, "prepare-data", do.prepare_data,
                    "tokenize text files into a memory-mapped token directory")
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

    inspect = _command(commands, "inspect", do.inspect,
                       "compile the train step without running it and report its layout")
    _experiment_args(inspect, do.DEFAULT_EXPERIMENT, "override config keys (several after one --set, or repeated)")
    _remat_cluster(inspect)
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--png", metavar="FILE", help="write a picture of the memory per device")
    inspect.add_argument("--target", help="compile for this GPU or TPU instead (h100, h200, b200, a100, ..., or a "
                         "TPU topology such as v5e:2x4): needs the gpu-compile or tpu-compile extra")
    inspect.add_argument("--target-spec", metavar="FILE", help="a GPU target given as a GpuTargetConfigProto file")
    inspect.add_argument("--devices", type=int, help="GPUs to compile for (default: the mesh's, else 8)")
    inspect.add_argument("--hosts", type=int, default=1, help="hosts the GPUs are spread over (default 1)")

    plan_ = _command(commands, "plan", do.plan_command,
                     "search layouts: fit in memory, reach the batch, rank by step time")
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
    plan_.add_argument("--documents", choices=("short", "mixed"),
                       help="rows packed with documents of this corpus (short: mean 300 tokens; mixed: median 1500): "
                       "the ring's attention waits for its busiest device, data.ring_balance planned "
                       "(jaxscale/analysis/ring_imbalance.py)")
    plan_.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan_.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_.add_argument("--png", metavar="FILE", help="write a picture of the memory of the ranked layouts")
    plan_.add_argument("--write", metavar="FILE", help="write the chosen layout as an experiment file (+ rules file)")
    plan_.add_argument("--pick", type=int, default=0,
                       help="which ranked layout --write writes (default: the best this installation can run)")
    plan_.add_argument("--verify", type=int, nargs="?", const=3, metavar="K",
                       help="compile the top K (default 3) for the cluster's compile_target where its compiler is "
                       "installed, else on simulated CPU devices: predicted vs compiled memory")

    report_ = _command(commands, "report", do.report_command,
                       "plot losses, mixture shares, tokens/s and memory of a run from its metrics.jsonl")
    report_.add_argument("run_dir", help="the run directory")
    report_.add_argument("--out", metavar="FILE", help="the PNG to write (default RUN_DIR/report.png)")
    report_.add_argument("--tensorboard", action="store_true", help="also write the metrics as TensorBoard events")
    report_.add_argument("--goodput", action="store_true",
                         help="print the run's goodput and its time lost per failure by cause as JSON, and no picture")

    convert = _command(commands, "convert", do.convert, "Hugging Face Llama/Mixtral weights to jaxscale and back")
    convert.add_argument("direction", choices=("hf-to-jaxscale", "jaxscale-to-hf"))
    convert.add_argument("--from", dest="source", required=True,
                         help="an HF directory (config.json, *.safetensors), or a jaxscale parameters/run checkpoint")
    convert.add_argument("--to", dest="target", required=True, help="the checkpoint or HF directory to write")
    convert.add_argument("--config", help="a model YAML over the generated one (hf-to-jaxscale), or the checkpoint's")
    convert.add_argument("--dtype", choices=_choices(DType),
                         help="jaxscale-to-hf: tensor dtype (default: the model's param_dtype)")
    convert.add_argument("--max-shard-mb", type=float, default=2000.0, help="jaxscale-to-hf: MiB per safetensors file")

    gen = _command(commands, "generate", do.generate,
                   "continue a prompt with a run's or a converted checkpoint's model")
    gen.add_argument("path", help="a run directory, a checkpoint directory, or a converted checkpoint (params/, "
                     "model.yaml)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (fewer at end of document)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample softmax(logits / T)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed")
    gen.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, or the checkpoint's "
                     "tokenizer.json)")

    bench = _command(commands, "bench", do.bench, "benchmark the train step: time, throughput, MFU, compile, overhead")
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
