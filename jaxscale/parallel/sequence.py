"""Megatron sequence parallelism (SP): explicit collectives at the edges of tensor-parallel regions.

With tensor parallelism alone, every device holds the whole residual stream
and each layer ends its attention and MLP with an all-reduce of ``b·s·h``.
Sequence parallelism (Korthikanti et al., 2022) shards the residual stream,
the norms and the residual adds on the sequence over the tensor axes (the
rules table maps ``norm_length`` to them), so those activations take 1/t of
the memory. Each tensor-parallel region then needs:

* on entry, an **all-gather** of its input over the sequence, fused with the
  column-parallel matmuls that consume it (:func:`column_parallel`; its
  backward is a reduce-scatter of the partial input gradients);
* on exit, a **reduce-scatter** of the row-parallel matmul's partial sums onto
  the sequence (:func:`row_parallel`; its backward is an all-gather).

Per layer and pass that is 2 x (all-gather + reduce-scatter) of ``b·s·h`` in
place of 2 all-reduces: the same wire bytes, 2·(t−1)/t·b·s·h·bytes each
(docs/formulas.md, "TP + SP"), and the activations between regions are 1/t.

Why by hand: the partitioner would express "partial sums -> sequence-sharded"
as an all-reduce followed by a slice; GPU and TPU pipelines rewrite that into
a reduce-scatter, XLA:CPU does not. A ``jax.shard_map`` that is manual over
the SP axes only (data, fsdp and the rest stay with the partitioner) states
the collective, so every backend runs the same program. The ``shard_map`` is
manual over every mesh axis (XLA cannot keep auto axes sharded through a
manual collective on a sub-group: it would gather the batch), so the weights'
other shards (FSDP on ``embed``) are all-gathered inside too, and their
gradients reduce-scattered. Which axes are SP axes is read from the rules
(``norm_length`` axes not in ``length``): with none, both functions are plain
einsums under sharding constraints and the partitioner's all-reduce does TP.
With context parallelism too (``length`` on ``context``), ``norm_length``
must list the context axes first (``[context, tensor]``), so that gathering
the SP shards gives back each device's context block.

With ``overlap=True`` (``model.tp_overlap``) the all-gather + einsums and the
einsum + reduce-scatter become collective matmuls
(:mod:`jaxscale.parallel.collective_matmul`): ring steps of ``ppermute``
interleaved with partial matmuls, the same bytes, overlappable on GPU/TPU;
on fp8 operands their recipe's (:func:`jaxscale.precision.fp8.kernels`). It needs SP axes
(:meth:`jaxscale.layout.rules.Layout.validate` says so at build); several SP axes form one ring over their product.

**Inside a pipeline stage** (the active layout's ``stage``, set by :mod:`jaxscale.parallel.pipeline`) no
``shard_map`` can nest in the loop's. Where the loop is manual over TP's axes too
(:attr:`jaxscale.layout.stage_plan.StagePlan.tensor`: :attr:`~jaxscale.layout.rules.Stage.tensor`), each device
holds its shard of the blocks' weights and both functions write the collectives themselves, over the
devices of one stage: a projection whose weight is split (a TP region) gathers its input on the sequence
over SP's axes first; leaving it, the partial sums are all-reduced over TP's axes, or reduce-scattered onto
the sequence over SP's (XLA:CPU runs the reduce-scatter too). Autodiff writes the backward: a region's input,
the same on every TP device, gets its gradient summed over them. A whole weight (the output head) reads each
device's own tokens as they are. Elsewhere in a stage the layout is left to the partitioner: both functions
are the plain einsums, and the constraints make XLA gather the sequence before a column-parallel matmul
and scatter the partial sums onto it after a row-parallel one (as an all-reduce and a slice on XLA:CPU).
Collective matmuls (``model.tp_overlap``) need the ``shard_map``: a stage refuses them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxscale.layout.rules import Stage
from jaxscale.layout.sharding import Axes, active, constrain, gather_shards, is_axes, spec, stage
from jaxscale.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision

SEQUENCE = "norm_length"


def _manual_tensor() -> Stage | None:
    """The pipeline stage the code is traced in, where its loop is manual over TP's axes."""
    current = stage()
    return current if current is not None and current.tensor else None


def _split(where: Stage, w_axes: Axes) -> bool:
    """Whether the stage's TP axes split a weight with these logical names (each device holds a shard)."""
    return any(name in where.split for name in w_axes if name)

def sequence_axes() -> tuple[str, ...]:
    """SP axes under the active rules that this module's collectives run over: mesh axes of size > 1 that
    shard ``norm_length`` but not ``length``; none inside a pipeline stage (the partitioner's there)."""
    current = active()
    return current[1].sequence_axes if current is not None and current[1].stage is None else ()


def _shard_map(fn, args: Sequence[Any], in_axes: Sequence[Axes], out_axes: Axes | Sequence[Axes]):
    mesh, place = active()
    out = spec(place, out_axes) if is_axes(out_axes) else tuple(spec(place, a) for a in out_axes)
    in_specs = tuple(_specs(arg, spec(place, a)) for arg, a in zip(args, in_axes, strict=True))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out)(*args)


def _specs(x: Any, s: PartitionSpec) -> Any:
    """The ``shard_map`` specs of an operand laid out as ``s``: an fp8 operand's scales and histories whole."""
    whole = PartitionSpec()
    return fp8.mapped(x, lambda _: s, scale=lambda _: whole, history=lambda _: whole)


