"""Weighted mixtures of token sources (``data.mixture``), with grain's ``MapDataset.mix``.

Each source is a ``prepare-data`` directory or a raw source (:mod:`jaxscale.tokencache`), cut into
sequences and shuffled per epoch as a single source is (:class:`jaxscale.data.PackedBatches`, seed
``(train.seed + i) mod 2^32`` for source ``i``), repeated without end. grain mixes them by a deterministic
interleave: the weights are scaled to integers ``p_i`` (the smallest to 100, ``P = Σ p_i``), and row ``g``
of the mixed stream is the next sequence of the source whose count falls behind ``g·p_i/P``. So the
sources' shares are exact at every multiple of ``P`` rows and within a row or two of their weights in
between, and the global batch of step ``s``, rows ``s·B .. s·B + B - 1``, is a function of ``(weights,
seed, s)``: no state to replay, a resume is the straight run bit for bit.

**Weights changed on resume**: allowed (the checkpoint's loader state records them; the sources'
fingerprints and the seed must match). From the resumed step on, the rows are those the new weights
give at those steps: each source continues at the sequence the new weights would have reached by then,
so a source whose share grew skips some of its sequences and one whose share shrank sees some again.

**Metrics**: each logged step's ``share/<name>`` (each source's share of the rows of the steps since the previous
source) and, at each evaluation, ``eval_loss/<name>`` (each source's own held-out split, read in order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import numpy as np

from jaxscale.config import Config
from jaxscale.data import Loader, PackedBatches, open_tokens


class MixtureBatches(Loader):
    """Rows drawn from several :class:`PackedBatches` by weight (this module's docstring)."""

    def __init__(self, parts: dict[str, PackedBatches], weights: list[float], identity: dict[str, Any]):
        first = next(iter(parts.values()))
        super().__init__(first.global_batch, first.seq_len, identity)
        self.parts, self.weights = parts, weights
        self.dataset = grain.MapDataset.mix([p.dataset for p in parts.values()], weights)
        # The same interleave over each source's index alone: which source gives a row, without reading it.
        tags = [grain.MapDataset.source([i]).repeat() for i in range(len(parts))]
        self.selection = grain.MapDataset.mix(tags, weights)

    def windows(self, step: int, rows: range) -> np.ndarray:
        first = step * self.global_batch
        return np.stack([self.dataset[first + r] for r in rows])

    def sources(self, step: int) -> np.ndarray:
        """The index of the source of each row of the global batch of ``step``."""
        first = step * self.global_batch
        return np.array([self.selection[first + r] for r in range(self.global_batch)])

    def metrics(self, first_step: int, stop_step: int) -> dict[str, float]:
        counts = np.bincount(np.concatenate([self.sources(s) for s in range(first_step, stop_step)]),
                             minlength=len(self.parts))
        return {f"share/{name}": float(c / counts.sum()) for name, c in zip(self.parts, counts, strict=True)}

    def by_source(self) -> dict[str, Loader]:
        for part in self.parts.values():
            part.order, part.boundary_targets = self.order, self.boundary_targets
        return dict(self.parts)

    def state(self, step: int) -> dict[str, Any]:
        return {**super().state(step), "weights": dict(zip(self.parts, self.weights, strict=True))}


def mixture_loader(config: Config, split: str) -> MixtureBatches:
    """The mixture of ``config.data.mixture`` for ``split`` (``train``, or ``eval``: each source's ``val``
    split, in order)."""
    t, train = config.train, split == "train"
    parts, prints = {}, {}
    for i, part in enumerate(config.data.mixture):
        tokens = open_tokens(config, part.path, f"data.mixture[{i}].path")
        name = part.name or Path(part.path).name
        prints[name] = tokens.meta["fingerprint"]
        which, seed = ("train", (t.seed + i) % 2**32) if train else ("val", None)
        parts[name] = PackedBatches(tokens.tokens(which), t.global_batch, t.seq_len, seed,
                                    {"fingerprint": prints[name]}, tokens.mask(which),
                                    tokens.documents(which) if config.data.documents else None,
                                    config.data.packing == "first_fit")
    identity = {"source": "mixture", "fingerprints": prints, "seed": t.seed,
                **({"documents": True, "packing": config.data.packing} if config.data.documents else {}),
                **({} if train else {"split": split})}
    return MixtureBatches(parts, [part.weight for part in config.data.mixture], identity)
