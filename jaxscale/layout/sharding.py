"""Jax shardings from a :class:`~jaxscale.layout.rules.Layout`, and activation constraints by logical name.

The rules tables and every question about them live in :mod:`jaxscale.layout.rules`
(no jax); this module turns their answers into ``PartitionSpec`` and
``NamedSharding`` objects on a jax ``Mesh``. Activations are constrained by
logical name through :func:`constrain`, which reads the mesh and layout set by
:func:`use_rules` (a no-op outside it, so the model also runs unsharded); the
parallel modules ask :func:`active` for that layout. It is jaxscale's one
trace-time state: the layout also carries the pipeline's settings and, inside a
pipeline stage's loop, the :class:`~jaxscale.layout.rules.Stage` (:func:`stage`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxscale.config.axes import RESIDUAL
from jaxscale.config.read import ConfigError, PipelineConfig
from jaxscale.layout import collectives
from jaxscale.layout import rules as layout
from jaxscale.layout.rules import TOKENS, Axes, Layout, Stage, is_axes

__all__ = ["Axes", "Layout", "Rules", "is_axes"]


class Rules(layout.Rules):
    """A rules table (:class:`jaxscale.layout.rules.Rules`) that also gives jax ``PartitionSpec``s."""

    def spec(self, axes: Axes, kind: str = "params") -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions have these logical names."""
        return PartitionSpec(*self.partition(axes, kind))


def layout_of(mesh: Mesh | AbstractMesh, rules: layout.Rules) -> Layout:
    """``rules`` on the axis sizes of ``mesh``; its ``rules`` are :class:`Rules` (they give PartitionSpecs)."""
    if not isinstance(rules, Rules):
        rules = Rules(rules.name, rules.params, rules.optimizer, rules.gradients, rules.muon)
    return Layout(rules, dict(mesh.shape))


