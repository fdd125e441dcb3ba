"""A device's memory in use, and the sinks that record a run's metrics (console bar, JSONL, TensorBoard).

The FLOPs and MFU they record are counted by :mod:`jaxscale.flops`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm


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


def _before(record: dict[str, Any], step: int) -> bool:
    """Whether a record belongs to the run up to ``step`` updates (training records of earlier
    steps; evaluation and checkpoint records at ``step`` itself)."""
    return record["step"] < step or (record["step"] == step and "loss" not in record)


class MetricsLogger:
    """Writes one JSON object per logged step to ``metrics.jsonl``; shows a progress bar.

    Only the main process (``jax.process_index() == 0``) writes or prints. A resumed
    run passes ``resume_step``: the file keeps the records of earlier steps and
    drops those a crashed run logged after its last checkpoint. With ``tensorboard``
    every record also goes to ``<run_dir>/tensorboard`` (:mod:`jaxscale.report`).
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
            from jaxscale.report import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(run_dir)
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.exists():
                records = [json.loads(line) for line in self.path.read_text().splitlines() if line]
                kept = [r for r in records if _before(r, resume_step)]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
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
            self.bar.n = record["step"]
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_sec', 0):.0f}")
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
