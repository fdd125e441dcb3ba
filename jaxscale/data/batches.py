"""Token data: deterministic global batches, each process reading only its own rows.

Three sources, chosen by ``data.source``:

- ``builtin`` (the default) and ``stdlib``: a stream of bytes (vocabulary 256),
  so the default model trains on real text with nothing downloaded. ``builtin``
  is the corpus shipped in ``jaxscale/data/corpus/``: jaxscale's own Markdown docs
  and Python sources at commit 58adbe3, in path order (620 KB), the same on
  every machine. ``stdlib`` is this Python's standard library ``.py`` files in
  sorted order (larger, but it differs between Python versions). The stream is
  the first ``max_bytes + eval_bytes`` bytes of the source (all of them if
  fewer); its last ``eval_bytes`` are held out. Row ``r`` of step ``s`` is a
  window of ``seq_len + 1`` bytes at an offset drawn from ``(seed, s)``.
- ``tokens``: a directory written by ``jaxscale prepare-data`` (see
  :mod:`jaxscale.data.prepare`). Its ``train`` tokens (documents packed, each
  followed by the end-of-document token) are cut into sequences of
  ``seq_len + 1`` tokens that overlap by one; grain's ``MapDataset.shuffle``
  permutes them afresh every epoch (a Feistel index shuffle: O(1) memory
  however long the data), and the global batch of step ``s`` is sequences
  ``s·B .. s·B + B - 1`` of that endless stream. Evaluation reads the ``val``
  split in order.

A weighted mixture of token sources (``data.mixture``, :class:`MixtureBatches`), in place of
``data.path``: each source is a ``prepare-data`` directory or a raw
source (:mod:`jaxscale.data.tokencache`), cut into sequences and shuffled per epoch as a single source is
(:class:`PackedBatches`, seed
``(train.seed + i) mod 2^32`` for source ``i``), repeated without end, and mixed by an exact deterministic
interleave (:mod:`jaxscale.config.interleave`): the weights, read as the decimals written, are exact fractions
``p_i / P``, row ``g`` of the mixed stream is the next sequence of the source that one period of ``P`` rows
(earliest deadline first) gives it, and after every ``n`` rows each source has given within one row of
``n·w_i`` (``|count_i(n) - n·w_i| < 1``), exactly ``n·w_i`` at every multiple of ``P``. The global batch of
step ``s``, rows ``s·B .. s·B + B - 1``, is a function of ``(weights, seed, s)``: no state to replay, a resume
is the straight run bit for bit.

**Weights changed on resume**: allowed (the checkpoint's loader state records them; the sources'
fingerprints and the seed must match). From the resumed step on, the rows are those the new weights
give at those steps: each source continues at the sequence the new weights would have reached by then,
so a source whose share grew skips some of its sequences and one whose share shrank sees some again.

**Metrics**: each logged step's ``share/<name>`` (each source's share of the rows of the steps since the previous
source) and, at each evaluation, ``eval_loss/<name>`` (each source's own held-out split, read in order).

An ``order`` puts each row's tokens, targets and positions in the order the
devices hold them (ring attention's zig-zag chunks); the loss, a mean over
tokens, is unchanged. Either way a batch is a function of ``(seed, step)`` alone, so a restart needs
no replay; the loader's small :meth:`Loader.state` (position, epoch, and the
identity of the data) is saved in every checkpoint and checked on resume, so a
run never silently continues on different data. Each process builds only the
rows its own devices hold (:func:`process_rows`) and hands them to
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import abc
import gzip
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale.config.interleave import Interleave
from jaxscale.config.read import Config, ConfigError
from jaxscale.data.packing import PackedBins, check_lengths
from jaxscale.data.prepare import TokenDir
from jaxscale.data.tokencache import token_dir

BYTE_VOCAB = 256
CORPUS = Path(__file__).resolve().parent / "corpus" / "jaxscale-58adbe3.txt.gz"
IGNORE = -1  # the target of a token not trained (a prompt's): jaxscale.ops.loss leaves it out of the mean
# The config keys behind the loader's identity (the rest, such as the sequence count, follow from them).
CONFIG_KEYS = {
    "seq_len": "train.seq_len", "global_batch": "train.global_batch", "seed": "train.seed",
    "source": "data.source", "max_bytes": "data.max_bytes", "fingerprint": "data.path (fingerprint)",
    "documents": "data.documents", "packing": "data.packing",
}


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Up to ``max_bytes`` bytes of the standard library's Python sources, in sorted path order, as uint8."""
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


