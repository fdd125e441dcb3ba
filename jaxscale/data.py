"""Token data: byte-level text every machine has, sampled deterministically per step.

The built-in source is the Python standard library's own ``.py`` files, read
in sorted order and tokenised as bytes (vocabulary 256), so the default model
trains on real text with nothing downloaded. A batch is a function of
``(seed, step)`` alone: each of the ``global_batch`` rows is a window of
``seq_len + 1`` tokens at an offset drawn from that seed, which makes a run
reproducible and resumable without loader state. Each process builds only the
rows its own devices hold and hands them to
``jax.make_array_from_process_local_data``. An ``order`` puts each row's
tokens, targets and positions in the order the devices hold them (ring
attention's zig-zag chunks); the loss, a mean over tokens, is unchanged.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale.config import ConfigError, DataConfig

BYTE_VOCAB = 256


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Up to ``max_bytes`` bytes of the standard library's Python sources, as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_tokens(config: DataConfig) -> np.ndarray:
    """The token stream named by the data config."""
    if config.source != "stdlib":
        raise ConfigError(f"data.source: '{config.source}' is not a known source (stdlib)")
    return stdlib_bytes(config.max_bytes)


class Batches:
    """Deterministic batches of next-token windows from one token stream."""

    def __init__(
        self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int, order: np.ndarray | None = None
    ):
        if len(tokens) <= seq_len + 1:
            raise ConfigError(f"train.seq_len ({seq_len}) is longer than the data ({len(tokens)} tokens)")
        self.tokens = tokens
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        # The order of each row's tokens, targets and positions (ring attention's zig-zag chunks).
        self.order = np.arange(seq_len, dtype=np.int32) if order is None else np.asarray(order, np.int32)

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``: inputs, targets, positions."""
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)[start:stop]
        window = self.tokens[offsets[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        positions = np.broadcast_to(self.order, (len(offsets), self.seq_len))
        return {"inputs": window[:, self.order], "targets": window[:, self.order + 1], "positions": np.array(positions)}

    def global_batch_arrays(self, step: int, sharding: NamedSharding) -> dict[str, jax.Array]:
        """The global batch of ``step`` as sharded arrays, each process supplying its own rows."""
        shape = (self.global_batch, self.seq_len)
        start, stop = process_rows(sharding, shape)
        local = self.rows(step, start, stop)
        return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}


def process_rows(sharding: NamedSharding, shape: tuple[int, int]) -> tuple[int, int]:
    """The contiguous range of batch rows that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(shape)
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    start, stop = min(starts), max(stops)
    covered = sum(b - a for a, b in {(a, b) for a, b in zip(starts, stops, strict=True)})
    if covered != stop - start:
        raise ConfigError("this process's batch rows are not contiguous: order the mesh so processes own blocks")
    return start, stop
