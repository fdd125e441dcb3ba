"""``jaxscale prepare-data``: text files -> a directory of memory-mapped tokens.

Inputs are plain text files (one document each), JSONL files (``.jsonl``:
one document per line, its text in a string field, ``text`` by default),
Parquet or Arrow files and saved ``datasets`` directories (a row each, the same
field: :mod:`jaxscale.data.sources`); or prompt/response records (:mod:`jaxscale.data.documents`). The
tokenizer is either ``byte`` (built in: the UTF-8 bytes 0-255, end-of-document
256) or a local Hugging Face ``tokenizer.json``, read by the ``tokenizers``
package (nothing is downloaded). round(n x ``val_fraction``) of the n documents (at most
n - 1, so one input file works), those whose text hashes lowest, go to the ``val`` split
(whatever their position; a first pass over the inputs reads the hashes). The directory holds::

    meta.json          tokenizer, vocab_size, eod_id, dtype, per-split counts, fingerprint
    tokenizer.json     (Hugging Face tokenizers) a copy, so the directory decodes on its own
    {train,val}.bin    the tokens, uint16 (vocabulary <= 65536) or uint32, each document followed by eod
    {train,val}.docs.npy   int64 start offset of every document, then the split's length
    {train,val}.mask.bin   (prompt/response records: ``masked`` in meta.json) uint8 per token, 1 where the
                       token is trained as a target (the response and its eod), 0 for the prompt

The directory is written under a temporary name beside ``--out`` (``.NAME.partial-HOST-PID``) and renamed
when complete, so a preparation that fails or is interrupted (an error, Ctrl-C, SIGTERM) leaves nothing
half-written, no directory it created, and no earlier directory damaged; one that a killed process left
(its process on this host no longer running) is removed by the next preparation of that ``--out``,
with a warning line. An ``--out`` with contents is refused unless ``--overwrite``. ``meta.json`` also records
the largest token id written (``max_token_id``), checked against ``model.vocab_size`` before a run
compiles (:func:`jaxscale.data.batches.check_data`). This module does not import jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxscale.config.read import ConfigError
from jaxscale.data import documents

SPLITS = ("train", "val")
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255; the end-of-document token is 256."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8")


class HuggingFaceTokenizer:
    """A local ``tokenizer.json``; end-of-document is ``eod_token`` or the first known one in the vocabulary."""

    name = "huggingface"

    def __init__(self, path: str | Path, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise ConfigError("a tokenizer.json needs the tokenizers package (jaxscale[tokenizers])") from e
        try:
            self.tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ConfigError(f"--tokenizer {path}: not a readable tokenizer.json ({e})") from e
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = [eod_token] if eod_token else list(EOD_CANDIDATES)
        found = [t for t in candidates if self.tokenizer.token_to_id(t) is not None]
        if not found:
            raise ConfigError(
                f"--tokenizer {path}: no end-of-document token among {', '.join(candidates)}; name one with --eod-token"
            )
        self.eod_token = found[0]
        self.eod_id = int(self.tokenizer.token_to_id(found[0]))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(spec: str, eod_token: str | None = None) -> Tokenizer:
    """``byte`` or the path of a ``tokenizer.json``."""
    if spec == "byte":
        if eod_token:
            raise ConfigError("--eod-token: the byte tokenizer's end-of-document token is fixed (256)")
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ConfigError(f"--tokenizer: '{spec}' is neither 'byte' nor a tokenizer.json file")
    return HuggingFaceTokenizer(spec, eod_token)


def document_hash(text: str) -> int:
    """A 64-bit hash of a document's text: what decides its split."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def held_out_below(hashes: Sequence[int], val_fraction: float) -> int:
    """The hash below which a document is held out: round(n x ``val_fraction``) of the ``n`` documents
    (at most n - 1: one always trains), those of the smallest hashes. Position plays no part, and
    copies of one document land in the same split."""
    held = min(round(len(hashes) * val_fraction), len(hashes) - 1)
    return sorted(hashes)[held] if held > 0 else 0


