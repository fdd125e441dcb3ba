"""Skip or mask: how a pipeline stage leaves out what a slot does not
run, decided once (:func:`gate`) from its plan
(:attr:`jaxscale.layout.stage_plan.StagePlan.skip`).

A stage that leaves no mesh axis to the partitioner skips an idle slot
(or an unused unit slot, or the head on a stage that is not the last) by
a ``lax.cond`` (:class:`Skip`). With axes left to the partitioner, XLA's
SPMD partitioner cannot split the collectives of a conditional whose
branch differs between stages (a check fails in spmd_partitioner_util;
on CPU a collective-permute in a branch waits for every device): the
stage computes the slot on whatever it holds and masks the result
(:class:`Mask`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.layout.sharding import vary

T = TypeVar("T")
Out = TypeVar("Out", bound=NamedTuple)


@dataclasses.dataclass(frozen=True)
class Skip:
    """Idle work skipped by conditionals; each branch's values varying
    over the stage's ``rows``."""

    rows: tuple[str, ...]

    def when(self, pred: jax.Array, f: Callable[[], T], zeros: T) -> T:
        """``f()`` where ``pred``, else ``zeros``."""
        return lax.cond(pred, lambda: vary(f(), self.rows),
                        lambda: vary(zeros, self.rows))

    def at_end(self, here: jax.Array, anywhere: jax.Array,
               f: Callable[[], T], zeros: T) -> T:
        """``f()`` on the stage where ``here`` holds (the head on the last
        virtual stage, the embedding's gradient on the first), skipped
        elsewhere (``anywhere``: whether some stage runs it this tick)."""
        del anywhere
        return self.when(here, f, zeros)

    def slot(self, on: jax.Array, run: Callable[[], Out], zeros: Out,
             exact: tuple[str, ...] = ()) -> Out:
        """A whole slot: ``run()`` where ``on`` (a busy slot), else
        ``zeros`` (``exact``: see :meth:`Mask.slot`)."""
        del exact
        return self.when(on, run, zeros)


@dataclasses.dataclass(frozen=True)
class Mask:
    """Idle work computed and masked: every stage takes the same branch
    of each conditional."""

    rows: tuple[str, ...]

    def when(self, pred: jax.Array, f: Callable[[], T], zeros: T) -> T:
        """``f()`` where ``pred``, else ``zeros``: computed, then masked."""
        return jax.tree.map(lambda o, z: jnp.where(pred, o, z), f(), zeros)

    def at_end(self, here: jax.Array, anywhere: jax.Array,
               f: Callable[[], T], zeros: T) -> T:
        """``f()`` on the stage where ``here`` holds: the conditional takes
        the same branch on every stage, so ``f`` runs on every stage in
        the ticks where one needs it (``anywhere``), masked."""
        masked = functools.partial(self.when, here, f, zeros)
        return lax.cond(anywhere, lambda: vary(masked(), self.rows),
                        lambda: vary(zeros, self.rows))

    def slot(self, on: jax.Array, run: Callable[[], Out], zeros: Out,
             exact: tuple[str, ...] = ()) -> Out:
        """A whole slot, computed; its fields masked to ``zeros`` where
        not ``on``, but the ``exact`` ones: accumulators to which an idle
        slot (its cotangents zero) adds exact zeros."""
        out = run()
        masked = {k: self.when(on, lambda v=v: v, getattr(zeros, k))
                  for k, v in out._asdict().items() if k not in exact}
        return out._replace(**masked)


def gate(skip: bool, rows: tuple[str, ...]) -> Skip | Mask:
    """The stage's way of leaving out idle work: the one place that reads
    :attr:`~jaxscale.layout.stage_plan.StagePlan.skip`."""
    return Skip(rows) if skip else Mask(rows)
