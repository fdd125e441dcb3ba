"""Muon: momentum orthogonalised by the quintic Newton-Schulz iteration on each hidden matrix, AdamW on the rest.

For a hidden matrix (:mod:`jaxscale.training.muon_layout`: read from its logical axes) with gradient ``g``, momentum
``m``
(``momentum`` = beta), rate ``lr`` and weight decay ``wd``::

    m  = beta * m + (1 - beta) * g
    u  = beta * m + (1 - beta) * g            (Nesterov; without it, u = m)
    O  = NewtonSchulz(u)                      (quintic, ns_steps, in ns_dtype: about U V^T of u = U S V^T)
    w -= lr * (scale * O + wd * w)            (decoupled weight decay, times the rate as in AdamW)

``scale``: ``rms`` (Moonlight) is ``rms * sqrt(max(fan_in, fan_out))``, an update of AdamW's RMS (0.2) so that
AdamW's rate carries over; ``shape`` (Keller Jordan's Muon) is ``sqrt(max(1, fan_out / fan_in))``, which wants a
rate of about 0.02. Every other parameter (embedding, head, norms, biases, routers) takes AdamW.

**Where it runs.** Inside the trainer's step (a rules table in effect, :func:`jaxscale.layout.sharding.active`) each
hidden matrix's Nesterov momentum is cast to ``ns_dtype`` and moved from its optimizer layout to its owner layout
(:func:`jaxscale.training.muon_layout.owner_partition`), orthogonalised there on whole matrices, and moved back; the
momentum state itself stays in the optimizer layout (ZeRO's shards). What that communicates per step, per
hidden matrix: the mesh axes ``M`` that move from its matrix dimensions onto its stack dimensions cost one
all-to-all over ``M`` there and one back, each sending ``(|M| - 1) / |M|`` of the device's shard (in
``ns_dtype``); a mesh axis that splits a matrix dimension but divides no stack dimension pads the stack with zero
matrices until it does where that moves fewer bytes (the moves then carry the padded shard), else is gathered
there (an all-gather; each device keeps its own slice of the result: nothing moves back); see
:func:`jaxscale.training.muon_layout.owner_layout`. Under ``zero3`` with ``layers`` divisible by ``fsdp`` = n
that is two all-to-alls of every stacked hidden matrix, ``2 (n - 1) / n`` of the device's share of the hidden
matrices' bytes in ``ns_dtype`` (``zero1``'s state, split the same way, moves the same); under ``dp`` nothing
moves, nor do experts split over ``expert`` or the layers of a pipeline stage when no other axis splits them.
Outside a rules table (one device, a plain ``jax.jit``) it runs as written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.layout import sharding
from jaxscale.layout.rules import Axes, is_axes
from jaxscale.precision import policy as precision
from jaxscale.training import muon_layout

# Keller Jordan's quintic: the slope at zero maximised, singular values driven into about [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
Scale = Literal["rms", "shape"]


def newton_schulz(x: jax.Array, steps: int = 5, dtype: Any = jnp.bfloat16, eps: float = 1e-7) -> jax.Array:
    """The quintic Newton-Schulz iteration on each matrix of ``x [..., m, n]`` (in ``dtype``): about ``U V^T`` of
    its SVD ``U S V^T``. The matrix is divided by its Frobenius norm (computed in fp32) first, and iterated on
    the side whose Gram matrix is the smaller."""
    a, b, c = NS_COEFFS
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.linalg.norm(x.astype(jnp.float32), axis=(-2, -1), keepdims=True)
    x = (x.astype(jnp.float32) / (norm + eps)).astype(dtype)
    for _ in range(steps):
        gram = jnp.einsum("...ij,...kj->...ik", x, x)
        poly = b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram)
        x = a * x + jnp.einsum("...ij,...jk->...ik", poly, x)
    return jnp.swapaxes(x, -1, -2) if wide else x


def update_scale(shape: Sequence[int], axes: Axes, scale: Scale, rms: float) -> float:
    """The factor of a hidden matrix's orthogonalised update (module docstring)."""
    fan_in, fan_out = muon_layout.fans(shape, axes)
    if scale == "rms":
        return rms * max(fan_in, fan_out) ** 0.5
    return max(1.0, fan_out / fan_in) ** 0.5


def _on_owners(fn: Callable[[jax.Array], jax.Array], u: jax.Array, axes: Axes, dtype: Any) -> jax.Array:
    """``fn`` applied to ``u`` cast to ``dtype``, on its owner layout (padded with zero matrices where that
    layout pads the stack: the iteration keeps them zero); the result back on the optimizer layout (module
    docstring). As written outside a rules table."""
    current = sharding.active()
    if current is None:
        return fn(u.astype(dtype))
    mesh, place = current
    parts, padded = muon_layout.owner_layout(place, u.shape, axes)
    owner = NamedSharding(mesh, PartitionSpec(*parts))
    back = NamedSharding(mesh, PartitionSpec(*place.partition(axes, "optimizer")))
    # u and its cast pinned where the momentum is first: else the partitioner may move the gradient and the
    # momentum to the owners instead (the momentum computed there and moved back: four moves where two do), or
    # move u before its cast; the result pinned on the owners, else the iteration's last matmuls may run on the
    # optimizer layout (moving their operands).
    x = precision.lay_out(precision.lay_out(u, back).astype(dtype), back)
    if padded != u.shape:
        x = precision.lay_out(jnp.pad(x, [(0, padded[0] - u.shape[0])] + [(0, 0)] * (u.ndim - 1)), back)
    o = precision.lay_out(precision.lay_out(fn(precision.lay_out(x, owner)), owner), back)
    return precision.lay_out(o[: u.shape[0]], back) if padded != u.shape else o


