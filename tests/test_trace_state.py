"""Trace-time state that nothing mutates: one reader of the layout's ``ContextVar``, zero bubble's records as
values, and no attribute set on a module while a step is traced."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

import jaxscale
from jaxscale.config.read import MESH_AXES
from jaxscale.layout.rules import Rules, Stage
from jaxscale.layout.sharding import layout_of, use_layout
from jaxscale.parallel import weight_split
from jaxscale.precision import policy
from jaxscale.training.trainer import Trainer

PACKAGE = Path(jaxscale.__file__).resolve().parent


def calls(name: str) -> list[tuple[str, str, str]]:
    """(module, innermost enclosing function, callee) of each call ``name(...)`` or ``name.method(...)`` in the
    package (``<module>`` outside any function)."""
    found = []

    def visit(node: ast.AST, module: str, fn: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            fn = node.name
        if isinstance(node, ast.Call):
            target = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            if name in (ast.unparse(target).split(".")[-1], ast.unparse(node.func).split(".")[-1]):
                found.append((module, fn, ast.unparse(node.func)))
        for child in ast.iter_child_nodes(node):
            visit(child, module, fn)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), str(path.relative_to(PACKAGE)), "<module>")
    return found


def test_the_trace_time_state_is_read_at_one_site():
    """Two scoped values in the package, each set and reset by one context manager and read by one accessor:
    the layout in effect (``layout/sharding.py``: ``get`` in ``active`` alone, every other reader asks it) and
    fp8's scope (``precision/fp8/state.py``: the weight copies made once a step, read by ``Fp8.weight``, and
    whether the modules take part, read by ``live``; entered by ``using`` over what it already holds), in place of
    attributes set on the modules while tracing."""
    assert calls("ContextVar") == [
        ("layout/sharding.py", "<module>", "contextvars.ContextVar"),
        ("precision/fp8/state.py", "<module>", "contextvars.ContextVar"),
    ]
    assert sorted(calls("_ACTIVE")) == [
        ("layout/sharding.py", "active", "_ACTIVE.get"),
        ("layout/sharding.py", "use_layout", "_ACTIVE.reset"),
        ("layout/sharding.py", "use_layout", "_ACTIVE.set"),
    ]
    assert sorted(calls("_SCOPE")) == [
        ("precision/fp8/state.py", "live", "_SCOPE.get"),
        ("precision/fp8/state.py", "using", "_SCOPE.get"),
        ("precision/fp8/state.py", "using", "_SCOPE.reset"),
        ("precision/fp8/state.py", "using", "_SCOPE.set"),
        ("precision/fp8/state.py", "weight", "_SCOPE.get"),
    ]


def test_a_split_slot_returns_its_records_as_values():
    """``weight_split.reap`` on a unit of two weight matmuls reading one input and one reading another: the
    distinct inputs once each, the outputs in order; B's taps added to the outputs; W's outputs read the kept
    inputs (not the live ones), and the weight gradient through them is ``xᵀ·dy`` (written here)."""
    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=jax.devices()[:1])
    place = dataclasses.replace(layout_of(mesh, Rules.load("dp")), stage=Stage((), ()))
    rng = np.random.default_rng(0)
    x, a, b, c = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((3, 4), (4, 5), (4, 5), (5, 2)))

    def unit(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        h = policy.einsum("ti,io->to", x, a) * policy.einsum("ti,io->to", x, b)
        return policy.einsum("ti,io->to", jnp.tanh(h), c)

    h = jnp.tanh((x @ a) * (x @ b))
    with use_layout(mesh, place):
        out, inputs, outputs = weight_split.reap(lambda: unit(a, b, c), weight_split.Split())
        taps = [jnp.ones((3, 5)), jnp.zeros((3, 5)), jnp.zeros((3, 2))]
        tapped, _, _ = weight_split.reap(lambda: unit(a, b, c), weight_split.Split(), taps=taps)
        kept = [(2 * x,), (h,)]
        _, _, w_out = weight_split.reap(lambda: unit(a, b, c), weight_split.Split(kept=True), kept=kept)
        dys = [jnp.full((3, 5), 0.5), jnp.full((3, 5), 2.0), jnp.ones((3, 2))]
        _, pull = jax.vjp(lambda a, b, c: weight_split.reap(lambda: unit(a, b, c), weight_split.Split(kept=True),
                                                            kept=kept)[2], a, b, c)
        da, db, dc = pull(dys)
    np.testing.assert_allclose(out, h @ c, rtol=1e-5)
    assert [len(i) for i in inputs] == [1, 1] and len(outputs) == 3
    np.testing.assert_allclose(inputs[0][0], x, rtol=0)
    np.testing.assert_allclose(inputs[1][0], h, rtol=1e-6)
    np.testing.assert_allclose(tapped, jnp.tanh((x @ a + 1) * (x @ b)) @ c, rtol=1e-5)
    np.testing.assert_allclose(w_out[0], 2 * x @ a, rtol=1e-5)
    np.testing.assert_allclose(w_out[2], h @ c, rtol=1e-5)
    np.testing.assert_allclose(da, (2 * x).T @ dys[0], rtol=1e-5)
    np.testing.assert_allclose(db, (2 * x).T @ dys[1], rtol=1e-5)
    np.testing.assert_allclose(dc, h.T @ dys[2], rtol=1e-5)


def test_a_weight_matmul_inside_a_nested_transformation_is_refused():
    """A unit whose weight matmul runs under ``jax.jit`` (its marks in an inner jaxpr): one clear error, not a
    weight gradient silently left out of the W."""
    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=jax.devices()[:1])
    place = dataclasses.replace(layout_of(mesh, Rules.load("dp")), stage=Stage((), ()))
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with use_layout(mesh, place), pytest.raises(ValueError, match=r"^zero bubble's split: a weight matmul"):
        weight_split.types(lambda: jax.jit(lambda w: policy.einsum("ti,io->to", x, w))(w))


def attributes(module: nnx.Module) -> dict[str, int]:
    """Each attribute of ``module`` (its ``vars``, less nnx's own ``_pytree__`` bookkeeping, which nnx's
    transforms renew) by the identity of its value."""
    return {name: id(value) for name, value in vars(module).items() if not name.startswith("_pytree__")}


MOE = ("model=moe-tiny", "train.global_batch=8", "train.seq_len=16", "data.max_bytes=100000")
TRAINERS = {
    "dense-dp": ((), "dp", {"data": 8}),
    "fp8-delayed": (("precision.fp8=delayed",), "dp", {"data": 8}),
    "zb_h1-p2": (("pipeline.microbatches=2", "pipeline.schedule=zb_h1"), "pp", {"stage": 2, "data": 4}),
    "moe-ep": (MOE, "ep", {"expert": 8}),
}



@pytest.mark.parametrize("name", list(TRAINERS))
def test_tracing_a_step_sets_nothing_on_a_module(name, monkeypatch):
    """Every nnx module the traced step makes (by ``nnx.merge``: the model, a pipeline stage's units) has the
    same attributes, the same objects, after the step is traced as when it was made."""
    overrides, rules, mesh = TRAINERS[name]
    trainer = Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh))
    made: list[tuple[nnx.Module, dict[str, int]]] = []
    merge = nnx.merge

    def recorded(*args, **kwargs):
        root = merge(*args, **kwargs)
        made.extend((m, attributes(m)) for _, m in nnx.iter_graph(root) if isinstance(m, nnx.Module))
        return root

    monkeypatch.setattr(nnx, "merge", recorded)
    with trainer.scope():
        jax.make_jaxpr(trainer._train_step)(trainer.abstract_state(), trainer.abstract_batch())
    assert made
    changed = [(type(m).__name__, sorted(set(attributes(m).items()) ^ set(before.items()))) for m, before in made
               if attributes(m) != before]
    assert not changed, changed[:3]
