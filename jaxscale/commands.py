"""The ``inspect``, ``plan`` and ``report`` commands (argument parsing is in :mod:`jaxscale.cli`).

Configs and cluster files are read before jax is imported, so each command can ask for as many
simulated CPU devices as it needs (``inspect``: the experiment's mesh; ``plan --verify``: the
cluster's devices, at most :data:`MAX_SIMULATED`). A bad input prints one line and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from jaxscale import xla_flags
from jaxscale.config import ConfigError, ModelConfig, _read_yaml, load_config, requested_devices, resolve_named

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
    from jaxscale import inspect, report
    from jaxscale.train import Trainer

    trainer = Trainer.build(config)
    out = inspect.inspect_report(trainer)
    print(json.dumps(out, indent=1) if args.json else inspect.format_inspect(out))
    if args.png:
        state, mem = out["state"], out["memory"]
        compiled = {"parameters": state["params"], "optimizer": state["opt_state"], "batch": state["batch"],
                    "temporaries": mem["temp"]}
        bars = [("compiled", compiled), ("analytic", report.analytic_parts(out["analytic"]["memory"]))]
        report.memory_png(bars, args.png, title=f"{config.rules} on {trainer.mesh.size} devices")
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    from jaxscale import analytic

    cluster = analytic.load_cluster(args.cluster, args.cluster_overrides)
    model_dict = _read_yaml(resolve_named(args.model, "models"))
    config = load_config(None, [f"model={args.model}"])
    if args.verify:
        simulate(min(cluster.devices, MAX_SIMULATED))
    if args.attention:
        config.model.attention = args.attention  # what the analytic model assumes
        if "attention" in {f.name for f in dataclasses.fields(ModelConfig)}:
            model_dict["attention"] = args.attention  # and what a written experiment runs, where it can
    if config.model.attention == "auto":  # the kernel the cluster's devices would run (ring comes with CP layouts)
        from jaxscale.models.attention import resolve_attention

        platform = "tpu" if "tpu" in cluster.device.lower() else "gpu"
        config.model.attention = resolve_attention(config.model, platform, args.seq_len)
    from jaxscale import plan, report

    params = analytic.param_table(config)
    result = plan.search(config.model, params, cluster, args.global_batch_tokens, args.seq_len, top=args.top)
    print(json.dumps(plan.plan_json(result), indent=1) if args.json else plan.table(result))
    if args.png and result.candidates:
        bars = [(f"{i}. {c.layout.describe()}", report.analytic_parts(c.memory))
                for i, c in enumerate(result.candidates, 1)]
        report.memory_png(bars, args.png, cluster.budget, title=f"{args.model} on {cluster.devices} x {cluster.device}")
        print(f"wrote {args.png}", file=sys.stderr)
    if args.write:
        runnable = [i for i, c in enumerate(result.candidates, 1) if not c.layout.missing()]
        pick = args.pick or (runnable[0] if runnable else 1)
        if not 1 <= pick <= len(result.candidates):
            raise ConfigError(f"--pick {pick}: the plan has {len(result.candidates)} layouts")
        layout = result.candidates[pick - 1].layout
        if layout.missing():
            raise ConfigError(f"layout {pick} needs {', '.join(layout.missing())}, which this installation lacks")
        path, rules = plan.write_experiment(layout, model_dict, args.seq_len, args.write)
        print(f"wrote layout {pick} to {path} and {rules}: jaxscale train --config {path}", file=sys.stderr)
    if args.verify:
        import jax

        rows = verify(result.candidates[: args.verify], model_dict, args.seq_len)
        print()
        print(format_verify(rows, jax.device_count(), jax.default_backend()))
    return 0


def _scaled(layout: Any, devices: int) -> Any:
    """The layout with its data-parallel axes shrunk to ``devices`` (data first, then fsdp)."""
    data, fsdp = layout.data, layout.fsdp
    while data * fsdp * layout.devices // (layout.data * layout.fsdp) > devices:
        if data > 1:
            data //= 2
        elif fsdp > 1:
            fsdp //= 2
        else:
            raise ConfigError(f"{layout.describe()} needs more than {devices} devices without data parallelism")
    zero = layout.zero if data > 1 else 0
    return dataclasses.replace(layout, data=data, fsdp=fsdp, zero=zero)


def verify(candidates: list[Any], model: dict[str, Any], seq_len: int) -> list[dict[str, Any]]:
    """Compile each candidate on the simulated devices and put its compiled memory and collective bytes
    next to the analytic model's for the same step. Compute is float32 (XLA:CPU runs bf16 matmuls in
    f32, so only fp32 compares like with like); a layout wider than the devices is scaled down on its
    data-parallel axes; one that needs a module this build lacks is skipped, and model keys this build
    does not know (``--attention``) are left out, on both sides of the comparison. cuDNN attention
    compiles as ``blockwise`` (it keeps no s x s scores either)."""
    import jax

    from jaxscale import analytic, inspect, plan
    from jaxscale.train import Trainer

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fp32 = {**{k: v for k, v in model.items() if k in known}, "dtype": "float32"}
    if fp32.get("attention") == "cudnn":  # GPU only, and not in float32: the same flash-style memory on CPU
        fp32["attention"] = "blockwise"
    rows = []
    for cand in candidates:
        layout = cand.layout
        if layout.missing():
            rows.append({"layout": layout.describe(), "remat": layout.remat, "skipped": ", ".join(layout.missing())})
            continue
        small = _scaled(layout, jax.device_count())
        trainer = Trainer.build(plan.config_for(small, fp32, seq_len), jax.devices()[: small.devices])
        compiled = inspect.compile_step(trainer)
        prediction = analytic.predict_trainer(trainer)
        found = inspect.collectives(compiled.as_text(), trainer.mesh)
        rows.append({
            "layout": small.describe() + ("" if small == layout else f" (scaled from {layout.mesh_text})"),
            "remat": small.remat,
            "memory_predicted": prediction.memory["total"],
            "memory_compiled": inspect.memory(compiled)["total"],
            "comm_predicted": prediction.comm["total"],
            "comm_compiled": inspect.summarize(found)["total"]["rs_wire_bytes"],
        })
    return rows


def format_verify(rows: list[dict[str, Any]], devices: int, backend: str) -> str:
    lines = [
        f"verify: compiled on {devices} simulated {backend} devices, float32 compute; GB per device; "
        "collectives in the reduce-scatter reading",
        f"  {'layout':<48} {'remat':<9} {'memory':>9} {'compiled':>9} {'err':>7}   {'wire':>9} {'compiled':>9} "
        f"{'err':>7}",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"  {r['layout']:<48} {r['remat']:<9} skipped: needs {r['skipped']} (not in this build)")
            continue
        mem = 100 * (r["memory_predicted"] / r["memory_compiled"] - 1)
        comm = 100 * (r["comm_predicted"] / r["comm_compiled"] - 1) if r["comm_compiled"] else 0.0
        lines.append(
            f"  {r['layout']:<48} {r['remat']:<9} {r['memory_predicted'] / 1e9:>9.3f} "
            f"{r['memory_compiled'] / 1e9:>9.3f} {mem:>+6.1f}%   {r['comm_predicted'] / 1e9:>9.3f} "
            f"{r['comm_compiled'] / 1e9:>9.3f} {comm:>+6.1f}%"
        )
    return "\n".join(lines)


def _report(args: argparse.Namespace, simulate: Callable[[int], None]) -> int:
    from jaxscale import report

    path = report.run_png(args.run_dir, args.out)
    print(f"wrote {path}")
    if args.tensorboard:
        print(f"wrote {report.metrics_to_tensorboard(args.run_dir)}")
    return 0
