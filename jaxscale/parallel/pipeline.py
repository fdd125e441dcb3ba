"""Pipeline parallelism (PP): the layer stack split over the ``stage`` mesh axis, microbatches passed on.

When the rules put ``layers`` on ``stage`` (size p > 1), :class:`~jaxscale.models.llama.Llama` runs its
stacked blocks through :func:`apply` instead of one scan; the embedding before it and the final norm,
output head and loss after it stay outside, laid out by the rules like any other activation (they are
replicated over ``stage``, so every stage computes them). Stage s stores layers ``[s·L/p, (s+1)·L/p)``.

The ``jax.shard_map`` is manual over ``stage`` and over the data-parallel axes that shard no block
parameter (``data`` and ``fsdp`` under ``pp``, ``data`` under ``pp_fsdp``): there each device adds up its
parameter gradients over the ticks and they are summed over those axes once, after the loop (left to
the partitioner, that all-reduce ran at every tick). The other axes (fsdp sharding parameters, tensor)
stay with the partitioner, which shards each stage's blocks as the rules say: FSDP gathers weights
and reduces their gradients at every tick, TP all-reduces activations inside the stage. The compiled
step shows no gather of activations over the data axes: each device sends its own rows.

Schedule: the batch is cut into m microbatches (``pipeline.microbatches``; row r of microbatch i is
row r·m + i, so no device changes rows) and one loop runs ``v·m + p − 1`` ticks. At tick t stage s
works on item k = t − s (microbatch k mod m, repeat k div m) when 0 ≤ k < v·m and idles otherwise;
then each stage hands its output to the next with ``lax.ppermute``. Stage 0 reads its microbatch
from the input; the last stage keeps the outputs of the last repeat. :func:`schedule` is that table.

* GPipe (``schedule: gpipe``, v = 1): all forward, then all backward, by autodiff of the loop (the
  transposed loop runs the ticks backwards with the ppermute reversed). Each tick's stage body is
  rematerialised (``pipeline.remat``): the loop keeps one stage input of b·s·h per tick, (m + p − 1)
  in all, and recomputes the stage forward in the backward: one more forward per step instead of
  the activations of all m microbatches.
* Circular / interleaved (``schedule: circular``, v = ``pipeline.repeats`` > 1): stage s runs v
  groups of L/(p·v) layers, groups r·p + s for r < v; a microbatch goes round the ring v times and
  what the last stage sends back to stage 0 waits in the input buffer until its next repeat starts
  (m ≥ p makes that wait non-negative). The parameters are stored in layer order, contiguous per
  stage, so checkpoints do not depend on v; each step therefore moves the layers to the stages that
  run them and their gradients back (all-to-all or collective-permutes over ``stage``, up to the
  stage's block parameters each way; ``benchmarks/pp_bubble.py`` reports the bytes).

Bubble (FORMULAS.md): each stage works v·m of the v·m + p − 1 ticks, a tick being 1/v of its
layers, so the idle fraction is (p − 1)/(v·m + p − 1); v = 1 is GPipe's (p − 1)/(m + p − 1).

Bytes per device per step, b·s·h·bytes being one microbatch's activations on a device:

* collective-permute, one message per tick forward and one backward: 2·(v·m + p − 1)·b·s·h·bytes.
  FORMULAS.md counts 2·v·m·b·s·h·bytes (2·m per boundary, v times for interleaving); the 2·(p − 1)
  more are the bubble ticks' messages, which an SPMD loop sends anyway;
* all-reduce over ``stage`` of the m microbatches (2·(p − 1)/p·m·b·s·h·bytes) twice: the input
  enters every stage (the embedding is replicated over ``stage``), so its gradient is summed over
  stages once after the loop; and the last stage's outputs reach every stage in the forward.

Not 1F1B: 1F1B starts each microbatch's backward as soon as its forward leaves the last stage, so at
most p microbatches of activations are alive on a stage. Here the loss is taken after the loop and
autodiff transposes the whole loop, so every backward follows every forward. A 1F1B loop must be
written by hand, with the head and the loss inside it (the last stage takes each microbatch's loss
gradient as its forward ends; a custom VJP hands back the gradients computed in the forward), and it
beats GPipe + remat only if it keeps each in-flight microbatch's residuals in the loop's carry
instead of recomputing them; the residuals of jax's ``vjp`` include the parameters it closes over,
which would be copied into every slot. Keeping only stage inputs (1F1B + remat), it would hold p
of them instead of v·m + p − 1, while the recompute transient of one stage, which both have, is
the larger part (``benchmarks/pp_bubble.py``). GPipe + remat costs one more forward of the stack per
step (about a third more stage compute) for that memory; ``pipeline.remat=false`` keeps every
tick's activations instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.config import ConfigError, PipelineConfig
from jaxscale.sharding import Axes, Rules, active, check_divisible, constrain, is_axes, spec, spec_axes, use_rules

AXIS = "stage"
LAYERS = "layers"

_CONFIG: contextvars.ContextVar[PipelineConfig | None] = contextvars.ContextVar("jaxscale_pipeline", default=None)


@contextlib.contextmanager
def use_pipeline(config: PipelineConfig) -> Iterator[None]:
    """Within this block, a pipelined layer stack runs with these microbatches, repeats and schedule."""
    token = _CONFIG.set(config)
    try:
        yield
    finally:
        _CONFIG.reset(token)


def stages() -> int:
    """Pipeline stages under the active rules: the size of ``stage`` if the rules put ``layers`` on it, else 1."""
    current = active()
    return current[1].stages if current is not None else 1


# -- the schedule ------------------------------------------------------------------


def ticks(p: int, m: int, v: int) -> int:
    """Iterations of the pipeline loop: every stage works ``v·m`` of them, the rest is the bubble."""
    return v * m + p - 1


def work(tick: Any, stage: Any, m: int, v: int) -> tuple[Any, Any, Any]:
    """What ``stage`` does at ``tick``: (busy, repeat, microbatch); for Python, NumPy and traced integers."""
    k = tick - stage
    return (k >= 0) & (k < v * m), k // m, k % m


def schedule(p: int, m: int, v: int) -> np.ndarray:
    """The loop's schedule, ``[ticks, stages, 2]``: (repeat, microbatch) of each stage at each tick; -1 when idle."""
    t, s = np.meshgrid(np.arange(ticks(p, m, v)), np.arange(p), indexing="ij")
    busy, repeat, micro = work(t, s, m, v)
    return np.where(busy[..., None], np.stack([repeat, micro], axis=-1), -1)


