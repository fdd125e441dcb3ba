"""Records -> token ids and loss masks, for ``prepare-data``.

A plain document is the tokens of its ``text`` field, every one trained. A prompt/response record
(``--prompt-field`` and ``--response-field``, JSONL or Parquet or any :mod:`jaxscale.data.sources` form) is the
prompt's tokens followed by the response's, each field tokenized on its own; its mask trains the
response's tokens (and the end-of-document token that follows them) as targets and not the prompt's:
the first trained prediction is the response's first token, read from the whole prompt. A record
missing either field is one line naming it; an empty document or response is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxscale.config.read import ConfigError
from jaxscale.data.sources import records

ENCODE_BATCH = 512


class Encoder(Protocol):
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class Fields:
    """The record fields read: ``text``, or ``prompt`` and ``response`` (both or neither)."""

    text: str = "text"
    prompt: str | None = None
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.response is None):
            raise ConfigError("--prompt-field and --response-field go together (a prompt/response set needs both)")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.text,) if self.prompt is None else (self.prompt, self.response)


def _batches(paths: Sequence[str | Path], fields: Fields) -> Iterator[list[dict[str, str]]]:
    """The records in batches of ``ENCODE_BATCH``, those with an empty text or response left out."""
    batch: list[dict[str, str]] = []
    for record in records(paths, fields.names):
        if record[fields.names[-1]]:
            batch.append(record)
        if len(batch) == ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _key(record: dict[str, str], fields: Fields) -> str:
    """The text a document is known by (its held-out choice hashes it): the text, or prompt NUL response."""
    return "\0".join(record[name] for name in fields.names)


def keys(paths: Sequence[str | Path], fields: Fields) -> Iterator[str]:
    """Each document's key (:func:`_key`), in order, without tokenizing: the first pass of ``prepare-data``."""
    for batch in _batches(paths, fields):
        yield from (_key(r, fields) for r in batch)


def encode(
    tokenizer: Encoder, paths: Sequence[str | Path], fields: Fields
) -> Iterator[tuple[str, np.ndarray, np.ndarray | None]]:
    """Each document's key, token ids and, for prompt/response records, whether each token is trained (bool)."""
    for batch in _batches(paths, fields):
        if fields.prompt is None:
            for record, ids in zip(batch, tokenizer.encode_batch([r[fields.text] for r in batch]), strict=True):
                yield _key(record, fields), ids, None
            continue
        prompts = tokenizer.encode_batch([r[fields.prompt] for r in batch])
        responses = tokenizer.encode_batch([r[fields.response] for r in batch])
        for record, prompt, response in zip(batch, prompts, responses, strict=True):
            ids = np.concatenate([prompt.astype(np.int64), response.astype(np.int64)])
            yield _key(record, fields), ids, np.arange(len(ids)) >= len(prompt)


def none_kept(paths: Sequence[str | Path], fields: Fields) -> str:
    """Why ``paths`` gave no document: no record at all, or every record's text (or response) field empty."""
    count = sum(1 for _ in records(paths, fields.names))
    if not count:
        return "they hold no records"
    kind = "text" if fields.prompt is None else "response"
    return (f"{'all ' * (count > 1)}{count} record{'s' * (count != 1)} {'have' if count > 1 else 'has'} an "
            f"empty {kind} field '{fields.names[-1]}' (a record with an empty {kind} is skipped)")
