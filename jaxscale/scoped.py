"""A context variable set for the length of a ``with`` block, then restored.

jaxscale's trace-time switches are such variables: the active rules (:func:`jaxscale.sharding.use_rules`),
the pipeline's settings, and what a pipeline stage's loop tells the code it traces (its layers are
recomputed, its ring is already manual, its sequence parallelism is the partitioner's).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``var`` is ``value`` inside the block and what it was before after it, however the block ends."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
