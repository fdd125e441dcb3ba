"""Records -> token ids and loss masks, for ``prepare-data``.

A plain document is the tokens of its ``text`` field, every one trained. A prompt/response record
(``--prompt-field`` and ``--response-field``, JSONL or Parquet or any :mod:`jaxscale.sources` form) is the
prompt's tokens followed by the response's, each field tokenized on its own; its mask trains the
response's tokens (and the end-of-document token that follows them) as targets and not the prompt's:
the first trained prediction is the response's first token, read from the whole prompt. A record
missing either field is one line naming it; an empty document or response is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxscale.config import ConfigError
from jaxscale.sources import records

ENCODE_BATCH = 512


class Encoder(Protocol):
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


def _batches(paths: Sequence[str | Path], fields: tuple[str, ...]) -> Iterator[list[dict[str, str]]]:
    batch: list[dict[str, str]] = []
    for record in records(paths, fields):
        if record[fields[-1]]:
            batch.append(record)
        if len(batch) == ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def encode(
    tokenizer: Encoder,
    paths: Sequence[str | Path],
    text_field: str = "text",
    prompt_field: str | None = None,
    response_field: str | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each document's token ids and, for prompt/response records, whether each token is trained (bool)."""
    if (prompt_field is None) != (response_field is None):
        raise ConfigError("--prompt-field and --response-field go together (a prompt/response set needs both)")
    if prompt_field is None:
        for batch in _batches(paths, (text_field,)):
            for ids in tokenizer.encode_batch([r[text_field] for r in batch]):
                yield ids, None
        return
    for batch in _batches(paths, (prompt_field, response_field)):
        prompts = tokenizer.encode_batch([r[prompt_field] for r in batch])
        responses = tokenizer.encode_batch([r[response_field] for r in batch])
        for prompt, response in zip(prompts, responses, strict=True):
            ids = np.concatenate([prompt.astype(np.int64), response.astype(np.int64)])
            yield ids, np.arange(len(ids)) >= len(prompt)
