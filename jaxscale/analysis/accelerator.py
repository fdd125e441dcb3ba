"""``jaxscale inspect --target``: the real step compiled for a GPU or TPU cluster, and what its program holds.

:func:`target_report` compiles a trainer built on a :class:`jaxscale.analysis.target.Target`'s compile-only
devices and reports, per device: the GEMMs by kind, cuDNN's fused attention, each collective kind as
asynchronous and overlapped, asynchronous with nothing between, or synchronous
(:mod:`jaxscale.analysis.program`), the transfers to and from host memory (:mod:`.host_transfers`), and the
memory XLA allocates against the device's HBM (and in host memory) and against the planner's prediction
(:mod:`jaxscale.analysis.predict`). :func:`format_target` prints it.
"""

from __future__ import annotations

import time
from typing import Any

from jaxscale.analysis import host_transfers, program
from jaxscale.analysis.predict import predict_trainer
from jaxscale.analysis.target import Target
from jaxscale.analysis.xla import compile_step, memory


def target_report(trainer: Any, target: Target, compiled: Any = None) -> dict[str, Any]:
    """Compile (unless given) and read the step for ``target``; JSON-serialisable."""
    start = time.perf_counter()
    compiled = compile_step(trainer) if compiled is None else compiled
    seconds = time.perf_counter() - start
    # host_temp: what the program allocates in host memory (offloaded activations, jaxscale/layout/offload.py)
    mem = {**memory(compiled), "host_temp": compiled.memory_analysis().host_temp_size_in_bytes}
    predicted = predict_trainer(trainer).memory["total"]
    text = compiled.as_text()
    return {
        "target": target.name,
        "device": target.device_kind,
        "devices": len(target.devices),
        "rules": trainer.rules.name,
        "mesh": {k: v for k, v in trainer.mesh.shape.items() if v > 1},
        "xla_preset": trainer.config.xla.preset,
        "compile_seconds": round(seconds, 1),
        **program.read(text).as_dict(),
        "host_transfers": host_transfers.read(text),
        "memory": mem,
        "hbm_bytes": target.hbm_bytes,
        "fits": mem["total"] <= target.hbm_bytes,
        "planner_memory": predicted,
    }


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def format_target(report: dict[str, Any]) -> str:
    """The report as text: a line per GEMM kind, attention and collective kind, then memory."""
    mesh = " x ".join(f"{a}={s}" for a, s in report["mesh"].items()) or "one device"
    lines = [f"{report['rules']} on {mesh}: {report['devices']} x {report['device']} (compile-only, "
             f"xla.preset {report['xla_preset']}, compiled in {report['compile_seconds']} s); per device, per step"]
    gemms = "  ".join(f"{k} {v}" for k, v in sorted(report["gemms"].items())) or "none"
    lines.append(f"  GEMMs            {gemms}")
    attention = report["attention"]
    lines.append("  fused attention  " + (f"cuDNN forward {attention.get('forward', 0)}, backward "
                                          f"{attention.get('backward', 0)}" if attention else "none"))
    for kind, row in sorted(report["collectives"].items()):
        lines.append(f"  {kind:<16} {row['overlapped']} async overlapping compute, {row['async_idle']} async with "
                     f"nothing between, {row['sync']} sync")
    mem, hbm = report["memory"], report["hbm_bytes"]
    verdict = "fits" if report["fits"] else f"does not fit: {_gib(mem['total'] - hbm)} over"
    lines.append(f"  memory           {_gib(mem['total'])} of {_gib(hbm)} HBM ({100 * mem['total'] / hbm:.1f}%): "
                 f"{verdict}; arguments {_gib(mem['argument'])}, temporaries {_gib(mem['temp'])}")
    moves = report["host_transfers"]
    lines.append(f"  host memory      {_gib(mem['host_temp'])} offloaded; {moves['async']} async transfers, "
                 f"{moves['overlapped']} overlapping compute")
    ratio = report["planner_memory"] / mem["total"] if mem["total"] else 0.0
    lines.append(f"  planner          {_gib(report['planner_memory'])} predicted ({ratio:.3f} of compiled)")
    return "\n".join(lines)