def spec(place: Layout, axes: Axes, kind: str = "params") -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions have these logical names under ``place``."""
    return PartitionSpec(*place.partition(axes, kind))


def param_name(path: Any) -> str:
    """The dotted name of a parameter's tree path: ``blocks.attn.wq``."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def named_params(params: Any, axes: Any) -> list[tuple[str, Any, Axes]]:
    """Every parameter leaf with its dotted name and its logical axes, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [
        (param_name(path), leaf, tuple(a))
        for (path, leaf), a in zip(flat, jax.tree.leaves(axes, is_leaf=is_axes), strict=True)
    ]


def variable_axes(path: str, variable: nnx.Variable) -> Axes:
    """The logical names of one variable's dimensions, from Flax's standard ``out_sharding`` metadata
    (``nnx.with_partitioning``, ``kernel_metadata={"out_sharding": ...}``, ``nnx.Param(..., out_sharding=...)``).

    Raises a one-line ConfigError naming ``path`` when the names are missing or do not fit the shape.
    """
    names = variable.get_metadata().get("out_sharding")
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    shape = jnp.shape(variable.get_value())
    if names is None:
        raise ConfigError(
            f"param {path} {shape} has no logical axis names: give it out_sharding metadata "
            "(nnx.with_partitioning, kernel_metadata={'out_sharding': (...)}, nnx.Param(..., out_sharding=...))"
        )
    if not is_axes(tuple(names)) or len(names) != len(shape):
        raise ConfigError(
            f"param {path} {shape}: logical axis names {names!r} are not one name or None per dimension "
            f"(give out_sharding {len(shape)} entries; in a unit stacked by nnx.vmap name the unit's own dimensions: "
            "transform_metadata={nnx.PARTITION_NAME: 'layers'} adds 'layers')"
        )
    return tuple(names)


def _keep_stacked(variable: nnx.Variable, index: int, name: str | None) -> None:
    """``on_add_axis`` hook of a stacked scalar: Flax's transforms give back the axis they took off
    (``nnx.scan`` over the stack) only to a non-empty ``out_sharding``, so it is given back here."""
    if name is not None and not variable.get_metadata().get("out_sharding"):
        variable.set_metadata(out_sharding=(name,))


def name_stacked_scalars(model: nnx.Module) -> None:
    """A scalar per stacked layer (``nnx.Param(..., out_sharding=())`` in a unit stacked by ``nnx.vmap``, which
    adds ``layers`` only to a non-empty tuple) named ``('layers',)``: a parameter of one dimension whose
    ``out_sharding`` is empty, in a module below the model whose other parameters lead with ``layers`` of that
    length (the rest stay as written, refused by :func:`variable_axes`)."""
    params = [(path, v) for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]

    def stacked(where: tuple, length: int) -> bool:
        return any(path[: len(where)] == where and tuple(v.get_metadata().get("out_sharding") or ())[:1] == ("layers",)
                   and jnp.shape(v.get_value())[:1] == (length,) for path, v in params)

    for path, variable in params:
        names, shape = variable.get_metadata().get("out_sharding"), jnp.shape(variable.get_value())
        if names is None or tuple(names) or len(shape) != 1 or len(path) < 2 or not stacked(path[:-1], shape[0]):
            continue
        hooks = variable.get_metadata().get("on_add_axis", ())
        hooks = (*(hooks if isinstance(hooks, tuple) else (hooks,)), _keep_stacked)
        variable.set_metadata(out_sharding=("layers",), on_add_axis=hooks)


def logical_axes(state: nnx.State) -> dict[str, Any]:
    """The logical names of every variable of ``state`` (:func:`variable_axes`), as a pure dict shaped like
    the state's values."""
    names = jax.tree_util.tree_map_with_path(
        lambda path, v: variable_axes(param_name(path), v), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.to_pure_dict(names)


def spec_axes(part: str | tuple[str, ...] | PartitionSpec | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple), or of a whole PartitionSpec."""
    if isinstance(part, PartitionSpec):
        return tuple(a for entry in part for a in spec_axes(entry))
    return layout.part_axes(part)


def shard_count(spec: PartitionSpec, mesh: Mesh) -> list[int]:
    """How many ways each dimension is split."""
    return [math.prod(mesh.shape[n] for n in spec_axes(part)) for part in spec]


def gather_shards(
    w: jax.Array, spec: PartitionSpec, keep: tuple[str, ...] = (), grads: jnp.dtype | None = None
) -> jax.Array:
    """Inside a manual ``shard_map``: all-gather ``w`` over every mesh axis of ``spec`` not in ``keep``.

    The FSDP gather of a weight whose other shards (tensor, expert) stay local; with ``grads``
    (:func:`jaxscale.precision.policy.weight_grads`), its gradient's reduce-scatter is in that dtype.
    """
    for dim, part in enumerate(spec):
        others = tuple(n for n in spec_axes(part) if n not in keep)
        if others:
            if grads is None:
                w = jax.lax.all_gather(w, others, axis=dim, tiled=True)
            else:
                w = collectives.all_gather(w, others, dim, jnp.dtype(grads))
    return w


def check_divisible(name: str, shape: tuple[int, ...], axes: Axes, spec: PartitionSpec, mesh: Mesh) -> None:
    """Raise if a dimension is not divisible by the mesh axes it is sharded over."""
    for dim, (size, logical, ways, part) in enumerate(zip(shape, axes, shard_count(spec, mesh), spec, strict=True)):
        if size % ways:
            raise ConfigError(
                f"{name}: dimension {dim} ('{logical}', size {size}) is not divisible by "
                f"mesh axes {part} of size {ways}"
            )


# The one trace-time state: the mesh and layout the code traced sees. Entered and left by :func:`use_layout`
# alone, read by :func:`active` alone (every reader, :mod:`jaxscale.precision.policy`'s included, asks it).
_ACTIVE: contextvars.ContextVar[tuple[Mesh | AbstractMesh, Layout] | None] = contextvars.ContextVar(
    "jaxscale_layout", default=None
)


def use_rules(
    mesh: Mesh | AbstractMesh, rules: layout.Rules, pipeline: PipelineConfig | None = None
) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`constrain` shards activations by ``rules`` on ``mesh``, and a pipelined model
    (rules with ``layers`` on ``stage``) runs with the ``pipeline`` settings (required then)."""
    return use_layout(mesh, dataclasses.replace(layout_of(mesh, rules), pipeline=pipeline))


@contextlib.contextmanager
def use_layout(mesh: Mesh | AbstractMesh, place: Layout) -> Iterator[None]:
    """Within this block the code traced sees ``place`` on ``mesh`` (:func:`active`); restored after it,
    however it ends. The one trace-time state of jaxscale: a pipeline stage's loop enters its own layout
    (its rules less the loop's manual axes, and its :class:`~jaxscale.layout.rules.Stage`)."""
    token = _ACTIVE.set((mesh, place))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh | AbstractMesh, Layout] | None:
    """The mesh and layout set by :func:`use_rules` or :func:`use_layout`, if any: the one reader of the
    trace-time state."""
    return _ACTIVE.get()


def platform() -> str:
    """The platform of the active mesh's devices (an abstract mesh's, such as a pipeline stage's, as the devices it
    was made from recorded it; jax's default devices outside one): compile-only GPUs under a CPU backend say gpu.
    Kernels are chosen by it at trace time, so a program holds the one it runs (``lax.platform_dependent`` leaves
    a conditional around the kernel, and XLA:CPU can deadlock on collectives inside one read back from jax's
    cache)."""
    current = active()
    if current is not None and isinstance(current[0], Mesh):
        return current[0].devices.flat[0].platform
    device = getattr(current[0], "abstract_device", None) if current is not None else None
    return device.platform if device is not None else jax.devices()[0].platform


def stage() -> Stage | None:
    """The pipeline stage whose loop the code is traced in, if any (:class:`~jaxscale.layout.rules.Stage`)."""
    current = active()
    return current[1].stage if current is not None else None


