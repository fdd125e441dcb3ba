"""``jaxscale prepare-data``: text files -> a directory of memory-mapped tokens.

Inputs are plain text files (one document each), JSONL files (``.jsonl``:
one document per line, its text in a string field, ``text`` by default),
Parquet or Arrow files and saved ``datasets`` directories (a row each, the same
field: :mod:`jaxscale.sources`). The
tokenizer is either ``byte`` (built in: the UTF-8 bytes 0-255, end-of-document
256) or a local Hugging Face ``tokenizer.json``, read by the ``tokenizers``
package (nothing is downloaded). A held-out share of the documents, chosen by
a low-discrepancy sequence (document ``i`` when ``frac(i·φ) < val_fraction``),
goes to the ``val`` split. The directory holds::

    meta.json          tokenizer, vocab_size, eod_id, dtype, per-split counts, fingerprint
    tokenizer.json     (Hugging Face tokenizers) a copy, so the directory decodes on its own
    {train,val}.bin    the tokens, uint16 (vocabulary <= 65536) or uint32, each document followed by eod
    {train,val}.docs.npy   int64 start offset of every document, then the split's length
    {train,val}.mask.bin   (prompt/response records: ``masked`` in meta.json) uint8 per token, 1 where the
                       token is trained as a target (the response and its eod), 0 for the prompt

``meta.json`` is written last, so a directory whose preparation was interrupted
is never read. This module does not import jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxscale import documents
from jaxscale.config import ConfigError

SPLITS = ("train", "val")
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
GOLDEN = (math.sqrt(5) - 1) / 2


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


def is_held_out(index: int, val_fraction: float) -> bool:
    """Whether document ``index`` belongs to the validation split."""
    return (index * GOLDEN) % 1.0 < val_fraction


class _SplitWriter:
    """Appends documents (each followed by eod) to ``<split>.bin`` and records their offsets."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, eod_id: int, masked: bool = False):
        self.path = out / f"{split}.bin.partial"
        self.file = self.path.open("wb")
        self.mask_path = out / f"{split}.mask.bin.partial"
        self.mask = self.mask_path.open("wb") if masked else None
        self.dtype, self.eod = dtype, np.array([eod_id], dtype)
        self.starts: list[int] = []
        self.length = 0
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

    def close(self, out: Path, split: str) -> dict[str, int]:
        self.file.close()
        np.save(out / f"{split}.docs.npy", np.array([*self.starts, self.length], np.int64))
        os.replace(self.path, out / f"{split}.bin")
        if self.mask is not None:
            self.mask.close()
            os.replace(self.mask_path, out / f"{split}.mask.bin")
        return {"tokens": self.length, "documents": len(self.starts)}


def prepare_data(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: str = "byte",
    text_field: str = "text",
    val_fraction: float = 0.01,
    eod_token: str | None = None,
    prompt_field: str | None = None,
    response_field: str | None = None,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``out``; returns the metadata written to ``meta.json``. With ``prompt_field``
    and ``response_field``, records are prompt/response pairs trained on the response (:mod:`jaxscale.documents`)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    tok = make_tokenizer(tokenizer, eod_token)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    masked = prompt_field is not None
    writers = {split: _SplitWriter(out, split, dtype, tok.eod_id, masked) for split in SPLITS}
    count = 0
    for ids, trained in documents.encode(tok, inputs, text_field, prompt_field, response_field):
        writers["val" if is_held_out(count, val_fraction) else "train"].add(ids, trained)
        count += 1
    counts = {split: w.close(out, split) for split, w in writers.items()}
    if counts["train"]["documents"] == 0:
        raise ConfigError(f"no training documents in {len(inputs)} input file(s) (documents: {count})")
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
        "dtype": dtype.name,
        "splits": counts,
        "val_fraction": val_fraction,
        "masked": masked,
        "fingerprint": fingerprint.hexdigest(),
    }
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "meta.json")
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
