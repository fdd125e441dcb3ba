"""The layer stack's last units in the compute dtype (``precision.nvfp4.bf16_last``): NVIDIA's NVFP4 recipe
keeps about 15% of the linear layers, mostly the last ones, in higher precision (their weight gradients carry the
largest quantization error; training diverges with every layer in FP4).

The stack is scanned twice: its first units with their recipe (the fp8 weights made once, ahead,
:func:`jaxscale.precision.fp8.prepare`), then the last ones (:func:`jaxscale.config.stage_layers.plain_units`)
in a plain :func:`jaxscale.precision.fp8.using` block, where no fp8 module takes part
(:func:`jaxscale.precision.fp8.live` is None), so each projection of those layers is the compute-dtype einsum its model
runs with ``precision.fp8: off``: on a GPU a bf16 GEMM, not a block-scaled one.
Two scans of static bodies, not a ``lax.cond`` per layer: the GEMM kind of a program is static, and a scan body
without a conditional keeps the scheduler's overlap of one layer's collectives with the next one's compute.
The two slices of the stack are read by their own scans; their gradients come back as one stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.precision.fp8.state import prepare, using


def _sliced(tree: Any, part: slice) -> Any:
    return jax.tree.map(lambda a: a[part], tree)


def _split(blocks: nnx.Module, n: int) -> tuple[nnx.Module, nnx.Module]:
    """A stacked module (leading axis: its units) as its first ``n`` units and the rest."""
    graph, state = nnx.split(blocks)
    return nnx.merge(graph, _sliced(state, slice(None, n))), nnx.merge(graph, _sliced(state, slice(n, None)))


def scan_stack(
    scan: Callable[..., tuple[jax.Array, Any]], x: jax.Array, blocks: nnx.Module, plain_count: int | None, *xs: Any
) -> tuple[jax.Array, Any]:
    """``scan(x, blocks, copies, *xs)`` over a stack: ``plain_count`` None (fp8 off): no copies; else the fp8
    weights made once ahead and the last ``plain_count`` units as a second scan in a plain ``using`` block, their
    outputs (stacked over the units) joined."""
    if plain_count is None:
        return scan(x, blocks, {}, *xs)
    if plain_count == 0:
        return scan(x, blocks, prepare(blocks), *xs)
    n = jax.tree.leaves(nnx.state(blocks))[0].shape[0] - plain_count
    if n == 0:
        with using(blocks, {}, plain=True):
            return scan(x, blocks, {}, *xs)
    low, high = _split(blocks, n)
    x, out_low = scan(x, low, prepare(low), *_sliced(xs, slice(None, n)))
    with using(high, {}, plain=True):
        x, out_high = scan(x, high, {}, *_sliced(xs, slice(n, None)))
    return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out_low, out_high)
