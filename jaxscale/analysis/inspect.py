"""The ``jaxscale inspect`` report: a compiled step next to the analytic model and docs/formulas.md.

:func:`step_report` compiles the step (unless given) and reports its memory
(:mod:`jaxscale.analysis.xla`), its collectives (:mod:`jaxscale.analysis.hlo`) and
docs/formulas.md's figures (:mod:`jaxscale.analysis.formulas`), as JSON-ready data;
:func:`inspect_report` adds the parameter table, the collectives grouped by kind, mesh axes and
phase, and the analytic model's prediction (:mod:`jaxscale.analysis.predict`);
:func:`format_inspect` prints it.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import jax
import numpy as np

from jaxscale.analysis.communication import EP_IMBALANCE
from jaxscale.analysis.formulas import formulas
from jaxscale.analysis.hlo import Collective, Taken, busy_slots, collectives, exchange_counted, grouped, summarize
from jaxscale.analysis.params import pipeline_table, trainer_inputs
from jaxscale.analysis.predict import predict
from jaxscale.analysis.xla import compile_step, memory, state_bytes
from jaxscale.config import selections
from jaxscale.config.schema import Config
from jaxscale.layout.sharding import named_params
from jaxscale.layout.stage_plan import assumed
from jaxscale.models import builtin


def branch_runs(trainer: Any) -> Taken | None:
    """How often a pipelined step's tick conditionals run, where its stages skip idle slots: on the schedule's
    busy slots (:func:`jaxscale.analysis.hlo.busy_slots`); None without a pipeline or with idle slots masked
    (their conditionals then run the head and the embedding's gradient on every stage where one needs them)."""
    params, layout, step = trainer_inputs(trainer)
    blocks = [p.axes for p in params if p.in_layers]
    if not layout.pipelined or not assumed(layout, trainer.config.model, blocks).skip:
        return None
    return busy_slots(pipeline_table(layout, step))


def step_collectives(trainer: Any, compiled: Any) -> tuple[list[Collective], str]:
    """The compiled step's collectives, those in a pipeline tick's conditionals counted on the busy slots that
    run them (:func:`branch_runs`), the dropless exchange's at equal load, and the line saying so
    (:func:`jaxscale.analysis.hlo.exchange_counted`; its loop's trip count is the routing's: not warned about)."""
    text = compiled.as_text()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "while .*: trip count unknown")
        found = collectives(text, trainer.mesh, branch_runs(trainer))
    return exchange_counted(text, found)


def _branches_line(taken: Taken | None) -> str:
    """What :func:`branch_runs` does to the counts, in a line (empty where it does nothing)."""
    if taken is None:
        return ""
    return (f"a pipeline tick's conditionals counted on the stage's busy slots: {taken.runs} of the loop's "
            f"{taken.trips} ticks (idle slots are skipped)")


def step_report(trainer: Any, compiled: Any = None) -> dict[str, Any]:
    """Compile the step (unless given) and report memory, collectives and the formulas; JSON-serialisable."""
    compiled = compile_step(trainer) if compiled is None else compiled
    found, exchange = step_collectives(trainer, compiled)
    report = {
        "rules": trainer.rules.name,
        "mesh": dict(trainer.mesh.shape),
        "backend": jax.default_backend(),
        "memory": memory(compiled),
        "state": state_bytes(trainer),
        "collectives": summarize(found),
        "exchange": exchange,
        "branches": _branches_line(branch_runs(trainer)),
        "formulas": formulas(trainer.config.model, *trainer_inputs(trainer)),
    }
    return json.loads(json.dumps(report))


def _spec_text(spec: Any) -> str:
    parts = [
        "None" if p is None else p if isinstance(p, str) else "(" + ",".join(p) + ")" for p in spec
    ]
    return "P(" + ", ".join(parts) + ")"


def param_rows(trainer: Any) -> list[dict[str, Any]]:
    """Every parameter: path, shape, logical axes, PartitionSpec (parameter and optimizer layouts), bytes per device."""
    named = named_params(trainer.abstract_state().params, trainer.axes)
    optimizer = jax.tree.leaves(trainer.param_shardings("optimizer"))
    rows = []
    for (path, leaf, logical), opt in zip(named, optimizer, strict=True):
        rows.append({
            "path": path,
            "shape": list(leaf.shape),
            "axes": list(logical),
            "spec": _spec_text(leaf.sharding.spec),
            "optimizer_spec": _spec_text(opt.spec),
            "bytes_per_device": math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize,
        })
    return rows


def inspect_report(trainer: Any, compiled: Any = None, asked: Config | None = None) -> dict[str, Any]:
    """:func:`step_report` plus the parameter table, grouped collectives, the analytic model, docs/formulas.md and
    the silent selections the trainer took (``asked``: the config before ``auto`` was resolved; default: the
    trainer's)."""
    compiled = compile_step(trainer) if compiled is None else compiled
    report = step_report(trainer, compiled)
    prediction = predict(trainer.config.model, *trainer_inputs(trainer))
    flows: dict[tuple[str, str], dict[str, Any]] = {}
    for f in prediction.flows:
        row = flows.setdefault((f.kind, ",".join(f.axes)), {"kind": f.kind, "axes": ",".join(f.axes),
                                                             "runs": 0.0, "wire_bytes": 0.0})
        row["runs"] += f.runs
        row["wire_bytes"] += f.wire_bytes
    report.update({
        "model": {
            **{k: getattr(trainer.config.model, k) for k in ("layers", "embed", "dtype", "param_dtype", "remat")},
            "builtin": trainer.factory is builtin.build,  # Llama-style or DeepSeek-V3-style: both modelled
        },
        "params": param_rows(trainer),
        "selections": selections.taken(selections.Facts(asked or trainer.config, trainer.config, trainer.layout,
                                                        trainer.builtin_model)),
        "collective_rows": grouped(step_collectives(trainer, compiled)[0]),
        "analytic": {
            "memory": prediction.memory,
            "collectives": sorted(flows.values(), key=lambda r: -r["wire_bytes"]),
            "comm": prediction.comm,
        },
    })
    return json.loads(json.dumps(report))


