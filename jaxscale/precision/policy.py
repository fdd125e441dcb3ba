"""Mixed precision as the playbook keeps it: a compute copy, a master copy, and the optimizer's moments.

The policy (config ``precision``) names three dtypes:

- ``params``: the **compute copy** the model runs with (auto: ``model.dtype``), laid out by
  the rules table's parameter rules: whole under DP and ZeRO-1/2, sharded under ZeRO-3.
- ``master``: the weights the optimizer updates (auto: ``model.param_dtype``), laid out
  with Adam's moments by the table's ``optimizer`` rules: a shard per device from ZeRO-1 on.
- ``grads_reduce``: the dtype in which gradients are summed across devices and over
  microbatches. XLA's partitioner places each cross-device sum of a weight gradient right
  after the matmul that produces it, in that matmul's output dtype. With ``float32`` and
  bf16 compute, the weight-gradient matmuls produce fp32 (:func:`einsum`: bf16 inputs,
  ``preferred_element_type=float32``; the embedding's scatter-add likewise, :func:`take`),
  so each microbatch's reduce-scatter (all-reduce under DP, ZeRO-1) is fp32, 4Ψ bytes
  where bf16 moves 2Ψ, and the sum is rounded to the compute copy's dtype once, after it;
  the microbatch accumulator is fp32. Inside ``shard_map`` (sequence parallelism, expert
  parallelism) the explicit sums are fp32 too (:func:`all_gather`, :func:`vary`), of
  partial gradients already rounded to bf16. ``bfloat16`` leaves the matmuls to autodiff:
  bf16 sums, a bf16 accumulator. (The grouped matmuls of dropless experts keep autodiff's.)

When the compute copy and the master have one dtype (fp32 training, or pure bf16) there
is one copy, the parameters, and ``TrainState.master`` is empty: the step is the plain
optimizer step. Otherwise a step (:func:`update`) is, per device:

1. forward and backward with the compute copy (ZeRO-3 all-gathers it layer by layer, in
   its own dtype);
2. the gradients, cast to the master's dtype, constrained to the optimizer's layout
   (ZeRO-1/2/3: a shard per device);
3. Adam on the shard: master and moments updated where they live;
4. the new compute copy cast from the master shard, then laid out by the parameter
   rules: ZeRO-1/2 all-gather it in the compute dtype (2Ψ·(N−1)/N bytes, not 4Ψ·(N−1)/N),
   ZeRO-3 keep the cast shard.

State per device, Ψ parameters over N data-parallel devices, bf16 compute and fp32 master:
ZeRO-1/2 2Ψ (compute copy) + 4Ψ/N (master) + 8Ψ/N (moments); ZeRO-3 (2Ψ + 4Ψ + 8Ψ)/N;
gradients come and go within the step (2Ψ in bf16, or 2Ψ/N reduce-scattered; an fp32
accumulator of 4Ψ, or 4Ψ/N under ZeRO-2/3, with ``train.microbatches`` > 1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxscale.config import dtypes, selections
from jaxscale.config.read import Config, ConfigError
from jaxscale.layout import rules as layout
from jaxscale.layout import sharding
from jaxscale.layout.collectives import lay_out
from jaxscale.precision import fp8
from jaxscale.precision.letters import letters


@dataclasses.dataclass(frozen=True)
class Policy:
    """The resolved dtypes: compute copy, master, gradient reduction."""

    compute: jnp.dtype
    master: jnp.dtype
    reduce: jnp.dtype

    @property
    def two_copies(self) -> bool:
        """Whether the state holds a master apart from the compute copy."""
        return self.compute != self.master


def resolve(model: Mapping[str, Any], precision: Mapping[str, Any]) -> Policy:
    """The policy of a config's ``model`` and ``precision`` sections (as mappings: a saved config too)."""
    names = dtypes.resolve(model, precision)
    return Policy(jnp.dtype(names.compute), jnp.dtype(names.master), jnp.dtype(names.reduce))


def policy(config: Config) -> Policy:
    """The policy of ``config``."""
    return resolve(dataclasses.asdict(config.model), dataclasses.asdict(config.precision))


def weight_grads(config: Config) -> jnp.dtype | None:
    """The dtype the weight-gradient matmuls produce and reduce in (:attr:`jaxscale.config.dtypes.Dtypes.weight_grads`):
    ``precision.grads_reduce`` where it is wider than ``model.dtype``, else None (autodiff's)."""
    grads = dtypes.of(config).weight_grads
    return None if grads is None else jnp.dtype(grads)


