"""Where Muon's matrices are: which parameters are hidden matrices, their fan-in and fan-out, and the owner layout
on which each device holds whole matrices for the Newton-Schulz iteration.

Everything here is read from a parameter's logical axes and the rules table (no parameter name):

- **stack dimensions**: the leading dimensions named ``layers`` or ``expert``, or without a name (a stack of one
  dense layer); each matrix of the stack is orthogonalised on its own.
- **matrix dimensions**: the rest. A parameter is a *hidden matrix* (Muon) when it has two or more, none without a
  name and none in ``adamw_axes`` (default ``("vocab",)``: the embedding and the head); the others (norm scales,
  biases, routers, whose expert dimension has no name, embedding, head) take AdamW.
- **fan-in / fan-out**: a matrix whose last dimension is ``embed`` writes the residual stream (``wo``, ``w_down``):
  fan-out is that dimension and fan-in the others; else fan-in is the first dimension and fan-out the others
  (``wq [embed, heads, head_dim]`` is ``embed x heads*head_dim``).

**The owner layout** of a hidden matrix (:func:`owner_partition`) starts from its optimizer layout (the rules'
``optimizer`` section, which the momentum and the gradient arrive in) and moves every mesh axis that splits a matrix
dimension onto the stack dimensions, the first one that the axis divides (``layers`` before ``expert``). Under
``zero3``, ``[layers, embed, mlp]`` on ``P(None, 'fsdp', None)`` becomes ``P('fsdp', None, None)``: one all-to-all
over ``fsdp`` there and one back, after which each device holds ``layers / fsdp`` whole matrices. Stack axes already
split (``expert`` over ``expert``, ``layers`` over ``stage``) stay: those matrices are whole where they are and move
nothing; a pipeline stage orthogonalises its own layers. A mesh axis that divides no stack dimension pads the
first stack dimension with zero matrices until it does, where that moves fewer bytes (:func:`owner_layout`), else
is gathered (every device of it orthogonalises the same matrices: the all-to-all is then an all-gather). A rules
table may name the owner layout itself in a ``muon`` section (logical axis -> mesh axes, over the optimizer
section): it must leave the matrix dimensions whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxscale.config.read import ConfigError
from jaxscale.layout.rules import Axes, Layout, Part, part_axes

STACK_AXES = ("layers", "expert")
ADAMW_AXES = ("vocab",)


def stack_dims(axes: Axes) -> int:
    """How many leading dimensions stack matrices (named ``layers``, ``expert`` or without a name)."""
    n = 0
    while n < len(axes) and (axes[n] is None or axes[n] in STACK_AXES):
        n += 1
    return n


def is_hidden_matrix(axes: Axes, adamw_axes: Sequence[str] = ADAMW_AXES) -> bool:
    """Whether a parameter with these logical axes is orthogonalised by Muon (else it takes AdamW)."""
    matrix = axes[stack_dims(axes):]
    return len(matrix) >= 2 and all(a is not None and a not in adamw_axes for a in matrix)


def fan_split(axes: Axes) -> int:
    """The index of the first fan-out dimension of a hidden matrix (dimensions before it, after the stack, are
    its fan-in)."""
    first = stack_dims(axes)
    return len(axes) - 1 if axes[-1] == "embed" else first + 1


def fans(shape: Sequence[int], axes: Axes) -> tuple[int, int]:
    """A hidden matrix's fan-in and fan-out (products of its fan-in and fan-out dimensions)."""
    split, first = fan_split(axes), stack_dims(axes)
    fan_in = 1
    for n in shape[first:split]:
        fan_in *= n
    fan_out = 1
    for n in shape[split:]:
        fan_out *= n
    return fan_in, fan_out


def _section(place: Layout) -> dict[str, tuple[str, ...]]:
    return dict(getattr(place.rules, "muon", {}) or {})


def owner_partition(place: Layout, shape: Sequence[int], axes: Axes) -> tuple[Part, ...]:
    """The PartitionSpec entries of a hidden matrix's owner layout under ``place`` (module docstring), for the
    stack :func:`owner_layout` pads it to."""
    return owner_layout(place, shape, axes)[0]


def owner_layout(place: Layout, shape: Sequence[int], axes: Axes) -> tuple[tuple[Part, ...], tuple[int, ...]]:
    """The owner layout's PartitionSpec entries and the shape it holds: ``shape``, or with the first stack
    dimension padded with zero matrices so that the mesh axes no stack dimension divides own matrices too.

    Those axes would otherwise gather the matrices (each device orthogonalises all of them; an all-gather sends
    ``(k - 1)`` shards over ``k`` devices). Padding a stack of ``L`` to ``L'`` (a multiple of the axes' size
    ``k`` times the stack's own split) costs two all-to-alls of ``(k - 1) / k`` of the padded shard,
    ``2 (k - 1) L' / (k L)`` shards, and splits the iteration's work ``k`` ways: taken where it moves fewer
    bytes, ``2 L' < k L`` (``6`` layers over ``fsdp`` = 8 pad to 8: 2.33 shards against 7; one layer stays
    gathered)."""
    first = stack_dims(axes)
    section = _section(place)
    if section:
        return _named_owners(place, section, shape, axes), tuple(shape)
    given = [list(part_axes(p)) for p in place.partition(axes, "optimizer")]
    moving = [a for dim in given[first:] for a in dim]
    dims: list[list[str]] = [given[d] if d < first else [] for d in range(len(axes))]
    left = []
    for axis in moving:
        for d in range(first):
            if shape[d] % (place.size(dims[d]) * place.size((axis,))) == 0:
                dims[d].append(axis)
                break
        else:
            left.append(axis)
    padded = tuple(shape)
    if left and first:
        k, split = place.size(left), place.size(dims[0]) * place.size(left)
        stack = -(-shape[0] // split) * split
        if 2 * stack < k * shape[0]:
            dims[0] += left
            padded = (stack, *shape[1:])
    return tuple(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims), padded


def _named_owners(place: Layout, section: dict[str, tuple[str, ...]], shape: Sequence[int], axes: Axes
                  ) -> tuple[Part, ...]:
    """The owner layout a rules table's ``muon`` section names (over its optimizer section), checked."""
    rules = place.rules
    where = f"rules '{rules.name}' muon: {axes}"
    try:
        parts = type(rules)(rules.name, {**rules.table("optimizer"), **section}).partition(axes)
    except ConfigError as e:
        raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
    split = [p for p in parts[stack_dims(axes):] if part_axes(p)]
    if split:
        raise ConfigError(f"{where} keeps a matrix dimension split over {split[0]}: Newton-Schulz needs whole "
                          "matrices")
    for size, part in zip(shape, parts, strict=True):
        if size % place.size(part_axes(part)):
            raise ConfigError(f"{where}: a dimension of size {size} is not divisible by mesh axes {part}")
    return parts


def check(place: Layout, params: Sequence[tuple[str, Any, Axes]]) -> None:
    """Raise a one-line ConfigError naming the parameter if the rules' ``muon`` section cannot lay out a hidden
    matrix of ``params`` (name, array or shape struct, logical axes)."""
    for name, leaf, axes in params:
        if is_hidden_matrix(axes):
            try:
                owner_partition(place, leaf.shape, axes)
            except ConfigError as e:
                raise ConfigError(f"param {name}: {e}") from None
