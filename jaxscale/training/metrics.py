"""A device's memory in use, and the sinks that record a run's metrics (console bar, JSONL, TensorBoard).

The FLOPs and MFU they record are counted by :mod:`jaxscale.config.flops`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxscale.training.report import TensorBoardWriter


def device_memory_in_use(device: jax.Device | None = None) -> int:
    """Bytes in use on one device: the allocator's figure, else the live arrays' shards there."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    total = 0
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device == device:
                total += math.prod(shard.data.shape) * shard.data.dtype.itemsize
    return total


def kept_aside(path: Path) -> Path:
    """Rename an earlier run's ``metrics.jsonl`` to the first free ``metrics.<k>.jsonl``; return it."""
    k = 1
    while path.with_name(f"{path.stem}.{k}{path.suffix}").exists():
        k += 1
    return path.rename(path.with_name(f"{path.stem}.{k}{path.suffix}"))


def drop_torn_line(path: Path) -> None:
    """Cut a last line that has no newline (a run killed while writing it), so appending starts a line."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class MetricsLogger:
    """Writes one JSON object per logged step to ``metrics.jsonl``; shows a progress bar.

    Only the main process (``jax.process_index() == 0``) writes or prints. Nothing
    logged before is lost: a resumed run passes ``resume_step`` and appends, after a
    ``{"step": resume_step, "event": "resumed"}`` record (:func:`jaxscale.training.report.read_records` drops
    what it supersedes); a fresh run into a directory whose ``metrics.jsonl`` holds
    records first renames that file ``metrics.<k>.jsonl`` (an ``event`` record at the
    top of the new file names it). With ``tensorboard``
    every record also goes to ``<run_dir>/tensorboard`` (:mod:`jaxscale.training.report`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        enabled: bool | None = None,
        bar: bool = True,
        resume_step: int | None = None,
        tensorboard: bool = False,
    ):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.history: list[dict[str, Any]] = []
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.tensorboard = None
        if self.enabled and tensorboard:
            self.tensorboard = TensorBoardWriter(run_dir)
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                drop_torn_line(self.path)
                with self.path.open("a") as f:
                    f.write(json.dumps({"step": resume_step, "event": "resumed"}) + "\n")
            elif self.path.exists() and self.path.stat().st_size > 0:
                aside = kept_aside(self.path)
                self.path.write_text(json.dumps({"step": 0, "event": "earlier_run_kept", "path": aside.name}) + "\n")
            else:
                self.path.write_text("")
            if bar:
                self.bar = tqdm(total=total_steps, initial=resume_step or 0, desc="train", unit="step",
                                dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.bar is not None and "loss" in record:
            self.bar.n = record["step"] + 1  # the record of step s comes with its update: s + 1 done
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_sec', 0):.0f}")
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
