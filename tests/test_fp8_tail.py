"""NVFP4's last layers in the compute dtype (``precision.nvfp4.bf16_last``, ``jaxscale/precision/fp8/tail.py``).

How many units: the fraction of the stacked units rounded to the nearest (NVIDIA's 12B model: 15% of its layers,
most at the end). What they compute: with every unit plain the model is the ``precision.fp8: off`` model, loss and
gradients bit for bit; with the last of two plain, the model is its first layer as NVFP4 runs it followed by its
last layer as the fp8-off model runs it, composed here by hand from the two models' own layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, tiny_config

from jaxscale.config import stage_layers
from jaxscale.models.builtin import build

MOE = ("model.moe={}", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.every_n_layers=2")


@pytest.mark.parametrize(
    ("layers", "fraction", "extra", "want"),
    [
        (62, 0.15, (), 9),  # 9.3: NVIDIA's 12B model kept 10 of its 62 blocks (16%)
        (2, 0.15, (), 0),  # 0.3
        (4, 0.15, (), 1),  # 0.6
        (4, 0.5, (), 2),
        (4, 1.0, (), 4),
        (4, 0.0, (), 0),
        (8, 0.15, MOE, 1),  # 4 units of 2 layers: 0.6
    ],
)
def test_plain_units_are_the_fraction_of_the_units_rounded(layers, fraction, extra, want):
    config = tiny_config("precision.fp8=nvfp4", f"model.layers={layers}", f"precision.nvfp4.bf16_last={fraction}",
                         *extra)
    assert stage_layers.plain_units(config) == want
    assert stage_layers.plain_units(tiny_config(f"model.layers={layers}", "precision.fp8=mxfp8")) == 0


TOKENS = jax.random.randint(jax.random.key(1), (2, 64), 0, 256)
POSITIONS = jnp.broadcast_to(jnp.arange(64), (2, 64))


def _loss(logits: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, TOKENS[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _model(*overrides: str) -> nnx.Module:
    with nnx.use_eager_sharding(False):
        return build(tiny_config("model.vocab_size=256", *overrides), nnx.Rngs(0))


def _grads(model: nnx.Module, f=lambda m: _loss(m(TOKENS, POSITIONS))):
    return jax.jit(nnx.value_and_grad(f))(model)


def _unit(stack: nnx.Module, i: int) -> nnx.Module:
    graph, state = nnx.split(stack)
    return nnx.merge(graph, jax.tree.map(lambda a: a[i], state))


def _leaves(grads: nnx.State, i: int | None = None) -> dict[str, np.ndarray]:
    """The gradients by path; the blocks' at unit ``i`` only (None: the blocks left out)."""
    out = {}
    for path, g in nnx.to_flat_state(grads):
        name = "/".join(map(str, path))
        if name.startswith("blocks/"):
            if i is not None:
                out[name] = np.asarray(g[...][i])
        elif i is None:
            out[name] = np.asarray(g[...])
    return out


def test_every_unit_plain_is_the_fp8_off_model():
    loss, grads = _grads(_model("precision.fp8=nvfp4", "precision.nvfp4.bf16_last=1"))
    off_loss, off_grads = _grads(_model())
    assert float(loss) == float(off_loss)
    for i in (None, 0, 1):
        assert _leaves(grads, i).keys() == _leaves(off_grads, i).keys()
        for name, g in _leaves(grads, i).items():
            np.testing.assert_array_equal(g, _leaves(off_grads, i)[name], err_msg=name)


def test_the_last_unit_plain_is_nvfp4_then_the_fp8_off_layer():
    mixed = _model("precision.fp8=nvfp4", "precision.nvfp4.bf16_last=0.5")
    nvfp4, off = _model("precision.fp8=nvfp4", "precision.nvfp4.bf16_last=0"), _model()

    def composed(models: tuple[nnx.Module, nnx.Module]) -> jax.Array:
        nv, plain = models
        x, _ = _unit(nv.blocks, 0)(nv.embed(TOKENS), POSITIONS)
        x, _ = _unit(plain.blocks, 1)(x, POSITIONS)
        return _loss(nv.logits(nv.final_norm(x)))

    loss, grads = _grads(mixed)
    ref_loss, (ref_nv, ref_off) = _grads((nvfp4, off), composed)
    all_nvfp4, _ = _grads(nvfp4)
    all_off, _ = _grads(off)
    print(f"losses: mixed {float(loss):.6f}, composed {float(ref_loss):.6f}, nvfp4 {float(all_nvfp4):.6f}, "
          f"off {float(all_off):.6f}")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert float(loss) not in (float(all_nvfp4), float(all_off))
    assert_trees_close(_leaves(grads), _leaves(ref_nv), 1e-5)
    assert_trees_close(_leaves(grads, 0), _leaves(ref_nv, 0), 1e-5)
    assert_trees_close(_leaves(grads, 1), _leaves(ref_off, 1), 1e-5)
