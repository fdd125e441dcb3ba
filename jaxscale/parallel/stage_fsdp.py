"""FSDP inside a pipeline stage: how the stage's blocks enter its loop
over the FSDP axes it is manual over, are gathered, and how their
gradients leave it onto the shards.

``pipeline.fsdp=step``: the blocks enter the ``shard_map`` gathered over
FSDP's axes (once a step, by the partitioner, which keeps TP's split),
each device accumulates its own rows' gradients, whole, and hands them
out one per device (a leading dimension), summed onto the shards once
after the loop (:meth:`Fsdp.sum_shards`): no FSDP collective runs in a
tick. ``visit``: the blocks enter as shards and each layer is gathered
as a slot runs it (:meth:`Fsdp.gather`), its gradient reduce-scattered
right after its backward by the gather's transpose. (``tick`` leaves
FSDP's axes to the partitioner: none is gathered here.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.layout import collectives
from jaxscale.layout.sharding import Rules

F32 = jnp.float32
Dims = tuple[tuple[str, ...], ...]  # per dimension, the mesh axes


def flat(dims: Dims) -> tuple[str, ...]:
    """The mesh axes of every dimension's."""
    return tuple(a for axes in dims for a in axes)


@dataclasses.dataclass(frozen=True)
class Fsdp:
    """The stage's blocks over FSDP's and TP's axes, per parameter
    (leaves in tree order), past the leading ``layers``."""

    gathers: tuple[Dims, ...]  # FSDP's axes splitting each dimension
    shards: tuple[Dims, ...]  # TP's (and EP's) axes splitting each
    block_axes: tuple[tuple[str | None, ...], ...]  # logical, layers 1st
    visit: bool  # gathered per layer as a slot runs it

    def _whole(self, dims: Dims) -> bool:
        """Whether a gradient leaves the loop whole, one per device."""
        return bool(flat(dims)) and not self.visit

    def gather(self, params: Any) -> Any:
        """A unit's parameters gathered over FSDP's axes as a slot runs it
        (``visit``): in a backward slot's ``vjp`` the gather's transpose
        reduce-scatters the unit's gradient onto the shards, in fp32,
        right after its backward; the devices of a stage take the same
        branch of each conditional."""

        def one(w: jax.Array, dims: Dims) -> jax.Array:
            for dim, axes in enumerate(dims):
                if axes:
                    w = collectives.all_gather(w, axes, dim, F32)
            return w

        leaves, tree = jax.tree.flatten(params)
        pairs = zip(leaves, self.gathers, strict=True)
        return tree.unflatten([one(w, dims) for w, dims in pairs])

    def scatter(self, acc: Any, summed: tuple[str, ...]) -> Any:
        """Once per step, in the loop: the blocks' gradients summed over
        the manual row axes ``summed`` that split no block parameter; over
        those that do (FSDP's), already on the shards (``visit``), or each
        device's own sum handed out whole in a leading dimension that
        :meth:`sum_shards` reduces onto the shards."""

        def one(g: jax.Array, dims: Dims, shards: Dims) -> jax.Array:
            split = set(flat(dims)) | set(flat(shards))
            rest = tuple(a for a in summed if a not in split)
            g = lax.psum(g, rest) if rest else g
            return g[None] if self._whole(dims) else g

        leaves, tree = jax.tree.flatten(acc)
        parts = zip(leaves, self.gathers, self.shards, strict=True)
        return tree.unflatten([one(*a) for a in parts])

    def sum_shards(self, grads: Any, mesh: Mesh, rules: Rules) -> Any:
        """Once per step, outside the ``shard_map``: the gradients that
        each device of the stage's FSDP axes handed out whole summed onto
        the parameters' shards (``visit``: on them already)."""
        if self.visit:
            return grads

        def one(g: jax.Array, dims: Dims,
                axes: tuple[str | None, ...]) -> jax.Array:
            if not flat(dims):
                return g
            spec = PartitionSpec(*rules.spec(axes))
            return lax.with_sharding_constraint(
                jnp.sum(g, axis=0), NamedSharding(mesh, spec))

        leaves, tree = jax.tree.flatten(grads)
        parts = zip(leaves, self.gathers, self.block_axes, strict=True)
        return tree.unflatten([one(*a) for a in parts])

    def block_specs(self, stage: str) -> list[PartitionSpec]:
        """How each block parameter enters the ``shard_map``: split over
        ``stage`` and TP's axes (each device keeps its shard), and over
        FSDP's too with ``visit`` (else gathered over them)."""

        def one(gs: Dims, ts: Dims) -> PartitionSpec:
            dims = [((*g, *t) if self.visit else t) or None
                    for g, t in zip(gs, ts, strict=True)]
            return PartitionSpec(stage, *dims)

        pairs = zip(self.gathers, self.shards, strict=True)
        return [one(gs, ts) for gs, ts in pairs]

    def grad_specs(self, stage: str) -> list[PartitionSpec]:
        """How each block parameter's gradient leaves the ``shard_map``:
        as the parameter, behind a dimension over FSDP's axes where each
        device hands its own out whole."""
        specs = self.block_specs(stage)
        return [PartitionSpec(*((flat(d),) if self._whole(d) else ()), *s)
                for d, s in zip(self.gathers, specs, strict=True)]

    def stored(self, grads: Any) -> Any:
        """The gradients [(1,) v, slots, ...] as the stage's shard of the
        stack, [(1,) v·slots, ...]."""

        def one(d: jax.Array, dims: Dims) -> jax.Array:
            lead = 1 if self._whole(dims) else 0
            return d.reshape(*d.shape[:lead], -1, *d.shape[lead + 2:])

        leaves, tree = jax.tree.flatten(grads)
        pairs = zip(leaves, self.gathers, strict=True)
        return tree.unflatten([one(d, dims) for d, dims in pairs])
