"""Fused projections (``model.fused_projections``): the parameter layout and its conversion.

With the switch on, an attention block holds one ``w_qkv [embed, kv_heads, q_per_kv + 2, head_dim]``
in place of ``wq [embed, heads, head_dim]``, ``wk`` and ``wv [embed, kv_heads, head_dim]``, and a dense
MLP one ``w_gate_up [embed, 2, mlp]`` in place of ``w_gate`` and ``w_up [embed, mlp]``: one GEMM each
instead of three and two (the key and value GEMMs of grouped-query attention are narrow: N = kv_heads
x head_dim). The query heads sit under their key/value head (query head ``i`` uses key/value head
``i // q_per_kv``, as grouped-query attention groups them), so the fused weight splits on ``kv_heads``
as the separate ones do: every rules table that shards ``heads`` and ``kv_heads`` over the same axes
shards it. The fused dimensions are named ``qkv`` and ``gate_up`` (:mod:`jaxscale.config.axes`), which
no rules table maps: they stay whole on every device. The experts of an MoE block stay separate.

:func:`fuse` and :func:`unfuse` convert a parameter tree (nested dicts of numpy or jax arrays, layers
stacked on leading axes) between the layouts, exactly (a reshape and a concatenation): a checkpoint of
either layout restores into a model of the other (:func:`jaxscale.checkpoint.store.init_state_from`), and
the Hugging Face conversion reads and writes the separate weights whatever the run's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

QKV, GATE_UP = "w_qkv", "w_gate_up"
SEPARATE = {QKV: ("wq", "wk", "wv"), GATE_UP: ("w_gate", "w_up")}


def _xp(a: Any) -> Any:
    """numpy for numpy arrays, jax.numpy for the rest."""
    if isinstance(a, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def _fusable(node: Mapping[str, Any], fused: str) -> bool:
    """Whether ``node`` holds the separate weights of ``fused`` (an MoE block's experts, with a router: no)."""
    return all(k in node for k in SEPARATE[fused]) and "router" not in node


def fuse_qkv(wq: Any, wk: Any, wv: Any) -> Any:
    """[..., e, h, d], [..., e, k, d] x2 -> [..., e, k, h/k + 2, d]."""
    xp = _xp(wq)
    *lead, e, h, d = wq.shape
    k = wk.shape[-2]
    q = wq.reshape(*lead, e, k, h // k, d)
    return xp.concatenate([q, wk[..., None, :], wv[..., None, :]], axis=-2)


def unfuse_qkv(w: Any) -> tuple[Any, Any, Any]:
    """The inverse of :func:`fuse_qkv`."""
    *lead, e, k, g, d = w.shape
    return w[..., : g - 2, :].reshape(*lead, e, k * (g - 2), d), w[..., g - 2, :], w[..., g - 1, :]


def fuse(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter tree with every attention's and dense MLP's separate projections fused."""
    out = {k: fuse(v) if isinstance(v, Mapping) else v for k, v in tree.items()}
    if _fusable(out, QKV):
        out[QKV] = fuse_qkv(*(out.pop(k) for k in SEPARATE[QKV]))
    if _fusable(out, GATE_UP):
        gate, up = (out.pop(k) for k in SEPARATE[GATE_UP])
        out[GATE_UP] = _xp(gate).stack([gate, up], axis=-2)
    return out


def unfuse(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`fuse`."""
    out = {k: unfuse(v) if isinstance(v, Mapping) else v for k, v in tree.items()}
    if QKV in out:
        out.update(zip(SEPARATE[QKV], unfuse_qkv(out.pop(QKV)), strict=True))
    if GATE_UP in out:
        w = out.pop(GATE_UP)
        out.update(w_gate=w[..., 0, :], w_up=w[..., 1, :])
    return out


def separate_reader(read: Callable[[tuple], np.ndarray], saved: Collection[str]) -> Callable[[tuple], np.ndarray]:
    """``read`` (a parameter path -> its array) of a fused checkpoint holding the parameters named ``saved``
    (dotted), answering for the separate weights: ``(..., "attn", "wk")``, not saved, is read as
    ``(..., "attn", "w_qkv")`` and split (the Hugging Face export); an MoE block's experts are read as saved."""
    fused_of = {name: fused for fused, names in SEPARATE.items() for name in names}

    def reader(path: tuple) -> np.ndarray:
        fused = fused_of.get(path[-1])
        if fused is None or ".".join(map(str, path)) in saved:
            return read(path)
        return unfuse({fused: read((*path[:-1], fused))})[path[-1]]

    return reader


def other_layout(target: Any, fused: bool) -> Any:
    """The shapes (ShapeDtypeStructs) of ``target``'s parameters in the other layout."""
    import jax

    return jax.eval_shape(unfuse if fused else fuse, target)


def converted(read: Callable[[tuple], np.ndarray], saved: Any, target: Any, fused: bool) -> Any:
    """``target``'s parameters (ShapeDtypeStructs with shardings; fused or not as ``fused``) from a checkpoint
    of the other layout, whose shapes are ``saved``: each parameter read whole on the host (``read``, a path
    -> its array), converted there, and placed in ``target``'s sharding and dtype."""
    import jax

    host = jax.tree_util.tree_map_with_path(lambda path, _: read(tuple(k.key for k in path)), saved)
    out = (fuse if fused else unfuse)(host)
    return jax.tree.map(lambda v, a: jax.device_put(v.astype(a.dtype), a.sharding), out, target)
