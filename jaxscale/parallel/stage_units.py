"""A pipeline stage's stacked units: one unit run on its input in a
slot (its fp8 weight copies in scope, :func:`jaxscale.precision.fp8.using`),
a chunk of them, uneven stages' unused unit slots, the blocks' fp8 copies
made once a step, and each unit's gradient and amax history added where it
is kept.

Uneven stages (``pipeline.layers_per_stage``) give every chunk as many
unit slots as the largest; a chunk's unused slots are the identity
(:meth:`Units.used`, the one place that reads ``uneven``), their
gradients zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxscale.config.read import ModelConfig
from jaxscale.layout.sharding import vary
from jaxscale.parallel import weight_split
from jaxscale.parallel.stage_fsdp import Fsdp
from jaxscale.parallel.stage_gate import Mask, Skip
from jaxscale.parallel.stage_metrics import UNIT, Metrics
from jaxscale.parallel.stage_state import Unit, Weights, take
from jaxscale.precision import fp8

F32 = jnp.float32
T = TypeVar("T")


class Chunk(NamedTuple):
    """A chunk's forward: what its units give."""

    y: jax.Array  # its output (sent on)
    inputs: jax.Array  # each unit slot's input (kept), [slots, ...]
    obj: jax.Array  # its units' share of the aux objective
    metrics: Metrics  # each unit slot's, [slots, ...]


class Units:
    """The units side of a stage's program
    (:class:`~jaxscale.parallel.stage_program.StageProgram`, which holds
    what these read)."""

    stages: int
    counts: tuple[int, ...]
    slots: int
    block_graph: Any
    fsdp: Fsdp
    model: ModelConfig
    dtype: jnp.dtype
    gate: Skip | Mask
    rows: tuple[str, ...]
    spread: int
    share: Callable[[int, Metrics], jax.Array]
    zero_metrics: Callable[..., Metrics]

    @property
    def uneven(self) -> bool:
        """Whether the virtual stages differ in size."""
        return len(set(self.counts)) > 1

    def unit(self, lp: Unit, h: jax.Array,
             pos: jax.Array) -> tuple[jax.Array, Metrics]:
        """One stacked unit on ``h``: its output and its metrics, every
        one of them, in fp32."""
        params = self.fsdp.gather(lp.params) if self.fsdp.visit else lp.params
        unit = nnx.merge(self.block_graph, params, lp.histories)
        with fp8.using(unit, lp.copies):
            y, metrics = unit(h, pos)
        return y, jax.tree.map(lambda a: jnp.asarray(a, F32), metrics)

    def layer(self, lp: Unit, h: jax.Array, pos: jax.Array) -> tuple:
        """One stacked unit on ``h``: its output, its share of the model's
        aux objective, its metrics."""
        y, metrics = self.unit(lp, h, pos)
        # Each device of the stage's rows holds its rows' metrics (MoE's:
        # the microbatch's, summed over them by routing.route): a share of
        # the objective each, as the loss is summed over those devices.
        share = self.share(UNIT, metrics) / self.spread
        return vary((y, share, metrics), self.rows)

    def used(self, real: jax.Array, f: Callable[[], T],
             passed: Callable[[], T]) -> T:
        """``f()`` in a unit slot in use (``real``), else ``passed()``:
        uneven stages' unused slots."""
        if not self.uneven:
            return f()
        return self.gate.when(real, f, passed())

    def unit_slot(self, lp: Unit, h: jax.Array, pos: jax.Array,
                  real: jax.Array) -> tuple:
        """A unit slot of a chunk: the unit where ``real``, else the
        identity (its gradients zero)."""

        def passed() -> tuple:
            zero = (h, jnp.zeros((), F32), self.zero_metrics())
            return vary(zero, self.rows)

        return self.used(real, lambda: self.layer(lp, h, pos), passed)

    def units(self, chunk: jax.Array, stage: jax.Array) -> jax.Array:
        """How many units the stage's chunk ``chunk`` runs: those of
        virtual stage chunk·p + stage."""
        last = len(self.counts) - 1
        where = jnp.clip(chunk * self.stages + stage, 0, last)
        return jnp.asarray(self.counts)[where]

    def chunk_forward(self, pc: Unit, h: jax.Array, pos: jax.Array,
                      n: jax.Array) -> Chunk:
        """A chunk of ``n`` units in its slots."""

        def one(h: jax.Array, lk: tuple) -> tuple[jax.Array, tuple]:
            y, obj, met = self.unit_slot(lk[0], h, pos, lk[1] < n)
            return y, (h, obj, met)

        ks = jnp.arange(self.slots)
        y, (inputs, obj, met) = lax.scan(one, h, (pc, ks))
        return Chunk(y, inputs, jnp.sum(obj), met)

    def unit_input(self, w: Weights) -> jax.Array:
        """Zeros shaped as a unit's input: a microbatch's activations on
        this device."""
        shape = (*w.xs["inputs"].shape[1:], self.model.embed)
        return vary(jnp.zeros(shape, self.dtype), self.rows)

    def split_types(self, w: Weights) -> tuple[Any, Any]:
        """Split: the types of a unit's weight matmul outputs and distinct
        inputs (:func:`weight_split.types`)."""
        unit = take(take(w.blocks, 0), 0)
        pos = w.xs["positions"][0]
        return weight_split.types(
            lambda: self.layer(unit, self.unit_input(w), pos))

    def quantized(self, blocks: Unit) -> Any:
        """The e4m3 copies of the stage's fp8 weights, made once per step
        before the loop (:func:`jaxscale.precision.fp8.prepare`; none with
        precision.fp8 off), each varying over the loop's axes as the
        weights do."""
        if not blocks.histories:
            return {}
        model = nnx.merge(self.block_graph, blocks.params, blocks.histories)
        return {path: {name: q.mapped(lambda a: vary(a, self.rows), lambda a: a)
                       for name, q in made.items()}
                for path, made in fp8.prepare(model).items()}

    @staticmethod
    def add_unit_grad(acc: Any, chunk: jax.Array, k: jax.Array,
                      d_lp: Any) -> Any:
        """``acc`` plus unit ``k``'s gradient ``d_lp``, at chunk
        ``chunk``'s slot k."""

        def one(a: jax.Array, g: jax.Array) -> jax.Array:
            start = (chunk, k, *([0] * g.ndim))
            old = lax.dynamic_slice(a, start, (1, 1, *g.shape))
            new = old + g.astype(a.dtype)[None, None]
            return lax.dynamic_update_slice(a, new, start)

        return jax.tree.map(one, acc, d_lp)

    @staticmethod
    def add_amax(amax: Any, chunk: jax.Array, k: jax.Array, d_hp: Any,
                 valid: jax.Array) -> Any:
        """``amax`` with unit ``k``'s updated fp8 histories ``d_hp``
        (:mod:`jaxscale.precision.fp8`: a history's "gradient" is the
        history with this microbatch's amax pushed in) at chunk
        ``chunk``'s slot k: the largest of the microbatches' (as
        :func:`jaxscale.precision.fp8.combine`), where ``valid``."""

        def one(a: jax.Array, h: jax.Array) -> jax.Array:
            start = (chunk, k, *([0] * h.ndim))
            old = lax.dynamic_slice(a, start, (1, 1, *h.shape))
            new = jnp.where(valid, jnp.maximum(old, h[None, None]), old)
            return lax.dynamic_update_slice(a, new, start)

        return jax.tree.map(one, amax, d_hp)
