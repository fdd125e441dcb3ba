"""Pipeline parallelism (PP): the layer stack split over the ``stage`` mesh axis, one SPMD loop of ticks.

When the rules put ``layers`` on ``stage`` (size p > 1), the loss of the model is computed by
:func:`objective` instead of the plain forward: embedding, the stacked blocks, final norm, output
head and loss all run inside one ``jax.shard_map`` that is manual over ``stage`` (and, for a dense
model, over the data-parallel axes that shard no block parameter and the context axes, whose ring
attention then runs its per-device kernel inside the loop,
:func:`~jaxscale.parallel.ring_attention.manual_ring`). Stage s stores layers ``[s·L/p, (s+1)·L/p)``;
with v chunks per stage (``pipeline.repeats``) it runs layer groups ``c·p + s`` for c < v, the
*virtual stages* a microbatch visits in turn round the ring. With ``pipeline.layers_per_stage`` the
virtual stages differ in size: each is a chunk of as many slots as the largest, its unused slots the
identity (:mod:`jaxscale.parallel.stage_layers`); a tick then lasts as long as the largest chunk,
whose slots every stage keeps room for.

**The loop** (:mod:`jaxscale.parallel.schedules` builds its table as data): the batch is cut into m
microbatches (``pipeline.microbatches``; row r of microbatch i is row r·m + i, so no device changes
rows). Each tick every stage runs at most one *forward slot* and then one *backward slot*, each a
``lax.switch`` over {idle, first, middle, last}: an idle slot costs no compute, the first virtual
stage embeds its microbatch's tokens, the last one runs the final norm, the output head and the
loss. The forward slot keeps the input of every layer of its chunk; the backward slot recomputes
each layer from its input under ``jax.vjp``, last layer first, and adds the parameter gradients to
fp32 accumulators; its input gradient goes to the previous stage. Both
messages of a tick (the forward's output, the backward's input gradient) travel by ``ppermute``
at the end of the tick and wait in slots of the receiver's buffers until used. The schedule
(``pipeline.schedule``: gpipe, circular, 1f1b, interleaved_1f1b) is only which slot runs what.

**Memory**: a stage keeps the layer inputs of its in-flight microbatches (``Table.act_slots`` of
them: m for GPipe, at most 2p for 1F1B in lock-step ticks, whatever m; L/(p·v) layers' b·s·h each)
plus, transiently, one layer's residuals inside the backward slot. The logits of one microbatch
live only inside the last stage's backward slot (none with ``model.loss_chunk``). **One
recompute**: each layer runs forward twice per microbatch (the forward slot, then the backward
slot's ``vjp``); neither ``model.remat``'s policy nor ``selective``'s attention checkpoint applies
inside a stage (:func:`~jaxscale.models.llama.recomputed`), so no layer is recomputed twice.

**What it communicates**, b·s·h the bytes of one microbatch's activations on a device:
collective-permute of 2 messages per tick (forward and backward), 2·ticks·b·s·h bytes in all,
where the playbook counts 2·v·m·b·s·h (the bubble's ticks send zeros, as an SPMD loop must);
once per step, the gradients of the embedding and head (replicated over ``stage``) are summed over
``stage`` and, for the manual data and context axes, the block gradients over those axes. Nothing else
crosses ``stage``: no stage sees another's activations but its neighbour's. Inside a stage the other
axes stay with the partitioner (FSDP gathers, TP all-reduces, GShard-style experts); the ring's
key/value blocks travel over ``context`` in every layer.

**Gradients for autodiff**: :func:`objective` is a ``jax.custom_vjp`` whose forward runs the
training table (every forward and backward, loss and gradients at once) and whose backward only
scales the gradients computed there by the cotangent; evaluation (no gradient) runs a
forward-only table, the loss in the last stage's forward slot. The MoE auxiliary losses enter each
chunk's objective with their weight, so their gradients flow through the same backward slots; the
metrics returned are not differentiable.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale import stage_layers
from jaxscale.config import ConfigError, PipelineConfig
from jaxscale.layout import TOKENS
from jaxscale.models import moe
from jaxscale.models.llama import recomputed
from jaxscale.models.params import logical_axes
from jaxscale.parallel import ring_attention, schedules, sequence
from jaxscale.parallel.schedules import FIRST, IDLE, LAST, Table
from jaxscale.scoped import scoped
from jaxscale.sharding import Rules, active, constrain, is_axes, use_rules

AXIS = "stage"

_CONFIG: contextvars.ContextVar[PipelineConfig | None] = contextvars.ContextVar("jaxscale_pipeline", default=None)


def use_pipeline(config: PipelineConfig) -> contextlib.AbstractContextManager[None]:
    """Within this block, a pipelined model runs with these microbatches, repeats and schedule."""
    return scoped(_CONFIG, config)


def table(config: PipelineConfig, p: int, train: bool = True) -> Table:
    """The loop's table for ``config`` on p stages (ConfigError if the schedule cannot run it)."""
    m = config.microbatches or p
    try:
        return schedules.build(config.schedule, p, m, config.repeats, train)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _put(buf: jax.Array, slot: jax.Array, x: jax.Array, whole: bool = True) -> jax.Array:
    """``buf`` with ``x`` in ``slot`` (unchanged for slot −1): the whole slot, or its leading part."""
    i = jnp.maximum(slot, 0)
    old = buf[i] if whole else lax.dynamic_slice_in_dim(buf[i], 0, x.shape[0])
    start = (i, *([0] * (buf.ndim - 1)))
    return lax.dynamic_update_slice(buf, jnp.where(slot >= 0, x, old)[None], start)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """``tree`` typed as varying over ``axes`` (each device's own values: no sum is inserted in autodiff)."""

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def objective(
    model: Any, batch: dict[str, jax.Array], head_loss: Callable[[Any, jax.Array, jax.Array], jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective of a pipelined :class:`~jaxscale.models.llama.Llama` on ``batch`` and its metrics.

    Mean cross-entropy plus the weighted MoE auxiliary losses (as the trainer's objective).
    ``head_loss(model, y, targets)`` is the mean loss of the stack's output ``y`` on one microbatch
    (final norm, head, cross-entropy), run on the last stage. Differentiable in the model's parameters.
    """
    mesh, place = active()
    config = _CONFIG.get() or PipelineConfig()
    p, v, c = place.stages, config.repeats, model.config
    m = config.microbatches or p
    train, evaluate = table(config, p), table(config, p, train=False)
    graphdef, blocks_state, rest = nnx.split(model, nnx.PathContains("blocks"), ...)
    block_graph, block_state = nnx.split(model.blocks)
    params = nnx.to_pure_dict(block_state)
    axes = logical_axes(block_state)
    layers = jax.tree.leaves(params)[0].shape[0]  # stacked slots (padded with uneven stages)
    counts = stage_layers.counts(config, c, p)  # units of each virtual stage
    uneven = len(set(counts)) > 1
    rules = place.rules

    def by_repeat(w: jax.Array, w_axes: tuple) -> jax.Array:
        # [layers, ...] -> [repeats, layers / repeats, ...]: stage s holds groups c*p + s of every chunk c.
        spec_ = PartitionSpec(None, *rules.spec(w_axes))
        return lax.with_sharding_constraint(w.reshape(v, layers // v, *w.shape[1:]), NamedSharding(mesh, spec_))

    params = jax.tree.map(by_repeat, params, axes, is_leaf=lambda a: isinstance(a, jax.Array))
    # Data-parallel axes that shard no block parameter are manual too, for a dense model: each device
    # then adds up its own gradients over the ticks, summed over those axes once after the loop. An
    # MoE model's routing statistics are over the whole microbatch, so it leaves them to the partitioner.
    block_axes = jax.tree.leaves(axes, is_leaf=is_axes)
    manual = place.stage_manual_axes(block_axes, c.moe is not None)
    # Context axes are manual too (a dense model): each device holds its blocks of every sequence, ring
    # attention passes keys and values round them inside the stage, and the loss and gradients are sums
    # over them as over the manual data axes.
    context = tuple(a for a in manual if a in place.stage_context_axes)
    data, summed = tuple(a for a in manual[1:] if a not in context), manual[1:]
    inner = Rules(rules.name, {name: tuple(a for a in to if a not in manual) for name, to in rules.params.items()})
    # A slot that has nothing to do is skipped by a conditional when no mesh axis is left to the
    # partitioner inside a stage. Otherwise it computes on zeros and its results are masked: XLA's
    # SPMD partitioner cannot split the collectives of a conditional whose branch differs between
    # stages (a check fails in spmd_partitioner_util; on CPU a collective-permute in a branch waits
    # for every device). The head (and the embedding's gradient), which one stage needs in some
    # ticks, then runs in a conditional whose predicate comes from the tick's row of the table: the
    # same on every stage, so every stage runs it in those ticks and keeps it only where it belongs.
    skip = not place.stage_partitioned(block_axes, c.moe is not None)
    steps = sum(counts)  # stacked units: blocks, or groups of blocks with one MoE layer each

    def split(x: jax.Array) -> jax.Array:
        # Row r of microbatch i is row r * m + i: each device keeps its own rows.
        return constrain(x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), (None, *TOKENS))

    micro = {k: split(batch[k]) for k in ("inputs", "positions", "targets")}
    outer = nnx.to_pure_dict(rest)
    outer_axes = logical_axes(rest)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks_state)
    dtype = jnp.dtype(c.dtype)

    def head_model(outer: Any) -> Any:
        state = jax.tree.map(lambda a: a, rest)
        nnx.replace_by_pure_dict(state, outer)
        return nnx.merge(graphdef, shapes, state)

    def layer(lp: Any, h: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """One layer (or MoE group): output, its share of the aux objective, its MoE metrics."""
        y, aux = nnx.merge(block_graph, lp)(h, pos)
        metrics = {k: a.astype(jnp.float32) for k, a in aux.items() if k in moe.METRICS}  # no per-layer loads here
        return vary((y, jnp.asarray(model.aux_loss(metrics) / (steps * m), jnp.float32), metrics), manual)

    def slot(lp: Any, h: jax.Array, pos: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        """A layer slot of a chunk: the layer where ``real``, else the identity (uneven stages' unused slots:
        skipped by a conditional where idle slots are, else computed and masked; zero gradient either way)."""
        if not uneven:
            return layer(lp, h, pos)
        met = {k: jnp.zeros((), jnp.float32) for k in (moe.METRICS if c.moe else ())}
        passed = vary((h, jnp.zeros((), jnp.float32), met), manual)
        if skip:
            return lax.cond(real, lambda: layer(lp, h, pos), lambda: passed)
        return jax.tree.map(lambda o, z: jnp.where(real, o, z), layer(lp, h, pos), passed)

    def chunk_forward(
        pc: Any, h: jax.Array, pos: jax.Array, n: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
        """A chunk of n layers in its slots: output, the input of every slot, the aux objective's share, the
        summed metrics."""

        def step_(h: jax.Array, lk: tuple) -> tuple[jax.Array, tuple]:
            y, obj, met = slot(lk[0], h, pos, lk[1] < n)
            return y, (h, obj, met)

        y, (inputs, obj, met) = lax.scan(step_, h, (pc, jnp.arange(layers // (p * v))))
        return y, inputs, jnp.sum(obj), jax.tree.map(jnp.sum, met)

    def loss_of(outer: Any, y: jax.Array, targets: jax.Array, total: jax.Array) -> jax.Array:
        """A microbatch's mean loss weighed by its trained targets over the batch's ``total`` (jaxscale/loss.py)."""
        return head_loss(head_model(outer), y, targets) * (jnp.sum(targets >= 0, dtype=jnp.float32) / total)

    def body(outer: Any, params: Any, xs: dict[str, jax.Array], step: Table) -> tuple[Any, ...]:
        with (
            use_rules(jax.sharding.get_abstract_mesh(), inner),
            recomputed(),
            ring_attention.manual_ring(context),
            sequence.by_partitioner(),
        ):
            # Embedding and head gathered over the stage's FSDP axes once, before the loop: XLA cannot
            # partition their lookup or scatter against FSDP shards inside the partly manual region.
            outer = jax.tree.map(
                lambda w, a: constrain(w[0], tuple(None if n == "embed" else n for n in a)), outer, outer_axes,
                is_leaf=lambda x: isinstance(x, jax.Array),
            )
            return _loop(*vary((outer, params, xs, lookup_table(outer["embedding"])), manual), step)

    def lookup_table(table: jax.Array) -> jax.Array:
        """The embedding table as the lookup reads it: split over the vocabulary's mesh axes on its width.

        Split on the vocabulary by a partitioner axis inside the partly manual ``shard_map``, the lookup
        makes XLA's partitioner (jax 0.12) abort while it costs its ways of splitting the gather (a failed
        check on the device groups of the masked lookup's all-reduce, ``spmd_partitioner_util``). Split on
        the width, each device looks up its slice of every row and the rows are gathered."""
        stage_mesh, stage_place = active()
        vocab = stage_place.mesh_axes(("vocab",))
        width = vocab if vocab and table.shape[1] % stage_place.size(vocab) == 0 else None
        return lax.with_sharding_constraint(table, NamedSharding(stage_mesh, PartitionSpec(None, width)))

    def _loop(
        outer: Any, params: Any, xs: dict[str, jax.Array], lookup: jax.Array, step: Table
    ) -> tuple[Any, ...]:
        stage = lax.axis_index(AXIS)
        rows, length = xs["inputs"].shape[1:]
        trained = jnp.sum(xs["targets"] >= 0, dtype=jnp.float32)  # this device's, over its microbatches
        total = jnp.maximum(lax.psum(trained, summed) if summed else trained, 1.0)
        h0 = vary(jnp.zeros((rows, length, c.embed), dtype), manual)
        zero_metrics = vary({k: jnp.zeros((), jnp.float32) for k in (moe.METRICS if c.moe else ())}, manual)

        def take(pc_all: Any, chunk_: jax.Array) -> Any:
            return jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, chunk_, keepdims=False), pc_all)

        def count(chunk_: jax.Array) -> jax.Array:
            """The layers (stacked units) of this stage's chunk ``chunk_``: of virtual stage chunk_·p + stage."""
            return jnp.asarray(counts)[jnp.clip(chunk_ * p + stage, 0, p * v - 1)]

        def when(pred: jax.Array, f: Callable[[], Any], zeros: Any) -> Any:
            """``f()`` where ``pred``, else ``zeros``: skipped by a conditional, or computed and masked."""
            if skip:
                return lax.cond(pred, lambda: vary(f(), manual), lambda: vary(zeros, manual))
            return jax.tree.map(lambda o, z: jnp.where(pred, o, z), f(), zeros)

        def stage_input(first: jax.Array, i: jax.Array, src: jax.Array, acts: jax.Array) -> jax.Array:
            """The tokens' embedding on the first virtual stage, else the activation that arrived."""
            def embedded() -> jax.Array:
                return head_model({**outer, "embedding": lookup}).embed(xs["inputs"][i])

            return when(first, embedded, acts[src, 0])

        def head(last: jax.Array, anywhere: jax.Array, f: Callable[[], Any], zeros: Any) -> Any:
            """``f()`` on the stage where ``last`` holds (the head on the last virtual stage, the embedding's
            gradient on the first). With partitioner axes inside a stage the conditional must be the same on
            every stage: ``f`` then runs on every stage in the ticks where one stage needs it (``anywhere``),
            masked elsewhere."""
            if skip:
                return lax.cond(last, lambda: vary(f(), manual), lambda: vary(zeros, manual))
            return lax.cond(
                anywhere, lambda: vary(when(last, f, zeros), manual), lambda: vary(zeros, manual)
            )

        def head_grad(
            last: jax.Array, anywhere: jax.Array, y: jax.Array, targets: jax.Array, acc_outer: Any
        ) -> tuple[jax.Array, jax.Array, Any]:
            """Loss, its gradient in ``y``, and ``acc_outer`` plus the head parameters' gradient, on the last
            virtual stage (the sum inside the conditional: a cross-device sum of it runs in these ticks only)."""

            def run() -> tuple[jax.Array, jax.Array, Any]:
                loss, pull = jax.vjp(lambda o, y: loss_of(o, y, targets, total), outer, y)
                d_outer, dy = pull(jnp.ones_like(loss))
                return loss, dy, jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_outer, d_outer)

            return head(last, anywhere, run, (jnp.zeros((), jnp.float32), jnp.zeros_like(y), acc_outer))

        def embedding_grad(i: jax.Array, dh: jax.Array, table: jax.Array) -> jax.Array:
            """``table`` plus the table's gradient from the first virtual stage's input gradient, one-hot(tokens)ᵀ · dh.

            A matmul, not the scatter-add that autodiff of the lookup gives: XLA's partitioner cannot
            split a scatter into a sharded operand inside a partly manual ``shard_map``."""
            hot = jax.nn.one_hot(xs["inputs"][i], c.vocab_size, dtype=dh.dtype)
            return table + jnp.einsum("bsv,bse->ve", hot, dh, preferred_element_type=jnp.float32)

        def forward_slot(
            kind: jax.Array, anywhere: jax.Array, i: jax.Array, ch: jax.Array, src: jax.Array, acts: jax.Array
        ) -> tuple:
            """The chunk's output (sent on), its layers' inputs (kept), loss share and metrics."""
            pc, pos = take(params, ch), xs["positions"][i]

            def run() -> tuple:
                y, inputs, obj, met = chunk_forward(pc, stage_input(kind == FIRST, i, src, acts), pos, count(ch))
                if not step.train:  # evaluation: the loss on the last virtual stage
                    loss = head(
                        kind == LAST, anywhere, lambda: loss_of(outer, y, xs["targets"][i], total),
                        jnp.zeros((), jnp.float32),
                    )
                    obj = obj + loss
                return y, inputs, obj, met

            return when(kind > IDLE, run, (h0, acts[0], jnp.zeros((), jnp.float32), zero_metrics))

        def backward_slot(
            kind: jax.Array, anywhere: jax.Array, i: jax.Array, ch: jax.Array, src: jax.Array, grad: jax.Array,
            acts: jax.Array, grads: jax.Array, acc: Any, acc_outer: Any,
        ) -> tuple:
            """Each layer of the chunk recomputed from its kept input and differentiated, last layer first
            (on the last virtual stage its output's gradient comes from the head and loss); each layer's
            gradient is added to ``acc`` as it comes (an idle slot's cotangents are zero: it adds zeros)."""
            pc, pos, on, n = take(params, ch), xs["positions"][i], kind > IDLE, count(ch)
            cot = on.astype(jnp.float32)  # the aux objective's cotangent: 0 in a masked slot

            def add(acc: Any, k: jax.Array, d_lp: Any) -> Any:
                """``acc`` plus layer ``k``'s gradient, at this chunk's layer k."""

                def one(a: jax.Array, g: jax.Array) -> jax.Array:
                    start = (ch, k, *([0] * g.ndim))
                    old = lax.dynamic_slice(a, start, (1, 1, *g.shape))
                    return lax.dynamic_update_slice(a, old + g.astype(a.dtype)[None, None], start)

                return jax.tree.map(one, acc, d_lp)

            def run() -> tuple:
                inputs, top = acts[src], acts.shape[1] - 1

                def down(carry: tuple, k: jax.Array) -> tuple[tuple, dict]:
                    dx, acc, acc_outer, loss = carry
                    (y, obj, met), pull = jax.vjp(lambda lp, x: slot(lp, x, pos, k < n), take(pc, k), inputs[k])
                    # The top layer's output gradient: the head's on the last virtual stage, else the next's.
                    head_loss, dy_head, acc_outer = head_grad(
                        (kind == LAST) & (k == top), anywhere & (k == top), y, xs["targets"][i], acc_outer
                    )
                    dy = jnp.where(k == top, jnp.where(on, jnp.where(kind == LAST, dy_head, grads[grad]), 0), dx)
                    d_lp, dx = pull(vary((dy, cot, jax.tree.map(jnp.zeros_like, met)), manual))
                    return (dx, add(acc, k, d_lp), acc_outer, loss + head_loss + obj), met

                init = vary((h0, acc, acc_outer, jnp.zeros((), jnp.float32)), manual)
                (dx, acc_new, new_outer, loss), mets = lax.scan(down, init, jnp.arange(top + 1), reverse=True)
                return acc_new, new_outer, dx, loss, jax.tree.map(jnp.sum, mets)

            zeros = (acc, acc_outer, h0, jnp.zeros((), jnp.float32), zero_metrics)
            if skip:
                return when(on, run, zeros)
            new_acc, *rest = run()  # masked: the accumulator adds exact zeros, no select needed
            return new_acc, *jax.tree.map(lambda o, z: jnp.where(on, o, z), tuple(rest), zeros[1:])

        fwd_perm = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
        bwd_perm = [(b, a) for a, b in fwd_perm]

        def tick(carry: tuple, col: dict[str, jax.Array]) -> tuple[tuple, None]:
            acts, grads, acc, acc_outer, loss, metrics = carry
            mine = {k: col[k][stage] for k in col}
            y, inputs, f_loss, f_met = forward_slot(
                mine["f_kind"], jnp.any(col["f_kind"] == LAST), mine["f_micro"], mine["f_chunk"], mine["f_src"], acts
            )
            if step.train:
                # The layers' inputs kept for the backward, in the slot where the chunk's input arrived.
                acts = _put(acts, jnp.where(mine["f_kind"] > IDLE, mine["f_src"], -1), inputs)
                kind, i, ch = mine["b_kind"], mine["b_micro"], mine["b_chunk"]
                acc, acc_outer, dh, b_loss, b_met = backward_slot(
                    kind, jnp.any(col["b_kind"] == LAST), i, ch, mine["b_src"], mine["b_grad"], acts, grads, acc,
                    acc_outer,
                )
                table_ = acc_outer["embedding"]
                acc_outer["embedding"] = head(
                    kind == FIRST, jnp.any(col["b_kind"] == FIRST), lambda: embedding_grad(i, dh, table_), table_
                )
                grads = _put(grads, mine["recv_b"], lax.ppermute(dh, AXIS, bwd_perm))
                loss, metrics = loss + b_loss, jax.tree.map(jnp.add, metrics, b_met)
            else:
                loss, metrics = loss + f_loss, jax.tree.map(jnp.add, metrics, f_met)
            acts = _put(acts, mine["recv_f"], lax.ppermute(y, AXIS, fwd_perm)[None], whole=False)
            return (acts, grads, acc, acc_outer, loss, metrics), None

        f32 = jnp.float32
        acc = jax.tree.map(lambda w: jnp.zeros(w.shape, f32), params) if step.train else {}
        acc_outer = jax.tree.map(lambda w: jnp.zeros(w.shape, f32), outer) if step.train else {}
        acts = jnp.zeros((step.act_slots, layers // (p * v), *h0.shape), dtype)
        grads = jnp.zeros((step.grad_slots if step.train else 1, *h0.shape), dtype)
        init = vary((acts, grads, acc, acc_outer, jnp.zeros((), f32), zero_metrics), manual)
        cols = {k: jnp.asarray(a) for k, a in step.arrays().items()}
        (_, _, acc, acc_outer, loss, metrics), _ = lax.scan(tick, init, cols)
        metrics = jax.tree.map(lambda a: a / (steps * m), metrics)
        if summed:
            acc, acc_outer, loss = lax.psum((acc, acc_outer, loss), summed)
        if data:
            metrics = jax.tree.map(lambda a: lax.psum(a, data) / place.size(data), metrics)
        loss, metrics = lax.psum((loss, metrics), AXIS)
        return (loss, metrics, acc, jax.tree.map(lambda a: a[None], acc_outer)) if step.train else (loss, metrics)

    param_specs = jax.tree.map(lambda _: PartitionSpec(None, AXIS), params)
    batch_spec = PartitionSpec(None, data or None, context or None)
    xs_specs = dict.fromkeys(micro, batch_spec)

    def run(step: Table, outer: Any, params: Any, xs: dict[str, jax.Array]) -> tuple[Any, ...]:
        # The embedding and head enter every stage as its own copy (a leading ``stage`` dimension):
        # their gradients come out per stage and are summed over ``stage`` outside, once per step.
        per_stage = jax.tree.map(lambda w: jnp.broadcast_to(w[None], (p, *w.shape)), outer)
        stacked = PartitionSpec(AXIS)
        out = jax.shard_map(
            lambda o, w, x: body(o, w, x, step), mesh=mesh,
            in_specs=(stacked, param_specs, xs_specs),
            out_specs=(PartitionSpec(), PartitionSpec(), param_specs, stacked)[: 4 if step.train else 2],
            axis_names=set(manual),
        )(per_stage, params, xs)
        return (*out[:3], jax.tree.map(lambda d: jnp.sum(d, axis=0), out[3])) if step.train else out

    @jax.custom_vjp
    def pipelined(outer: Any, params: Any, xs: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return run(evaluate, outer, params, xs)

    def pipelined_fwd(outer: Any, params: Any, xs: dict[str, jax.Array]) -> tuple[tuple, tuple]:
        loss, metrics, d_params, d_outer = run(train, outer, params, xs)
        return (loss, metrics), (d_outer, d_params)

    dtypes = jax.tree.map(lambda w: w.dtype, (outer, params))

    def pipelined_bwd(res: tuple, cotangents: tuple) -> tuple:
        g = cotangents[0]
        return (*jax.tree.map(lambda d, dt: (d * g).astype(dt), res, dtypes), None)

    pipelined.defvjp(pipelined_fwd, pipelined_bwd)
    loss, metrics = pipelined(outer, params, micro)
    return loss, jax.tree.map(lax.stop_gradient, metrics)