def takes_wide(config: Config) -> bool:
    """Whether the projections hand :func:`einsum` their weights as held, for it to cast to the compute dtype
    (a gradient in :func:`weight_grads`, wider than the compute dtype, and the compute copy in the compute
    dtype: a wider weight can then only be the fp32 master the trainer differentiates,
    :attr:`jaxscale.training.trainer.Trainer.wide_grads`; a compute copy kept wider is cast before, as ever)."""
    return selections.takes_wide(config)


WEIGHT_DOT = "weight_dot"  # the name of an :func:`einsum` output that jax's dots_with_no_batch_dims policy saves


def einsum(
    equation: str, x: jax.Array | fp8.Operand, w: jax.Array | fp8.Operand, grads: jnp.dtype | None = None
) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` of activations ``x`` and a weight ``w``, the weight's gradient matmul
    producing ``grads`` (:func:`weight_grads`; None: autodiff's einsum).

    Inside a split schedule's B or W slot (the active stage's ``weights``, :mod:`jaxscale.parallel.weight_split`)
    that runs it, deferring the weight's gradient to the W slot, where the matmul is its weight gradient alone.

    With fp8 operands (:class:`jaxscale.precision.fp8.Operand`, ``precision.fp8`` on) the projection runs in fp8:
    the einsum of its recipe's kernels (:func:`jaxscale.precision.fp8.kernels`); its weight gradient leaves the
    matmul in fp32. Its output is named :data:`WEIGHT_DOT` as below.

    With ``grads``, a ``custom_vjp``: the input gradient as autodiff computes it, the weight gradient
    ``einsum(x, g, preferred_element_type=grads)``, summed over the mesh axes ``x`` varies over and
    ``w`` does not (inside a ``shard_map``: data parallelism's ``psum``), then cast to ``w``'s dtype.
    Under the partitioner, the cross-device sum XLA puts right after that matmul is in ``grads``.
    A ``w`` wider than ``x`` (the trainer's :attr:`~jaxscale.training.trainer.Trainer.wide_grads`: the parameters
    in ``grads``) is cast to ``x``'s dtype inside: the product is the same, and its gradient leaves in
    ``grads`` with no rounding to the compute dtype on the way to the optimizer.
    A ``custom_vjp`` is one primitive to ``jax.checkpoint``'s policies: the output of an equation
    without batch letters is named :data:`WEIGHT_DOT`, which ``model.remat: save_dots`` saves.
    """
    inside = sharding.stage()
    split = inside.weights if inside is not None else None
    if split is not None:
        return split.einsum(equation, x, w, functools.partial(_projection, grads=grads))
    return _projection(equation, x, w, grads)


def _projection(
    equation: str, x: jax.Array | fp8.Operand, w: jax.Array | fp8.Operand, grads: jnp.dtype | None
) -> jax.Array:
    """:func:`einsum` as it runs outside a split slot."""
    lhs, rhs, out = letters(equation)
    if isinstance(w, fp8.Operand):
        y = fp8.kernels(w.recipe).einsum(equation, x, w)
    elif grads is None:
        return jnp.einsum(equation, x, w, out_sharding=out_sharding(equation, x, w))
    else:
        y = _weight_einsum(equation, jnp.dtype(grads), out_sharding(equation, x, w), x, w)
    return y if set(lhs) & set(rhs) & set(out) - {"."} else checkpoint_name(y, WEIGHT_DOT)


def out_sharding(equation: str, x: jax.Array, w: jax.Array) -> PartitionSpec | None:
    """On explicit mesh axes (``mesh.axis_types: explicit``), the layout of ``einsum(equation, x, w)`` that jax's
    sharding rules leave to the caller when both operands are split: the output keeps the activation ``x``'s
    mesh axes on its dimensions and takes the weight's (its rules table layout) on those only ``w`` has, less
    the axes ``x`` already uses (ZeRO-3's ``embed`` shards of a weight are gathered, not kept). None on auto
    axes, or for an equation with an ellipsis: jax's own rules."""
    if "." in equation or not jax.sharding.get_abstract_mesh().are_all_axes_explicit:
        return None
    lhs, rhs, out = letters(equation)

    def axes(names: str, a: jax.Array) -> dict[str, tuple[str, ...]]:
        spec = tuple(jax.typeof(a).sharding.spec)
        spec += (None,) * (len(names) - len(spec))  # a spec may leave its last dimensions out
        return {c: layout.part_axes(p) for c, p in zip(names, spec, strict=True)}

    mine = axes(lhs, x)
    used = {a for parts in mine.values() for a in parts}
    theirs = {c: tuple(a for a in parts if a not in used) for c, parts in axes(rhs, w).items()}
    return PartitionSpec(*(mine.get(c, theirs.get(c)) or None for c in out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _weight_einsum(
    equation: str, grads: jnp.dtype, spec: PartitionSpec | None, x: jax.Array, w: jax.Array
) -> jax.Array:
    return jnp.einsum(equation, x, w.astype(x.dtype), out_sharding=spec)


def _weight_einsum_forward(
    equation: str, grads: jnp.dtype, spec: PartitionSpec | None, x: jax.Array, w: jax.Array
) -> tuple[jax.Array, tuple]:
    return jnp.einsum(equation, x, w.astype(x.dtype), out_sharding=spec), (x, w)


def _weight_einsum_backward(
    equation: str, grads: jnp.dtype, spec: PartitionSpec | None, saved: tuple, g: jax.Array
) -> tuple[jax.Array, ...]:
    x, w = saved
    lhs, rhs, out = letters(equation)
    _, x_vjp = jax.vjp(lambda x: jnp.einsum(equation, x, w.astype(x.dtype), out_sharding=spec), x)
    # On explicit axes the weight's gradient is stated in the weight's layout (its contraction splits both sides).
    w_layout = None if spec is None else jax.typeof(w).sharding.spec
    dw = jnp.einsum(f"{lhs},{out}->{rhs}", x, g, preferred_element_type=grads, out_sharding=w_layout)
    summed = tuple(sorted(jax.typeof(dw).mat.varying - jax.typeof(w).mat.varying))
    if summed:
        dw = jax.lax.psum(dw, summed)
    return x_vjp(g)[0], dw.astype(w.dtype)


_weight_einsum.defvjp(_weight_einsum_forward, _weight_einsum_backward)


def cast(tree: Any, dtype: jnp.dtype) -> Any:
    """Every floating-point leaf of ``tree`` in ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def split(p: Policy, weights: Any) -> tuple[Any, Any]:
    """The compute copy and the master (empty with one copy) of freshly made or loaded ``weights``."""
    if not p.two_copies:
        return cast(weights, p.master), {}
    return cast(weights, p.compute), cast(weights, p.master)


def updated(params: Any, master: Any) -> Any:
    """The weights the optimizer updates: the master, or the parameters when they are the only copy."""
    return master if master else params


def update(
    p: Policy,
    optimizer: optax.GradientTransformation,
    grads: Any,
    params: Any,
    master: Any,
    opt_state: Any,
    opt_layout: Any,
    after: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """One optimizer step on the optimizer's layout; the new (compute copy, master, optimizer state) and the
    gradients as the optimizer saw them (master dtype, optimizer layout). ``after``: applied to the updated
    weights (the master, or the parameters when they are the only copy) before the compute copy is cast.

    The new compute copy is returned cast on the master's shard and is laid out by the caller's
    output shardings (the parameter rules): the all-gather, where there is one, moves the compute dtype.
    """
    grads = lay_out(cast(grads, p.master), opt_layout)
    weights = lay_out(updated(params, master), opt_layout)
    updates, opt_state = optimizer.update(grads, opt_state, weights)
    weights = optax.apply_updates(weights, updates)
    if after is not None:
        weights = after(weights)
    if not p.two_copies:
        return weights, {}, opt_state, grads
    return cast(weights, p.compute), weights, opt_state, grads


def check_resume(saved: Mapping[str, Any], config: Config, step: int) -> None:
    """Raise if the checkpoint's copies (compute copy, master) would not restore into ``config``'s."""
    saved_precision = saved.get("precision", {})
    if "params" not in saved_precision:  # written before this policy: one copy, in model.param_dtype
        was = Policy(*(jnp.dtype(saved["model"]["param_dtype"]),) * 2, jnp.dtype("float32"))
    else:
        was = resolve(saved["model"], saved_precision)
    now = policy(config)
    if (was.compute, was.master if was.two_copies else None) != (now.compute, now.master if now.two_copies else None):
        def describe(q: Policy) -> str:
            return f"compute copy {q.compute.name}" + (f" + master {q.master.name}" if q.two_copies else " (one copy)")

        raise ConfigError(
            f"resume: checkpoint step {step} keeps {describe(was)}, the config {describe(now)} "
            f"(set precision.params and precision.master to match)"
        )
