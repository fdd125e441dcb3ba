"""First-fit packing (``data.packing: first_fit``): whole documents in padded sequences, none split.

Concatenation (``concat``, the default) cuts the token stream into sequences wherever ``seq_len`` falls,
splitting documents across sequences. First-fit keeps every document whole: in the split's order, each
document goes into the first of the open sequences (the last ``OPEN_BINS`` opened) with room for it, else
into a new one; a sequence holds ``seq_len + 1`` tokens (its inputs and its last target) and is padded
with untrained tokens of id 0 at position 0 after its documents. The assignment is computed once, when the
loader is built (a pass over the documents' lengths), so sequence ``i`` is random access as with
concatenation and the shuffled order per epoch, resume and process slicing are unchanged. grain's own
packing transforms are iterators (``IterDataset``), read in order with state to save; a fixed assignment
keeps the loader a function of ``(seed, step)``.

With ``data.documents`` each document's positions restart at 0 and attention stays within it, so a padded
sequence trains exactly as its documents one at a time. A document longer than ``seq_len + 1`` tokens
fits no sequence: the loader refuses the data in one line before anything compiles (concatenation, or a
longer ``train.seq_len``, trains it).
"""

from __future__ import annotations

import numpy as np

from jaxscale.config.read import ConfigError

OPEN_BINS = 64  # sequences still open to documents: a bounded search, as grain's num_packing_bins


def first_fit(lengths: np.ndarray, capacity: int, open_bins: int = OPEN_BINS) -> np.ndarray:
    """The sequence of each document of ``lengths`` tokens under first-fit into sequences of ``capacity``."""
    where = np.empty(len(lengths), np.int64)
    room = np.zeros(0, np.int64)  # the free tokens of the open sequences, oldest first
    first_open = 0  # the number of the oldest open sequence
    for i, n in enumerate(lengths):
        fits = np.nonzero(room >= n)[0]
        if len(fits):
            room[fits[0]] -= n
            where[i] = first_open + fits[0]
            continue
        if len(room) == open_bins:  # the oldest open sequence is closed
            room, first_open = room[1:], first_open + 1
        room = np.append(room, capacity - n)
        where[i] = first_open + len(room) - 1
    return where


def check_lengths(starts: np.ndarray, seq_len: int, where: str) -> np.ndarray:
    """The documents' lengths (from their ``starts``); a ConfigError if one is longer than ``seq_len + 1``."""
    lengths = np.diff(starts)
    if len(lengths) and lengths.max() > seq_len + 1:
        long = lengths > seq_len + 1
        raise ConfigError(f"data.packing=first_fit: {long.sum()} documents of {where} are longer than "
                          f"train.seq_len + 1 = {seq_len + 1} tokens (the longest {lengths.max()}): none is "
                          "split under first-fit (data.packing=concat splits them)")
    return lengths


class PackedBins:
    """Random access to packed sequence ``i``: ``[3, L + 1]`` tokens, whether each is trained as a target, and
    positions, as :class:`jaxscale.data.batches.PackedSequences` gives them."""

    def __init__(self, tokens: np.ndarray, seq_len: int, trained: np.ndarray | None, starts: np.ndarray, where: str):
        lengths = check_lengths(starts, seq_len, where)
        self.tokens, self.seq_len, self.trained, self.starts = tokens, seq_len, trained, starts
        bins = first_fit(lengths, seq_len + 1)
        order = np.argsort(bins, kind="stable")  # the documents of each sequence, in the split's order
        self.documents = order
        self.bounds = np.searchsorted(bins[order], np.arange(bins.max() + 2 if len(bins) else 1))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        out = np.zeros((3, self.seq_len + 1), np.int32)  # padding: token 0, untrained, position 0
        at = 0
        for d in self.documents[self.bounds[index] : self.bounds[index + 1]]:
            a, b = self.starts[d], self.starts[d + 1]
            n = b - a
            out[0, at : at + n] = self.tokens[a:b]
            out[1, at : at + n] = 1 if self.trained is None else self.trained[a:b]
            out[2, at : at + n] = np.arange(n)
            at += n
        return out