class _SplitWriter:
    """Appends documents (each followed by eod) to ``<split>.bin`` and records their offsets."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, eod_id: int, masked: bool = False):
        self.path = out / f"{split}.bin"
        self.file = self.path.open("wb")
        self.mask = (out / f"{split}.mask.bin").open("wb") if masked else None
        self.dtype, self.eod = dtype, np.array([eod_id], dtype)
        self.starts: list[int] = []
        self.length = 0
        self.max_id = eod_id
        self.hash = hashlib.sha256()

    def add(self, ids: np.ndarray, trained: np.ndarray | None = None) -> None:
        data = np.concatenate([ids.astype(self.dtype), self.eod]).tobytes()
        self.file.write(data)
        self.hash.update(data)
        if self.mask is not None:  # the end-of-document token is trained
            mask = np.concatenate([trained, [True]]).astype(np.uint8).tobytes()
            self.mask.write(mask)
            self.hash.update(mask)
        self.starts.append(self.length)
        self.length += len(ids) + 1
        self.max_id = max(self.max_id, int(ids.max()) if len(ids) else 0)

    def close(self, out: Path, split: str) -> dict[str, int]:
        self.file.close()
        if self.mask is not None:
            self.mask.close()
        np.save(out / f"{split}.docs.npy", np.array([*self.starts, self.length], np.int64))
        return {"tokens": self.length, "documents": len(self.starts)}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, or a directory with contents unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = "a token directory" if (out / "meta.json").exists() else "a directory with files in it"
        raise ConfigError(
            f"--out {out} already exists ({what}): choose another directory, or pass --overwrite to replace it "
            "(the old one is kept until the new one is complete)"
        )


def _install(work: Path, out: Path) -> None:
    """Put the finished ``work`` directory at ``out``; a directory there before is removed only then."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.is_dir():
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def prepare_data(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: str = "byte",
    text_field: str = "text",
    val_fraction: float = 0.01,
    eod_token: str | None = None,
    overwrite: bool = False,
    prompt_field: str | None = None,
    response_field: str | None = None,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``out``; returns the metadata written to ``meta.json``. With ``prompt_field``
    and ``response_field``, records are prompt/response pairs trained on the response (:mod:`jaxscale.data.documents`).

    Written into a temporary directory beside ``out`` and renamed at the end: a run that fails (bad
    input, a full disk, Ctrl-C, SIGTERM) leaves ``out`` as it was and nothing it created; the temporary
    directories of ``out`` that killed processes left are removed first. An ``out`` with contents is refused
    unless ``overwrite``; then it is replaced only once the new directory is complete.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    tok = make_tokenizer(tokenizer, eod_token)
    out = Path(out).absolute()
    _check_out(out, overwrite)
    _remove_stale(out)
    work = out.with_name(f"{PARTIAL % out.name}{socket.gethostname()}-{os.getpid()}")
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # removed again unless filled
    try:
        with _terminate_as_exit():
            work.mkdir(parents=True)
            fields = documents.Fields(text_field, prompt_field, response_field)
            meta = _write(inputs, work, tok, tokenizer, fields, val_fraction)
            _install(work, out)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write ({e.strerror or e}); {out} is as it was") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for parent in made:  # deepest first; one that now holds ``out`` stays
            with contextlib.suppress(OSError):
                parent.rmdir()
    return meta


PARTIAL = ".%s.partial-"  # + HOST-PID: the directory being written


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Inside the block SIGTERM raises ``SystemExit(143)``, so that the cleanup around it runs (its default
    action ends the process at once); in the main thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(out: Path) -> None:
    """Remove the temporary directories of ``out`` that processes of this host left (killed: SIGKILL, a lost
    node) and that no longer run; another host's, or a live process's, are left alone."""
    for path in out.parent.glob(f"{glob.escape(PARTIAL % out.name)}*"):
        host, _, pid = path.name.removeprefix(PARTIAL % out.name).rpartition("-")
        if not pid.isdigit() or host not in ("", socket.gethostname()) or _running(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        print(f"jaxscale: warning: removed {path}, left by process {pid}, which is no longer running",
              file=sys.stderr, flush=True)


def _write(
    inputs: Sequence[str | Path], out: Path, tok: Tokenizer, tokenizer: str, fields: documents.Fields,
    val_fraction: float,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into the empty directory ``out``; ``meta.json`` last."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    masked = fields.prompt is not None
    writers = {split: _SplitWriter(out, split, dtype, tok.eod_id, masked) for split in SPLITS}

    # A first pass reads the documents for their hashes only: the held-out ones are chosen among all.
    cutoff = held_out_below([document_hash(t) for t in documents.keys(inputs, fields)], val_fraction)
    for key, ids, trained in documents.encode(tok, inputs, fields):
        writers["val" if document_hash(key) < cutoff else "train"].add(ids, trained)
    counts = {split: w.close(out, split) for split, w in writers.items()}
    if counts["train"]["documents"] == 0:
        files = f"{len(inputs)} input file{'s' * (len(inputs) != 1)}"
        raise ConfigError(f"no training documents in {files}: {documents.none_kept(inputs, fields)}")
    described: dict[str, Any] = {"kind": tok.name}
    if isinstance(tok, HuggingFaceTokenizer):
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        described["eod_token"] = tok.eod_token
    fingerprint = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    for w in writers.values():
        fingerprint.update(w.hash.digest())
    meta = {
        "tokenizer": described,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "max_token_id": max(w.max_id for w in writers.values()),
        "dtype": dtype.name,
        "splits": counts,
        "val_fraction": val_fraction,
        "masked": masked,
        "fingerprint": fingerprint.hexdigest(),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


@dataclasses.dataclass(frozen=True)
class TokenDir:
    """A directory written by :func:`prepare_data`."""

    path: Path
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> TokenDir:
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"data.path: {path} has no meta.json (write it with jaxscale prepare-data)") from e
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"data.path: cannot read {path / 'meta.json'}: {e}") from e
        return cls(path, meta)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def mask(self, split: str) -> np.ndarray | None:
        """Whether each token of the split is trained as a target (uint8, memory-mapped); None: every token."""
        if not self.meta.get("masked"):
            return None
        n = self.meta["splits"][split]["tokens"]
        return np.memmap(self.path / f"{split}.mask.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else None

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens, memory-mapped (read-only)."""
        n = self.meta["splits"][split]["tokens"]
        if n == 0:
            return np.zeros((0,), self.meta["dtype"])
        return np.memmap(self.path / f"{split}.bin", dtype=self.meta["dtype"], mode="r", shape=(n,))

    def documents(self, split: str) -> np.ndarray:
        """Start offsets of the split's documents, then its length."""
        return np.load(self.path / f"{split}.docs.npy")

    def tokenizer(self) -> Tokenizer:
        kind = self.meta["tokenizer"]
        if kind["kind"] == "byte":
            return ByteTokenizer()
        return HuggingFaceTokenizer(self.path / "tokenizer.json", kind["eod_token"])
