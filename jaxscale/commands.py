"""The ``inspect``, ``plan`` and ``report`` commands (argument parsing is in :mod:`jaxscale.cli`).

Configs and cluster files are read before jax is imported, so each command can ask for as many
simulated CPU devices as it needs (``inspect``: the experiment's mesh; ``plan --verify``: the
cluster's devices, at most :data:`MAX_SIMULATED`). A bad input prints one line and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from jaxscale import xla_flags
from jaxscale.config import ConfigError, _read_yaml, load_config, requested_devices, resolve_named

MAX_SIMULATED = 64


def run(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    try:
        return {"inspect": _inspect, "plan": _plan, "report": _report}[args.command](args, simulate)
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2


def _inspect(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    config = load_config(args.config, args.overrides)
    simulate(requested_devices(config.mesh) or 8)
    xla_flags.apply(config.xla)
    from jaxscale import report
    from jaxscale.analysis.inspect import format_inspect, inspect_report
    from jaxscale.train import Trainer

    trainer = Trainer.build(config)
    out = inspect_report(trainer)
    print(json.dumps(out, indent=1) if args.json else format_inspect(out))
    if args.png:
        state, mem = out["state"], out["memory"]
        compiled = {"parameters": state["params"], "optimizer": state["opt_state"], "batch": state["batch"],
                    "temporaries": mem["temp"]}
        bars = [("compiled", compiled), ("analytic", report.analytic_parts(out["analytic"]["memory"]))]
        report.memory_png(bars, args.png, title=f"{config.rules} on {trainer.mesh.size} devices")
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    from jaxscale.analysis.timing import load_cluster

    cluster = load_cluster(args.cluster, args.cluster_overrides)
    model_dict = _read_yaml(resolve_named(args.model, "models"))
    config = load_config(None, [f"model={args.model}"])
    if args.verify:
        simulate(min(cluster.devices, MAX_SIMULATED))
    if args.attention:
        config.model.attention = args.attention  # what the analytic model assumes
        model_dict["attention"] = args.attention  # and what a written experiment runs
    if config.model.attention == "auto":  # the kernel the cluster's devices would run (ring comes with CP layouts)
        from jaxscale.models.attention import resolve_attention

        platform = "tpu" if "tpu" in cluster.device.lower() else "gpu"
        config.model.attention = resolve_attention(config.model, platform, args.seq_len)
    from jaxscale import report
    from jaxscale.analysis import plan
    from jaxscale.analysis.params import param_table

    params = param_table(config)
    result = plan.search(config.model, params, cluster, args.global_batch_tokens, args.seq_len, top=args.top)
    print(json.dumps(plan.plan_json(result), indent=1) if args.json else plan.table(result))
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
        path, rules = plan.write_experiment(layout, model_dict, args.seq_len, args.write)
        print(f"wrote layout {pick} to {path} and {rules}: jaxscale train --config {path}", file=sys.stderr)
    if args.verify:
        import jax

        from jaxscale.analysis.verify import format_verify, verify

        rows = verify(result.candidates[: args.verify], model_dict, args.seq_len)
        print()
        print(format_verify(rows, jax.device_count(), jax.default_backend()))
    return 0


def _report(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    from jaxscale import report

    path = report.run_png(args.run_dir, args.out)
    print(f"wrote {path}")
    if args.tensorboard:
        print(f"wrote {report.metrics_to_tensorboard(args.run_dir)}")
    return 0