# -- the pipelined stack -----------------------------------------------------------


def _check(p: int, m: int, v: int, layers: int, x: jax.Array, x_axes: Axes) -> None:
    if layers % (p * v):
        raise ConfigError(f"model.layers ({layers}) is not divisible by mesh.stage ({p}) x pipeline.repeats ({v})")
    if m < p:
        raise ConfigError(f"pipeline.microbatches ({m}) is fewer than the {p} pipeline stages (mesh.stage)")
    rows = x.shape[0]
    if rows % m:
        raise ConfigError(
            f"the batch of {rows} sequences (train.global_batch / train.microbatches) is not divisible by "
            f"pipeline.microbatches ({m})"
        )
    mesh, place = active()
    shape = (rows // m, *x.shape[1:])
    check_divisible("pipeline microbatch", shape, x_axes, spec(place, x_axes), mesh)


def apply(
    blocks: nnx.Module, x: jax.Array, positions: jax.Array, x_axes: Axes, policy: Callable | None = None
) -> jax.Array:
    """Run the stacked ``blocks`` on ``x`` [batch, length, embed] as a pipeline over ``stage``.

    ``x_axes`` are the logical axes of ``x`` (and of each microbatch); ``policy`` is the
    per-layer remat policy inside a stage.
    """
    mesh, place = active()
    rules = place.rules
    config = _CONFIG.get() or PipelineConfig()
    p = mesh.shape[AXIS]
    m, v = config.microbatches or p, config.repeats
    graphdef, state = nnx.split(blocks)
    params = nnx.to_pure_dict(state)
    axes = nnx.to_pure_dict(
        jax.tree.map(lambda a: a.get_metadata()["out_sharding"], state, is_leaf=lambda a: isinstance(a, nnx.Variable))
    )
    layers = jax.tree.leaves(params)[0].shape[0]
    _check(p, m, v, layers, x, x_axes)

    def by_repeat(w: jax.Array, w_axes: Axes) -> jax.Array:
        # [layers, ...] -> [repeats, layers / repeats, ...]: stage s holds groups r*p + s of every repeat r.
        spec = PartitionSpec(None, *rules.spec(w_axes))
        return lax.with_sharding_constraint(w.reshape(v, layers // v, *w.shape[1:]), NamedSharding(mesh, spec))

    params = jax.tree.map(by_repeat, params, axes, is_leaf=lambda a: isinstance(a, jax.Array))
    # Data-parallel axes that shard no block parameter are manual too (a prefix of the batch's axes):
    # the loop then sums each parameter's gradient over ticks on every device and reduces it over
    # them once, after the loop, where the partitioner would all-reduce it at every tick.
    sharding_params = {a for w_axes in jax.tree.leaves(axes, is_leaf=is_axes) for a in spec_axes(rules.spec(w_axes))}
    data = tuple(itertools.takewhile(lambda a: a not in sharding_params, spec_axes(rules.spec(x_axes)[0])))
    manual = {AXIS, *data}
    inner = Rules(rules.name, {name: tuple(a for a in to if a not in manual) for name, to in rules.params.items()})
    rows = x.shape[0] // m
    # Row r of microbatch i is row r * m + i: each device keeps its own rows.
    micro_x = constrain(x.reshape(rows, m, *x.shape[1:]).swapaxes(0, 1), (None, *x_axes))
    micro_pos = positions.reshape(rows, m, *positions.shape[1:]).swapaxes(0, 1)
    perm = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]

    def group(params: Any, repeat: jax.Array, h: jax.Array, pos: jax.Array) -> jax.Array:
        """One stage's layer group of ``repeat``: a scan over its layers."""

        def layer(h: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, layer_params)(h, pos)[0], None  # dense blocks: no auxiliary metrics

        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        local = jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, repeat, keepdims=False), params)
        return lax.scan(layer, h, local)[0]

    if config.remat:
        group = jax.checkpoint(group, prevent_cse=False)

    def run(params: Any, xs: jax.Array, pos: jax.Array) -> jax.Array:
        # Inside, activations are constrained over the axes left to the partitioner only.
        with use_rules(jax.sharding.get_abstract_mesh(), inner):
            return _loop(lax.pcast(params, data, to="varying") if data else params, xs, pos)

    def _loop(params: Any, xs: jax.Array, pos: jax.Array) -> jax.Array:
        stage = lax.axis_index(AXIS)
        init = lax.pcast((jnp.zeros_like(xs[0]), xs, jnp.zeros_like(xs)), AXIS, to="varying")

        def tick(carry: tuple[jax.Array, jax.Array, jax.Array], t: jax.Array) -> tuple[tuple, None]:
            state, inputs, out = carry
            busy, repeat, micro = work(t, stage, m, v)
            repeat = jnp.clip(repeat, 0, v - 1)
            h = jnp.where(stage == 0, inputs[micro], state)
            y = group(params, repeat, h, pos[micro])
            last = busy & (stage == p - 1) & (repeat == v - 1)
            out = out.at[micro].set(jnp.where(last, y, out[micro]))
            received = lax.ppermute(y, AXIS, perm)
            if v > 1:
                # Stage 0 keeps what comes round the ring until the microbatch's next repeat starts.
                busy_last, repeat_last, micro_last = work(t, p - 1, m, v)
                keep = (stage == 0) & busy_last & (repeat_last < v - 1)
                inputs = inputs.at[micro_last].set(jnp.where(keep, received, inputs[micro_last]))
            return (received, inputs, out), None

        (_, _, out), _ = lax.scan(tick, init, jnp.arange(ticks(p, m, v)))
        return lax.psum(jnp.where(stage == p - 1, out, 0), AXIS)

    param_specs = jax.tree.map(lambda _: PartitionSpec(None, AXIS), params)
    batch = PartitionSpec(None, data or None)
    out = jax.shard_map(
        run, mesh=mesh, in_specs=(param_specs, batch, batch), out_specs=batch, axis_names=manual
    )(params, micro_x, micro_pos)
    out = out.swapaxes(0, 1).reshape(x.shape)
    return constrain(out, x_axes)