def builtin_bytes(max_bytes: int) -> np.ndarray:
    """Up to ``max_bytes`` bytes of the corpus shipped with jaxscale, as uint8."""
    with gzip.open(CORPUS) as f:
        return np.frombuffer(f.read(max_bytes), dtype=np.uint8)


def byte_streams(source: str, max_bytes: int, eval_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The training and held-out bytes of ``source`` (``builtin`` or ``stdlib``): its first
    ``max_bytes + eval_bytes`` bytes (all of them if fewer), the last ``eval_bytes`` held out."""
    stream = (builtin_bytes if source == "builtin" else stdlib_bytes)(max_bytes + eval_bytes)
    if eval_bytes >= len(stream):
        raise ConfigError(f"data.eval_bytes ({eval_bytes}) leaves no training bytes of the {len(stream)} bytes "
                          f"of data.source={source}")
    return stream[: len(stream) - eval_bytes], stream[len(stream) - eval_bytes :]


class Loader(abc.ABC):
    """Global batches of ``(inputs, targets, positions)`` by step; subclasses supply :meth:`rows`."""

    def __init__(self, global_batch: int, seq_len: int, identity: dict[str, Any]):
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.identity = {**identity, "global_batch": global_batch, "seq_len": seq_len}
        # The order of each row's tokens, targets and positions (ring attention's zig-zag chunks).
        self.order = np.arange(seq_len, dtype=np.int32)
        self.boundary_targets = False  # data.boundary_targets: train a document's first token as a target
        # data.ring_balance: [rows, s] positions -> each row's token order, documents arranged for the ring
        self.balance: Callable[[np.ndarray], np.ndarray] | None = None

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``: inputs, targets (``IGNORE`` where a token is
        not trained, or begins a document unless ``boundary_targets``), positions (in ``order``)."""
        windows = self.windows(step, range(start, self.global_batch if stop is None else stop))
        if windows.ndim == 2:
            windows = np.stack([windows, np.ones_like(windows), np.broadcast_to(np.arange(self.seq_len + 1),
                                                                                windows.shape)], axis=1)
        tokens, trained, positions = windows[:, 0], windows[:, 1], windows[:, 2]
        order = np.broadcast_to(self.order, (len(tokens), self.seq_len))
        if self.balance is not None:  # each row's documents arranged to even the ring's tiles, then zig-zagged
            order = np.take_along_axis(self.balance(positions[:, : self.seq_len]), order, 1)
        inputs, targets = np.take_along_axis(tokens, order, 1), np.take_along_axis(tokens, order + 1, 1)
        keep = np.take_along_axis(trained, order + 1, 1) > 0
        if not self.boundary_targets:  # a document's first token, predicted from the one before (packed documents)
            keep &= np.take_along_axis(positions, order + 1, 1) != 0
        targets = np.where(keep, targets, IGNORE).astype(np.int32)
        return {"inputs": inputs, "targets": targets, "positions": np.take_along_axis(positions, order, 1)}

    @abc.abstractmethod
    def windows(self, step: int, rows: range) -> np.ndarray:
        """``[len(rows), seq_len + 1]`` int32 tokens of the given rows of the global batch of ``step``, or
        ``[len(rows), 3, seq_len + 1]``: the tokens, whether each is trained as a target (0 or 1), and each
        one's position (:class:`PackedSequences`)."""

    def metrics(self, first_step: int, stop_step: int) -> dict[str, float]:
        """What to log about the data of steps ``first_step .. stop_step - 1`` (a mixture: each source's share)."""
        return {}

    def by_source(self) -> dict[str, Loader]:
        """Each source's own loader by name, evaluated apart (a mixture's; none otherwise)."""
        return {}

    def global_batch_arrays(self, step: int, sharding: NamedSharding) -> dict[str, jax.Array]:
        """The global batch of ``step`` as sharded arrays, each process supplying its own rows."""
        shape = (self.global_batch, self.seq_len)
        start, stop = process_rows(sharding, shape)
        local = self.rows(step, start, stop)
        return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint records: the next step to read and the identity of the data."""
        return {"step": step, "sequences_read": step * self.global_batch, **self.identity}

    def check_state(self, saved: dict[str, Any], step: int) -> None:
        """Raise if a checkpoint's loader state is not this data, or not at ``step``; the message names
        the config key that differs (the settings first, then what follows from them, such as counts)."""
        keys = sorted(self.identity, key=lambda k: k not in CONFIG_KEYS)
        for key in keys:
            value = self.identity[key]
            if saved.get(key) != value:
                name = CONFIG_KEYS.get(key, f"the data's {key}")
                raise ConfigError(f"resume: the checkpoint was trained with {name}={saved.get(key)!r}, "
                                  f"this config has {value!r}")
        if saved.get("step") != step:
            raise ConfigError(f"resume: the checkpoint's loader is at step {saved.get('step')}, its state at {step}")


class Batches(Loader):
    """Windows at offsets drawn from ``(seed, step)`` in one token stream (the ``builtin`` and ``stdlib`` sources)."""

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int, identity: dict | None = None):
        if len(tokens) <= seq_len + 1:
            raise ConfigError(f"train.seq_len ({seq_len}) is longer than the data ({len(tokens)} tokens)")
        super().__init__(global_batch, seq_len, {**(identity or {}), "seed": seed, "tokens": len(tokens)})
        self.tokens = tokens
        self.seed = seed

    def windows(self, step: int, rows: range) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)[rows.start : rows.stop]
        return self.tokens[offsets[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)


class PackedSequences:
    """Random access to sequence ``i`` = ``tokens[i·L : i·L + L + 1]`` of a packed token stream, stacked
    ``[3, L + 1]`` with whether each token is trained as a target (``trained``: a prompt's are not) and its
    position.

    Concatenated (``starts`` None) the positions are ``0 .. L``. With the documents' ``starts`` (their
    offsets, then the stream's length: ``data.documents``) each token's position is its place in its
    document, restarting at 0 where one starts (where :meth:`Loader.rows` leaves the target untrained: it
    would be predicted from the document before).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, trained: np.ndarray | None = None,
                 starts: np.ndarray | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.trained = trained
        self.starts = starts

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        window = slice(index * self.seq_len, (index + 1) * self.seq_len + 1)
        tokens = np.asarray(self.tokens[window], np.int32)
        trained = np.ones_like(tokens) if self.trained is None else np.asarray(self.trained[window], np.int32)
        positions = np.arange(len(tokens), dtype=np.int32)
        if self.starts is not None:
            offsets = positions + window.start
            first = self.starts[np.searchsorted(self.starts, offsets, side="right") - 1]
            positions = (offsets - first).astype(np.int32)
        return np.stack([tokens, trained, positions])


class PackedBatches(Loader):
    """Packed documents of a ``prepare-data`` split; shuffled per epoch with ``seed``, in order without."""

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int | None, identity: dict,
                 trained: np.ndarray | None = None, starts: np.ndarray | None = None, first_fit: bool = False):
        if first_fit:  # whole documents, padded (jaxscale/data/packing.py)
            sequences = PackedBins(tokens, seq_len, trained, starts, identity.get("split", "train"))
        else:
            sequences = PackedSequences(tokens, seq_len, trained, starts)
        if len(sequences) == 0:
            raise ConfigError(f"train.seq_len ({seq_len}) is longer than the data ({len(tokens)} tokens)")
        super().__init__(global_batch, seq_len, {**identity, "seed": seed, "sequences": len(sequences)})
        self.sequences_per_epoch = len(sequences)
        dataset = grain.MapDataset.source(sequences)
        self.dataset = (dataset if seed is None else dataset.shuffle(seed=seed)).repeat()

    def windows(self, step: int, rows: range) -> np.ndarray:
        first = step * self.global_batch
        return np.stack([self.dataset[first + r] for r in rows])

    def state(self, step: int) -> dict[str, Any]:
        return {**super().state(step), "epoch": step * self.global_batch // self.sequences_per_epoch}


class MixtureBatches(Loader):
    """Rows drawn from several :class:`PackedBatches` by weight (this module's docstring)."""

    def __init__(self, parts: dict[str, PackedBatches], weights: list[float], identity: dict[str, Any]):
        first = next(iter(parts.values()))
        super().__init__(first.global_batch, first.seq_len, identity)
        self.parts, self.weights = parts, weights
        self.interleave = Interleave(weights)

    def windows(self, step: int, rows: range) -> np.ndarray:
        datasets = [p.dataset for p in self.parts.values()]
        sources, index = self.interleave.rows(step * self.global_batch + np.asarray(rows, np.int64))
        return np.stack([datasets[i][k] for i, k in zip(sources.tolist(), index.tolist(), strict=True)])

    def sources(self, step: int) -> np.ndarray:
        """The index of the source of each row of the global batch of ``step``."""
        return self.interleave.rows(step * self.global_batch + np.arange(self.global_batch))[0]

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


def make_loader(config: Config, split: str = "train", order: np.ndarray | None = None,
                balance: Callable[[np.ndarray], np.ndarray] | None = None) -> Loader:
    """The loader of ``split`` (``train``, or ``eval``: the held-out data) for ``config.data``, rows in ``order``;
    with ``balance`` (positions [rows, s] -> each row's token order: :func:`jaxscale.parallel.ring_balance.arranged`
    for the ring) each row's documents first arranged for it (``data.ring_balance``)."""
    loader = _loader(config, split)
    loader.boundary_targets, loader.balance = config.data.boundary_targets, balance
    if order is not None:
        loader.order = np.asarray(order, np.int32)
    return loader


def _loader(config: Config, split: str) -> Loader:
    d, t = config.data, config.train
    if d.source in ("builtin", "stdlib"):
        identity = {"source": d.source, "max_bytes": d.max_bytes}
        train, held_out = byte_streams(d.source, d.max_bytes, d.eval_bytes)
        if split == "train":
            return Batches(train, t.global_batch, t.seq_len, t.seed, identity)
        return Batches(held_out, t.global_batch, t.seq_len, t.seed, {**identity, "split": split})
    if d.mixture:
        return mixture_loader(config, split)
    tokens = open_tokens(config, d.path, "data.path")
    identity = {"source": "tokens", "fingerprint": tokens.meta["fingerprint"],
                **({"documents": True} if d.documents else {}), **({"packing": d.packing} if d.documents else {})}
    which, seed = ("train", t.seed) if split == "train" else ("val", None)
    return PackedBatches(tokens.tokens(which), t.global_batch, t.seq_len, seed,
                         {**identity, **({} if split == "train" else {"split": split})}, tokens.mask(which),
                         tokens.documents(which) if d.documents else None, d.packing == "first_fit")


def check_data(config: Config) -> TokenDir | None:
    """For ``data.source=tokens``: the prepared directory (each of a mixture's, returning None), checked against
    the model and sequence length; for ``stdlib``: the byte counts against the sequence length."""
    if config.data.source != "tokens":
        d, need = config.data, config.train.seq_len + 2  # a window of seq_len + 1 at one offset or more
        for key, count in (("data.max_bytes", d.max_bytes), ("data.eval_bytes", d.eval_bytes)):
            if count < need and (key == "data.max_bytes" or config.train.eval_every):
                raise ConfigError(f"{key} ({count}) is too few bytes for train.seq_len={config.train.seq_len} "
                                  f"(at least {need})")
        return None
    for i, part in enumerate(config.data.mixture or []):
        open_tokens(config, part.path, f"data.mixture[{i}].path")
    return None if config.data.mixture else open_tokens(config, config.data.path, "data.path")


def open_tokens(config: Config, path: str, key: str) -> TokenDir:
    """The token directory of ``path`` (the config key ``key``; a raw source is prepared into the cache first),
    checked against the model and sequence length."""
    tokens = TokenDir.open(token_dir(path, config.data, jax.process_count(), key))
    splits = ("train", "val") if config.train.eval_every else ("train",)
    check_files(tokens, splits)
    if tokens.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({config.model.vocab_size}) is below the {tokens.vocab_size} tokens of {key}={path}"
        )
    top = largest_token_id(tokens, splits)
    if top >= config.model.vocab_size:
        raise ConfigError(
            f"data.path: {tokens.path} holds token id {top}, not below model.vocab_size ({config.model.vocab_size}): "
            "the embedding has no row for it (a token file of another tokenizer, or damaged)"
        )
    for split in splits:
        count = tokens.meta["splits"][split]["tokens"]
        if count <= config.train.seq_len:
            raise ConfigError(
                f"{key}: the {split} split of {tokens.path} has {count} tokens, too few for "
                f"train.seq_len={config.train.seq_len}"
            )
        if config.data.packing == "first_fit":
            check_lengths(tokens.documents(split), config.train.seq_len, f"the {split} split of {key}={path}")
    return tokens


TOKEN_DTYPES = ("uint8", "uint16", "int32", "uint32")
SAMPLED_TOKENS = 1 << 20  # per split, read at an even stride


def largest_token_id(tokens: TokenDir, splits: tuple[str, ...]) -> int:
    """The largest token id of ``splits``: what ``meta.json`` records (``max_token_id``), and what a
    sample of each file holds (all of a file up to :data:`SAMPLED_TOKENS`; the only figure for
    directories written before ``max_token_id`` was recorded)."""
    recorded = tokens.meta.get("max_token_id")
    top = int(recorded) if isinstance(recorded, int) else -1
    for split in splits:
        data = tokens.tokens(split)
        if len(data):
            top = max(top, int(np.max(data[:: max(len(data) // SAMPLED_TOKENS, 1)])))
    return top


def check_files(tokens: TokenDir, splits: tuple[str, ...]) -> None:
    """Raise unless ``meta.json`` names an integer token dtype and each split's ``.bin`` file holds
    exactly the tokens it counts (a truncated or overlong file is refused, not read past its end)."""
    where = f"data.path: {tokens.path / 'meta.json'}"
    try:
        dtype, counts = tokens.meta["dtype"], {split: int(tokens.meta["splits"][split]["tokens"]) for split in splits}
        int(tokens.meta["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where} is not a prepare-data meta.json (bad or missing {e})") from e
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"{where}: dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    files = [(f"{split}.bin", count, dtype) for split, count in counts.items()]
    if tokens.meta.get("masked"):
        files += [(f"{split}.mask.bin", count, "uint8") for split, count in counts.items()]
    for name, count, kind in files:
        path = tokens.path / name
        size = path.stat().st_size if path.is_file() else None
        want = count * np.dtype(kind).itemsize
        if size != want:
            have = "is missing" if size is None else f"has {size} bytes"
            raise ConfigError(f"data.path: {path} {have}, meta.json says {count} {kind} tokens ({want} bytes): "
                              "truncated or not from this prepare-data run")


def process_rows(
    sharding: NamedSharding, shape: tuple[int, int], devices: Iterable[jax.Device] | None = None
) -> tuple[int, int]:
    """The contiguous range of batch rows held by ``devices`` (default: this process's devices)."""
    wanted = set(sharding.addressable_devices if devices is None else devices)
    index_map = {d: idx for d, idx in sharding.devices_indices_map(shape).items() if d in wanted}
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    start, stop = min(starts), max(stops)
    covered = sum(b - a for a, b in {(a, b) for a, b in zip(starts, stops, strict=True)})
    if covered != stop - start:
        raise ConfigError("this process's batch rows are not contiguous: order the mesh so processes own blocks")
    return start, stop
