"""``jaxscale plan --verify``: compile planned layouts, next to their prediction.

Where the cluster file names a ``compile_target`` and its compiler is installed, :func:`verify_target`
compiles each layout as planned (its dtype, every device of the cluster, the target's XLA preset) for the
cluster's compile-only GPUs or TPU chips (:mod:`jaxscale.analysis.target`) and puts XLA's memory per device
next to the planner's and the device's HBM. Otherwise, on simulated CPU devices (:func:`verify`):
Compute is float32 (XLA:CPU runs bf16 matmuls in f32, so only fp32 compares like with like); a
layout wider than the devices is scaled down on its data-parallel axes (:func:`scaled`). Each row
holds the predicted and compiled memory per device and wire bytes per device per step, the latter
in the reduce-scatter reading (:attr:`jaxscale.analysis.hlo.Collective.rs_wire_bytes`). cuDNN
attention compiles as ``blockwise`` (GPU only, and not in float32; it keeps no s x s scores either), predicted
as ``blockwise`` too (its score tiles, which cuDNN keeps on chip, counted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxscale.analysis.accelerator import target_report
from jaxscale.analysis.hlo import summarize
from jaxscale.analysis.inspect import step_collectives
from jaxscale.analysis.plan import Candidate
from jaxscale.analysis.predict import predict_trainer
from jaxscale.analysis.strategy import Strategy, config_for
from jaxscale.analysis.target import Target, compile_only
from jaxscale.analysis.xla import compile_step, memory
from jaxscale.config.read import ConfigError
from jaxscale.training.trainer import Trainer


def scaled(layout: Strategy, devices: int) -> Strategy:
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


def verify(candidates: list[Candidate], model: dict[str, Any], seq_len: int) -> list[dict[str, Any]]:
    """Compile each candidate (float32, scaled to the devices) and put its compiled memory and collective
    bytes next to the analytic model's for the same step."""
    fp32 = {**model, "dtype": "float32"}
    if fp32.get("attention") == "cudnn":  # a GPU kernel in bf16: on CPU the blockwise kernel keeps as little
        fp32["attention"] = "blockwise"
    rows = []
    for cand in candidates:
        layout = cand.layout
        small = scaled(layout, jax.device_count())
        trainer = Trainer.build(config_for(small, fp32, seq_len), jax.devices()[: small.devices])
        compiled = compile_step(trainer)
        prediction = predict_trainer(trainer)
        found, _ = step_collectives(trainer, compiled)  # the dropless exchange at equal load
        rows.append({
            "layout": small.describe() + ("" if small == layout else f" (scaled from {layout.mesh_text})"),
            "remat": small.remat,
            "memory_predicted": prediction.memory["total"],
            "memory_compiled": memory(compiled)["total"],
            "comm_predicted": prediction.comm["total"],
            "comm_compiled": summarize(found)["total"]["rs_wire_bytes"],
        })
    return rows


def format_verify(rows: list[dict[str, Any]], devices: int, backend: str) -> str:
    lines = [
        f"verify: compiled on {devices} simulated {backend} devices, float32 compute (predicted in float32 too, "
        "not the plan table's dtype); GB per device; "
        "collectives in the reduce-scatter reading",
        f"  {'layout':<48} {'remat':<9} {'memory':>9} {'compiled':>9} {'err':>7}   {'wire':>9} {'compiled':>9} "
        f"{'err':>7}",
    ]
    for r in rows:
        mem = 100 * (r["memory_predicted"] / r["memory_compiled"] - 1)
        comm = 100 * (r["comm_predicted"] / r["comm_compiled"] - 1) if r["comm_compiled"] else 0.0
        lines.append(
            f"  {r['layout']:<48} {r['remat']:<9} {r['memory_predicted'] / 1e9:>9.3f} "
            f"{r['memory_compiled'] / 1e9:>9.3f} {mem:>+6.1f}%   {r['comm_predicted'] / 1e9:>9.3f} "
            f"{r['comm_compiled'] / 1e9:>9.3f} {comm:>+6.1f}%"
        )
    return "\n".join(lines)


def verify_target(candidates: list[Candidate], model: dict[str, Any], seq_len: int, target: Target) -> list[dict]:
    """Compile each candidate as planned for ``target``'s devices: XLA's memory per device, the planner's, HBM."""
    rows = []
    for cand in candidates:
        config = config_for(cand.layout, model, seq_len, [f"xla.preset={target.preset}"])
        trainer = Trainer.build(config, list(target.devices[: cand.layout.devices]))
        report = target_report(trainer, target)
        rows.append({"layout": cand.layout.describe(), "remat": cand.layout.remat,
                     "memory_predicted": report["planner_memory"], "memory_compiled": report["memory"]["total"],
                     "hbm_bytes": report["hbm_bytes"], "fits": report["fits"],
                     "compile_seconds": report["compile_seconds"]})
    return rows


def format_verify_target(rows: list[dict[str, Any]], target: Target) -> str:
    lines = [
        f"verify: compiled for {len(target.devices)} x {target.device_kind} ({target.name}, compile-only, xla.preset "
        f"{target.preset}); GB per device",
        f"  {'layout':<48} {'remat':<9} {'planner':>9} {'compiled':>9} {'err':>7} {'HBM':>7}  compiled",
    ]
    for r in rows:
        err = 100 * (r["memory_predicted"] / r["memory_compiled"] - 1)
        hbm = r["hbm_bytes"]
        verdict = "fits" if r["fits"] else f"does not fit ({(r['memory_compiled'] - hbm) / 1e9:.2f} GB over)"
        lines.append(f"  {r['layout']:<48} {r['remat']:<9} {r['memory_predicted'] / 1e9:>9.3f} "
                     f"{r['memory_compiled'] / 1e9:>9.3f} {err:>+6.1f}% {hbm / 1e9:>7.1f}  {verdict} "
                     f"(compiled in {r['compile_seconds']} s)")
    return "\n".join(lines)


def compile_top(candidates: list[Candidate], model: dict[str, Any], seq_len: int,
                compile_for: tuple[str, int, int] | None) -> tuple[list[dict[str, Any]], str]:
    """``plan --verify``'s rows and text: for ``compile_for`` (:func:`jaxscale.analysis.target.compile_only`'s
    name, devices, hosts) where given, else on the simulated devices jax has."""
    if compile_for is None:
        rows = verify(candidates, model, seq_len)
        return rows, format_verify(rows, jax.device_count(), jax.default_backend())
    target = compile_only(*compile_for)
    rows = verify_target(candidates, model, seq_len, target)
    return rows, format_verify_target(rows, target)