def _arrays(fn: Callable[[jax.Array], jax.Array], x: Any) -> Any:
    """``fn`` applied to an operand's tensors: the array, or an fp8 operand's value and float8 values."""
    return fp8.mapped(x, fn)


class _Kind(NamedTuple):
    """What an operand's kind runs: its collective matmuls and its readers."""

    all_gather_matmul: Callable[..., Any]
    matmul_reduce_scatter: Callable[..., Any]
    readers: Callable[[Any, int], list[Any]]  # (x, n): x for n projections that read it


def _kind(x: Any, grads: jnp.dtype | None) -> _Kind:
    """Operand ``x``'s: its fp8 recipe's rings (:func:`jaxscale.precision.fp8.kernels`) and readers (the first
    updates the history, :func:`jaxscale.precision.fp8.sharing`), or the plain rings (weight gradients in
    ``grads``) and ``x`` itself ``n`` times."""
    if isinstance(x, fp8.Operand):
        ring = fp8.kernels(x.recipe)
        return _Kind(ring.all_gather_matmul, ring.matmul_reduce_scatter, fp8.sharing)
    gather, scatter = (functools.partial(f, grads=grads) for f in (all_gather_matmul, matmul_reduce_scatter))
    return _Kind(gather, scatter, lambda x, n: [x] * n)


def _gather_weight(w: Any, s: PartitionSpec, manual: tuple[str, ...], grads: jnp.dtype | None) -> Any:
    """:func:`gather_shards` of a weight; an fp8 weight's float8 values are gathered as they are (1 byte each)."""
    return fp8.mapped(w, lambda a: gather_shards(a, s, manual, grads), float8=lambda q: gather_shards(q, s, manual))


def column_parallel(
    x: jax.Array,
    x_axes: Axes,
    projections: Sequence[tuple[str, jax.Array, Axes, Axes]],
    overlap: bool = False,
    grads: jnp.dtype | None = None,
) -> list[jax.Array]:
    """All-gather ``x`` on the sequence, then ``einsum(eq, x, w)`` for each ``(eq, w, w_axes, out_axes)``.

    ``overlap`` (``model.tp_overlap``): the gather and the einsums as one collective matmul. ``grads``:
    the weight gradients' dtype (:func:`jaxscale.precision.policy.einsum`).
    """
    manual, where = sequence_axes(), _manual_tensor()
    if where is not None and where.sequence and any(_split(where, w_axes) for _, _, w_axes, _ in projections):
        x = _arrays(lambda a: lax.all_gather(a, where.sequence, axis=x_axes.index(SEQUENCE), tiled=True), x)
    if not manual:
        pairs = zip(projections, _kind(x, grads).readers(x, len(projections)), strict=True)
        return [constrain(precision.einsum(eq, x, w, grads), out) for (eq, w, _, out), x in pairs]
    _, place = active()
    dim = x_axes.index(SEQUENCE)
    w_specs = [spec(place, w_axes) for _, _, w_axes, _ in projections]

    def body(x: Any, *ws: Any) -> tuple[jax.Array, ...]:
        pairs = zip(projections, ws, w_specs, strict=True)
        weights = [(eq, _gather_weight(w, s, manual, grads)) for (eq, *_), w, s in pairs]
        if overlap:
            return tuple(_kind(x, grads).all_gather_matmul(x, weights, manual, dim))
        x = _arrays(lambda a: lax.all_gather(a, manual, axis=dim, tiled=True), x)
        xs = _kind(x, grads).readers(x, len(weights))
        return tuple(precision.einsum(eq, x, w, grads) for (eq, w), x in zip(weights, xs, strict=True))

    args = [_arrays(lambda a: constrain(a, x_axes), x), *(w for _, w, _, _ in projections)]
    return list(_shard_map(body, args, [x_axes, *(a for _, _, a, _ in projections)], [o for *_, o in projections]))


def row_parallel(
    equation: str,
    h: jax.Array,
    h_axes: Axes,
    w: jax.Array,
    w_axes: Axes,
    out_axes: Axes,
    overlap: bool = False,
    grads: jnp.dtype | None = None,
) -> jax.Array:
    """Leave a tensor-parallel region: ``einsum(equation, h, w)`` reduce-scattered onto the sequence.

    ``overlap`` (``model.tp_overlap``): the einsum and the reduce-scatter as one collective matmul.
    ``grads``: the weight gradient's dtype (:func:`jaxscale.precision.policy.einsum`).
    """
    manual, where = sequence_axes(), _manual_tensor()
    if where is not None and _split(where, w_axes):
        y = precision.einsum(equation, h, w, grads)
        summed = tuple(a for a in where.tensor if a not in where.sequence)
        y = lax.psum(y, summed) if summed else y
        if where.sequence:
            y = lax.psum_scatter(y, where.sequence, scatter_dimension=out_axes.index(SEQUENCE), tiled=True)
        return constrain(y, out_axes)
    if not manual:
        return constrain(precision.einsum(equation, h, w, grads), out_axes)
    _, place = active()
    w_spec = spec(place, w_axes)
    dim = out_axes.index(SEQUENCE)

    def body(h: Any, w: Any) -> jax.Array:
        w = _gather_weight(w, w_spec, manual, grads)
        if overlap:
            return _kind(h, grads).matmul_reduce_scatter(equation, h, w, manual, dim)
        y = precision.einsum(equation, h, w, grads)
        return lax.psum_scatter(y, manual, scatter_dimension=dim, tiled=True)

    return _shard_map(body, [_arrays(lambda a: constrain(a, h_axes), h), w], [h_axes, w_axes], out_axes)
