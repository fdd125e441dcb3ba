"""jaxscale's one trace-time state: the mesh and layout that the code being traced sees.

Set by :func:`jaxscale.sharding.use_rules` and :func:`~jaxscale.sharding.use_layout`; read there and by
:func:`jaxscale.precision.einsum` (a split schedule's B or W slot), which :mod:`jaxscale.sharding` imports.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxscale.layout import Layout, Stage

ACTIVE: contextvars.ContextVar[tuple[Any, Layout] | None] = contextvars.ContextVar("jaxscale_layout", default=None)


def stage() -> Stage | None:
    """The pipeline stage whose loop the code is traced in, if any (:class:`~jaxscale.layout.Stage`)."""
    current = ACTIVE.get()
    return current[1].stage if current is not None else None