def stated(axes: Axes) -> NamedSharding | None:
    """The layout of an activation with these logical names where it must be stated: on explicit mesh axes (a
    contraction's ``out_sharding`` when both operands are split over the axes it sums); None on auto axes or
    outside :func:`use_rules` (the partitioner decides)."""
    current = active()
    if current is None or not jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        return None
    return NamedSharding(current[0], spec(current[1], axes))


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
    """Constrain an activation's sharding by the logical names of its dimensions."""
    current = active()
    if current is None:
        return x
    mesh, place = current
    if x.ndim != len(axes):
        raise ValueError(f"constrain: array of rank {x.ndim} given {len(axes)} axis names {axes}")
    part = spec(place, axes)
    check_divisible(f"activation {axes}", x.shape, axes, part, mesh)
    return collectives.lay_out(x, NamedSharding(mesh, part))


def lookup(
    table: jax.Array, tokens: jax.Array, dtype: jnp.dtype, grads: jnp.dtype | None = None
) -> jax.Array:
    """The embedding lookup: rows of ``table`` [vocab, embed] for ``tokens`` [batch, length] in ``dtype``, laid out
    as the residual stream (``RESIDUAL``); the table's gradient summed in ``grads``
    (:func:`jaxscale.layout.collectives.take`).

    The rows are looked up on the table's shards, so they come out split over the mesh axes of the
    table's ``embed``, for every token that those axes will split the batch or sequence over (the
    token ids are gathered there: 4 bytes a token). Each such mesh axis then moves on its own, from
    the hidden dimension to the batch or sequence dimension the rules give it (one all-to-all per
    axis, forward and backward); the backward's constraints bring the rows' gradients back to the
    table's layout, where each device scatters them into its slice of the table (summed over the
    replicas of HSDP's ``data`` once per microbatch). Left to find the path in one step, XLA finds
    none when the tokens and the table are split over different sets of axes (``ep_fsdp``: batch
    over fsdp x expert, embed over fsdp; ``fsdp_cp``: embed over fsdp x context, the sequence over
    context) and replicates the whole activation ("involuntary full rematerialization"), nor, in the
    backward, when the batch has replicas besides (HSDP, ``zero3`` and ``fsdp_tp`` with ``data`` > 1:
    it gathers the whole activation on every device, or all-reduces the whole table's gradient over
    every device). Where a dimension is split over the table's axes alone (batch over fsdp, embed
    over fsdp) and the vocabulary is not split, one all-to-all does it and XLA finds it; under
    sequence parallelism XLA gathers the whole table (over ``fsdp`` and ``tensor``): the lookup is
    left to the partitioner. With the vocabulary split as well (``fsdp_tp``), jax 0.12's partitioner
    costs each way of splitting the lookup on a dry run, one of which replicates the rows (the
    "involuntary full rematerialization" warning, for a way it then discards), and in the backward
    sums a table-sized gradient over ``fsdp`` in place of the all-to-all: that case is routed here.
    """
    current = active()
    if current is not None and jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        # Explicit axes: the rows gathered straight into the residual stream's layout, stated.
        out = NamedSharding(current[0], spec(current[1], RESIDUAL))
        return collectives.take(table, tokens, grads, out).astype(dtype)
    hidden = current[1].mesh_axes(("embed",)) if current is not None else ()
    target = [current[1].mesh_axes((name,)) for name in RESIDUAL] if current is not None else []
    vocab = current[1].mesh_axes(("vocab",)) if current is not None else ()
    if not hidden or (hidden in target[:2] and not vocab) or current[1].sequence_axes:
        # XLA's own path: one all-to-all moves the table's axes to the dimension they alone split.
        return constrain(collectives.take(table, tokens, grads).astype(dtype), RESIDUAL)
    mesh, place = current
    moves = {a: next((d for d in (0, 1) if a in target[d]), None) for a in hidden}
    given = [place.mesh_axes((name,)) for name in TOKENS]  # how the token ids arrive
    dims: list[list[str]] = [[], [], list(hidden)]
    for d in (0, 1):  # the token ids stay split over the axes that come before any moving one
        for a in given[d]:
            if a in hidden and d in moves.values():
                break
            if a not in hidden:
                dims[d].append(a)

    def layout(x: jax.Array) -> jax.Array:
        spec = PartitionSpec(*(tuple(d) or None for d in dims[: x.ndim]))
        return collectives.lay_out(x, NamedSharding(mesh, spec))

    x = layout(collectives.take(table, layout(tokens), grads).astype(dtype))
    for axis, dest in moves.items():
        if dest is not None:
            dims[2].remove(axis)
            dims[dest] = [a for a in target[dest] if a in (*dims[dest], axis)]
            x = layout(x)
    return constrain(x, RESIDUAL)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """``tree`` typed as varying over ``axes`` (each device's own values: no sum is inserted in autodiff)."""

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def varying(x: jax.Array) -> tuple[str, ...]:
    """The manual axes ``x`` is typed as varying over."""
    return tuple(jax.typeof(x).manual_axis_type.varying)