def orthogonalised(
    u: jax.Array, axes: Axes, steps: int, dtype: Any, scale: Scale, rms: float, eps: float = 1e-7
) -> jax.Array:
    """A hidden matrix's scaled update from its (Nesterov) momentum ``u``, in ``u``'s dtype and layout."""
    first = muon_layout.stack_dims(axes)
    fan_in, fan_out = muon_layout.fans(u.shape, axes)

    def run(x: jax.Array) -> jax.Array:  # x: u, or u with its stack padded (owner_layout)
        o = newton_schulz(x.reshape(*x.shape[:first], fan_in, fan_out), steps, dtype, eps)
        return o.reshape(x.shape)

    o = _on_owners(run, u, axes, dtype)
    return (o.astype(jnp.float32) * update_scale(u.shape, axes, scale, rms)).astype(u.dtype)


class MuonState(NamedTuple):
    """Muon's momentum, shaped (and laid out) as the hidden matrices."""

    mu: optax.Updates


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def scale_by_muon(
    axes: Any, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_dtype: Any = jnp.bfloat16,
    scale: Scale = "rms", rms: float = 0.2, ns_eps: float = 1e-7,
) -> optax.GradientTransformation:
    """Muon's direction (no rate, no decay) for a tree of hidden matrices whose logical axes are ``axes`` (a tree
    shaped like the parameters, a tuple of names per leaf; leaves masked by ``optax.partition`` are skipped)."""

    def init(params: Any) -> MuonState:
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        mu = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g.astype(m.dtype), state.mu, updates)
        if nesterov:
            u = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g.astype(m.dtype), mu, updates)
        else:
            u = mu

        def each(x: Any, a: Axes) -> Any:
            return x if _masked(x) else orthogonalised(x, tuple(a), ns_steps, ns_dtype, scale, rms, ns_eps)

        return jax.tree.map(each, u, axes, is_leaf=_masked), MuonState(mu)

    return optax.GradientTransformation(init, update)


def labels(axes: Any, adamw_axes: Sequence[str] = muon_layout.ADAMW_AXES) -> Any:
    """``'muon'`` for each hidden matrix, ``'adamw'`` for the rest, from the parameters' logical axes."""
    return jax.tree.map(
        lambda a: "muon" if muon_layout.is_hidden_matrix(a, adamw_axes) else "adamw", axes, is_leaf=is_axes
    )


def _adamw_decay(axes: Any) -> Callable[[Any], Any]:
    """AdamW's weight-decay mask over its share of the parameters: matrices (two or more dimensions other than
    ``layers``), as :func:`jaxscale.training.optim.decay_mask`."""

    def mask(params: Any) -> Any:
        def each(p: Any, a: Axes) -> Any:
            return p if _masked(p) else sum(1 for n in a if n != "layers") >= 2

        return jax.tree.map(each, params, axes, is_leaf=_masked)

    return mask


def muon(
    learning_rate: optax.ScalarOrSchedule,
    axes: Any,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: Any = jnp.bfloat16,
    ns_eps: float = 1e-7,
    scale: Scale = "rms",
    rms: float = 0.2,
    weight_decay: float = 0.1,
    adamw_learning_rate: optax.ScalarOrSchedule | None = None,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    adamw_axes: Sequence[str] = muon_layout.ADAMW_AXES,
    param_labels: Any = None,
) -> optax.GradientTransformation:
    """Muon on the hidden matrices, AdamW (``b1``, ``b2``, ``eps``; rate ``adamw_learning_rate``, default
    ``learning_rate``; decay ``adamw_weight_decay``, default ``weight_decay``, on its matrices only) on the rest.
    ``ns_eps``: added to the Frobenius norm that divides the momentum before the iteration.

    ``axes``: the parameters' logical axes (``Trainer.axes``), which choose the hidden matrices (a matrix with a
    dimension in ``adamw_axes`` takes AdamW) and their owner layout; ``param_labels``: a tree of ``'muon'`` /
    ``'adamw'`` per parameter in place of that choice. Pass it to ``Trainer.build(..., optimizer=...)``.
    """
    tree = labels(axes, adamw_axes) if param_labels is None else param_labels
    decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    return optax.partition(
        {
            "muon": optax.chain(
                scale_by_muon(axes, momentum, nesterov, ns_steps, ns_dtype, scale, rms, ns_eps),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adamw": optax.adamw(
                learning_rate if adamw_learning_rate is None else adamw_learning_rate,
                b1=b1, b2=b2, eps=eps, weight_decay=decay, mask=_adamw_decay(axes),
            ),
        },
        tree,
    )