def _mb(x: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def format_inspect(report: dict[str, Any]) -> str:
    """The report as text: parameters, memory, collectives, each next to its analytic and docs/formulas.md figure."""
    mesh = " x ".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1) or "one device"
    lines = [f"rules {report['rules']} on {mesh} ({report['backend']}); bytes per device"]
    lines += [f"selected: {line} (docs/compatibility.md)" for line in report["selections"]]
    lines += ["", "parameters"]
    lines.append(f"  {'path':<26} {'shape':<22} {'logical axes':<36} {'PartitionSpec':<28} {'bytes':>10}")
    for p in report["params"]:
        axes = "(" + ", ".join(str(a) for a in p["axes"]) + ")"
        spec = p["spec"] + ("" if p["optimizer_spec"] == p["spec"] else f" opt {p['optimizer_spec']}")
        lines.append(f"  {p['path']:<26} {tuple(p['shape'])!s:<22} {axes:<36} {spec:<28} "
                     f"{_mb(p['bytes_per_device']):>10}")
    lines.append(f"  {'total':<115} {_mb(sum(p['bytes_per_device'] for p in report['params'])):>10}")

    mem, pred, ref = report["memory"], report["analytic"]["memory"], report["formulas"]
    lines += ["", "memory (compiled: memory_analysis; analytic: jaxscale.analysis; docs/formulas.md)"]
    lines.append(f"  compiled  arguments {_mb(mem['argument'])}  outputs {_mb(mem['output'])}  aliased "
                 f"{_mb(mem['alias'])}  temporaries {_mb(mem['temp'])}  total {_mb(mem['total'])}")
    parts = "  ".join(f"{k} {_mb(v)}" for k, v in pred.items() if k != "total" and v)
    err = pred["total"] / mem["total"] - 1 if mem["total"] else 0.0
    lines.append(f"  analytic  {parts}  total {_mb(pred['total'])} ({100 * err:+.1f}%)")
    state = report["state"]
    lines.append(f"  state     compiled shardings: params {_mb(state['params'])}  master {_mb(state['master'])}  "
                 f"optimizer {_mb(state['opt_state'])};  docs/formulas.md ZeRO-{ref['zero_stage']}, jaxscale's policy: "
                 + "  ".join(f"{k} {_mb(v)}" for k, v in ref["state_jaxscale"].items())
                 + ";  playbook (bf16 + fp32 master): "
                 + "  ".join(f"{k} {_mb(v)}" for k, v in ref["state_playbook"].items()))
    lines.append(f"  activations analytic {_mb(pred['activations'])}; docs/formulas.md (Korthikanti, bf16) "
                 f"{_mb(ref['activations_korthikanti_bf16'])}")

    lines += ["", "collectives of the compiled step (wire bytes per device per step; rs = reduce-scatter reading)"]
    lines.append(f"  {'kind':<51} {'mesh axes':<18} {'phase':<9} {'ops':>4} {'runs':>5} {'wire':>10} {'rs':>10}")
    for r in report["collective_rows"]:
        lines.append(f"  {r['kind']:<51} {r['axes']:<18} {r['phase']:<9} {r['count']:>4} {r['runs']:>5} "
                     f"{_mb(r['wire_bytes']):>10} {_mb(r['rs_wire_bytes']):>10}")
    by_kind = report["collectives"]["by_kind"]
    lines.append("  by kind: " + "  ".join(f"{k} {_mb(v['wire_bytes'])}" for k, v in by_kind.items()))
    total = report["collectives"]["total"]
    analytic_total = report["analytic"]["comm"]["total"]
    err = analytic_total / total["rs_wire_bytes"] - 1 if total["rs_wire_bytes"] else 0.0
    lines.append(f"  total: compiled {_mb(total['wire_bytes'])} (rs reading {_mb(total['rs_wire_bytes'])}); "
                 f"analytic {_mb(analytic_total)} ({100 * err:+.1f}% of the rs reading)")
    if report["exchange"]:
        lines.append(f"  {report['exchange']}; the analytic model assumes an imbalance of {EP_IMBALANCE}")
    if report["branches"]:
        lines.append(f"  {report['branches']}")
    lines.append("  analytic by kind and axes: " + "  ".join(
        f"{r['kind']} [{r['axes']}] {_mb(r['wire_bytes'])}" for r in report["analytic"]["collectives"]))
    refs = [(k, v) for k, v in ref.items() if k.endswith("_comm_bytes")]
    lines.append("  docs/formulas.md: " + "  ".join(f"{k.removesuffix('_comm_bytes')} {_mb(v)}" for k, v in refs)
                 + (f"  pipeline bubble {ref['pp_bubble']:.2f}" if "pp_bubble" in ref else ""))
    if not report["model"].get("builtin", True):
        lines += ["", "note: a model of your own (docs/models.md): the analytic and docs/formulas.md figures are those "
                  "of the built-in model of the config's model.* sizes; the compiled figures are this model's."]
    if report["model"]["dtype"] != "float32" and report["backend"] == "cpu":
        lines += ["", f"note: XLA:CPU computes {report['model']['dtype']} matmuls in float32, so its activation "
                  "collectives and buffers are float32 where a GPU or TPU keeps them in "
                  f"{report['model']['dtype']}; compare with --set model.dtype=float32."]
    return "\n".join(lines)
