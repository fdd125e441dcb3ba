"""Pictures and TensorBoard: memory breakdowns, a run's curves, live scalars.

matplotlib is optional (``pip install 'jaxscale[plot]'``) and imported only when a picture
is asked for; so is tensorboardX (``train.tensorboard: true``, or ``jaxscale report RUN_DIR
--tensorboard`` after the fact). tensorboardX is a small pure-Python writer of TensorBoard
event files (no TensorFlow, no torch), so runs can log where only jax is installed.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxscale.config.read import ConfigError

# Parts of a memory breakdown, in stacking order, with the keys of jaxscale.analysis.memory.memory they sum.
MEMORY_PARTS = {
    "parameters": ("params", "pipeline copies"),
    "master": ("master",),
    "optimizer": ("optimizer",),
    "gradients": ("gradients", "accumulator", "pipeline accumulator"),
    "activations": ("activations",),
    "peak transient": ("transient", "mask"),
    "batch": ("batch",),
}
# A run's panels after its losses and a mixture's shares: (metric key, y label).
RUN_CURVES = (("tokens_per_sec", "tokens/s"), ("memory_bytes", "memory"))
# An MoE run's panel: each MoE layer's max/mean expert load (a list per record, one value per layer).
LOAD_CURVE = ("moe_load_max", "max/mean expert load")


def check_pyplot() -> None:
    """Raise :class:`ConfigError` when matplotlib (the ``plot`` extra) is missing: before a command that will
    draw a picture runs anything."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("pictures need matplotlib: pip install 'jaxscale[plot]' (from a checkout: '.[plot]')")


def _pyplot() -> Any:
    check_pyplot()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def analytic_parts(memory: dict[str, float]) -> dict[str, float]:
    """An analytic memory breakdown (:func:`jaxscale.analysis.memory.memory`) in the parts a picture stacks."""
    return {part: sum(memory.get(k, 0.0) for k in keys) for part, keys in MEMORY_PARTS.items()}


def memory_png(bars: Sequence[tuple[str, dict[str, float]]], path: str | Path, budget: float | None = None,
               title: str = "memory per device") -> Path:
    """Stacked horizontal bars, one per ``(label, {part: bytes})``; a dashed line at ``budget`` bytes."""
    plt = _pyplot()
    parts = list(dict.fromkeys(part for _, bar in bars for part in bar))
    largest = max([sum(bar.values()) for _, bar in bars] + [budget or 0.0])
    scale, unit = (1e9, "GB") if largest >= 1e9 else (1e6, "MB")
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(bars) + 1.8))
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for part in parts:
        widths = [bar.get(part, 0.0) / scale for _, bar in bars]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if budget:
        ax.axvline(budget / scale, color="black", linestyle="--", label="usable memory")
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per device")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _before(record: dict[str, Any], step: int) -> bool:
    """Whether a record belongs to the run up to ``step`` updates (training records of earlier
    steps; evaluation and checkpoint records at ``step`` itself)."""
    return record["step"] < step or (record["step"] == step and "loss" not in record)


def current_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run as it stands: a ``resumed`` event at step N supersedes what was logged
    before it for steps after N (a crashed run's steps past its last checkpoint, trained again)."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if record.get("event") == "resumed":
            kept = [r for r in kept if _before(r, record["step"])]
        kept.append(record)
    return kept


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """:func:`current_records` of a ``metrics.jsonl`` (:func:`parse_records`)."""
    return current_records(parse_records(path))


def parse_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` as written. A last line cut short (a run killed while writing
    it) is left out; any other line that is not a JSON record is a :class:`ConfigError` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from e
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif number < len(lines):  # a complete line (a newline follows it)
            raise ConfigError(f"{path}: line {number} is not a metrics record: {line[:60]!r}")
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` as the run stands (those a resume superseded left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"no metrics.jsonl in {run_dir}")
    return read_records(path)


def _run_panels(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of a run's picture, each ``(y label, the metric keys drawn on it)``: the losses (training,
    evaluation, a mixture's per source), a mixture's shares, tokens/s, memory, and an MoE run's expert load."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    named = [k for k in keys if k.startswith("eval_loss/")]
    panels = [("loss", ["loss", *(["eval_loss"] if "eval_loss" in keys else []), *named])]
    shares = [k for k in keys if k.startswith("share/")]
    if shares:
        panels.append(("mixture share", shares))
    panels += [(label, [key]) for key, label in RUN_CURVES]
    return panels + ([(LOAD_CURVE[1], [LOAD_CURVE[0]])] if LOAD_CURVE[0] in keys else [])


def run_figure(run_dir: str | Path) -> Any:
    """The matplotlib figure of :func:`run_png` (its caller closes it): a panel per :func:`_run_panels`, a line per
    metric key, labelled by the key (records without it are skipped)."""
    plt = _pyplot()
    records = read_metrics(run_dir)
    panels = _run_panels(records)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True)
    for ax, (label, keys) in zip(axes, panels, strict=True):
        if keys == [LOAD_CURVE[0]]:
            _layer_lines(ax, [r for r in records if LOAD_CURVE[0] in r], LOAD_CURVE[0], label)
            continue
        scale = 1.0
        if keys == ["memory_bytes"]:
            largest = max((r["memory_bytes"] for r in records if r.get("memory_bytes") is not None), default=0)
            scale, unit = (1e9, "GB") if largest >= 1e9 else (1e6, "MB")
            label = f"{label} ({unit})"
            ax.set_ylim(0, 1.1 * largest / scale or None)  # from zero: a few bytes of jitter are not a curve
        for key in keys:
            points = [(r["step"], r[key] / scale) for r in records if r.get(key) is not None]
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=key)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)  # values as they are, no "+1.2e-3" offset
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    axes[0].set_title(str(run_dir))
    fig.tight_layout()
    return fig


def run_png(run_dir: str | Path, path: str | Path | None = None) -> Path:
    """Loss (training, evaluation, and a mixture's evaluation per source), a mixture's shares, tokens/s and
    memory over steps of a run, written as a PNG (``<run_dir>/report.png`` by default); an MoE run's max/mean
    expert load too, a line per MoE layer."""
    plt = _pyplot()
    fig = run_figure(run_dir)
    out = Path(path) if path is not None else Path(run_dir) / "report.png"
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise ConfigError(f"cannot write the report {out}: {e.strerror or e}") from e
    finally:
        plt.close(fig)
    return out


def _layer_lines(ax: Any, records: list[dict[str, Any]], key: str, label: str) -> None:
    """One line per MoE layer of the per-layer lists ``key`` of ``records``."""
    steps = [r["step"] for r in records]
    for layer, values in enumerate(zip(*(r[key] for r in records), strict=True)):
        ax.plot(steps, values, marker=".", label=f"MoE layer {layer}")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


class TensorBoardWriter:
    """Every numeric field of a metrics record as a TensorBoard scalar at its step (a per-layer list as
    ``key/<layer>``)."""

    def __init__(self, run_dir: str | Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ConfigError("TensorBoard logging needs tensorboardX: pip install 'jaxscale[plot]'") from e
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
                for layer, v in enumerate(value):
                    self.writer.add_scalar(f"{key}/{layer}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def metrics_to_tensorboard(run_dir: str | Path) -> Path:
    """Write a finished run's ``metrics.jsonl`` as TensorBoard events in ``<run_dir>/tensorboard``."""
    writer = TensorBoardWriter(run_dir)
    for record in read_metrics(run_dir):
        writer.write(record)
    writer.close()
    return Path(run_dir) / "tensorboard"
