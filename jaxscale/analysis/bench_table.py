"""A bench report as text: the table of runs, the compile-time ratio between model depths, the footer, the JSON file.

Jax-free: it reads the report :func:`jaxscale.analysis.bench.run_suite` returns (or a written one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _num(x: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x * scale, fmt)


def compile_ratio(report: dict[str, Any]) -> dict[str, Any] | None:
    """Most versus fewest layers of the compiled rows: the ratios of XLA compile time and of lower +
    compile time, in wall time and in CPU time."""
    rows = [r for r in report["results"] if r["status"] == "ok" and r["steps"] == 0]
    if len(rows) < 2:
        return None
    low = min(rows, key=lambda r: r["model"]["layers"])
    high = max(rows, key=lambda r: r["model"]["layers"])
    out: dict[str, Any] = {"layers": (low["model"]["layers"], high["model"]["layers"])}
    for clock, suffix in (("wall", "time_s"), ("cpu", "cpu_time_s")):
        out[f"compile_{clock}"] = high[f"compile_{suffix}"] / low[f"compile_{suffix}"]
        both = [r[f"lower_{suffix}"] + r[f"compile_{suffix}"] for r in (high, low)]
        out[f"total_{clock}"] = both[0] / both[1]
    return out


def header(report: dict[str, Any]) -> list[str]:
    """The table's first lines: the devices, then the column names."""
    return [
        f"jaxscale bench: {report['devices']} x {report['device_kind']} ({report['backend']}), "
        f"jax {report['jax_version']}",
        f"{'name':<22} {'status':<8} {'params':>9} {'step ms':>9} {'blocked':>9} {'device':>9} {'host ms':>8} "
        f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'lower s':>8} {'comp. s':>8}"
        + (f" {'pred ms':>9} {'pred MFU':>8} {'pred/meas':>9}" if report.get("cluster") else ""),
    ]


def row_line(r: dict[str, Any]) -> str:
    """One row of the table."""
    if r["status"] != "ok":
        return f"{r['name']:<22} {r['status']:<8} {r['error']}"
    return (
        f"{r['name']:<22} {r['status']:<8} {r['params'] / 1e6:>8.1f}M {_num(r['step_time_s'], 1e3):>9} "
        f"{_num(r['step_time_blocked_s'], 1e3):>9} {_num(r['device_step_time_s'], 1e3):>9} "
        f"{_num(r['host_overhead_s'], 1e3):>8} {_num(r['tokens_per_s'], 1, '.0f'):>10} "
        f"{_num(r['tflops_per_device'], 1, '.3f'):>8} {_num(r['mfu'], 100, '.1f'):>6} "
        f"{r['lower_time_s']:>8.2f} {r['compile_time_s']:>8.2f}"
        + (f" {_num(r['predicted_step_time_s'], 1e3):>9} {_num(r['predicted_mfu'], 100, '.1f'):>8} "
           f"{_num(r['predicted_ratio']):>9}" if "predicted_step_time_s" in r else "")
    )


def table(report: dict[str, Any]) -> str:
    """A short text table of the report: :func:`header`, a :func:`row_line` per row, :func:`footer`."""
    return "\n".join([*header(report), *map(row_line, report["results"]), *footer(report)])


def footer(report: dict[str, Any]) -> list[str]:
    """The table's last lines: the compile-time ratio of a compile suite, the note on MFU on a CPU."""
    lines = []
    ratio = compile_ratio(report)
    if ratio is not None:
        low, high = ratio["layers"]
        lines.append(f"compile time, {high} vs {low} layers: XLA compile {ratio['compile_wall']:.2f}x wall, "
                     f"{ratio['compile_cpu']:.2f}x CPU; lower + compile {ratio['total_wall']:.2f}x wall, "
                     f"{ratio['total_cpu']:.2f}x CPU")
    if report["backend"] == "cpu":
        lines.append("MFU on CPU is against a nominal 1e11 FLOP/s per device: meaningless")
    return lines


def write(report: dict[str, Any], path: str | Path) -> Path:
    """The report as JSON at ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
