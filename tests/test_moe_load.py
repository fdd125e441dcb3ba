"""MoE load metrics: per layer, whole-batch on any mesh (against a NumPy count), in metrics.jsonl and the report."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models import moe
from jaxscale.ops import routing as kernels
from jaxscale.training import report
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

EXPERTS, TOP_K = 8, 2
MOE = ["model.moe={}", f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", "model.moe.mlp=32",
       "model.moe.capacity_factor=1.0"]


def numpy_load(x, router, seq_capacity):
    """Choices per expert, fraction dropped and mean router entropy, counted token by token in NumPy:
    softmax, top-k (ties to the lower index), then GShard's slots per sequence, first choices first."""
    logits = np.einsum("bsd,de->bse", x.astype(np.float64), router.astype(np.float64))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    index = np.argsort(-p, axis=-1, kind="stable")[..., :TOP_K]
    load = np.bincount(index.ravel(), minlength=EXPERTS)
    dropped = 0
    for seq in index:
        used = np.zeros(EXPERTS, int)
        for j in range(TOP_K):
            for e in seq[:, j]:
                dropped += used[e] >= seq_capacity
                used[e] += 1
    entropy = -np.mean(np.sum(p * np.log(p), -1))
    return load, dropped / index.size, entropy


@pytest.mark.parametrize(
    "rules, mesh", [("ep", {"expert": 4, "data": 2}), ("ep_fsdp", {"expert": 4, "fsdp": 2}), (None, None)]
)
def test_layer_load_summed_across_shards(rules, mesh):
    config = tiny_config(*MOE, rules=rules or "dp", mesh=mesh)
    with nnx.use_eager_sharding(False):
        layer = moe.MoE(config, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    # Router weights scaled up so that the load is uneven and the capacity drops choices.
    params["router"] = params["router"] * 30
    x = np.asarray(jax.random.normal(jax.random.key(1), (16, 32, config.model.embed)), np.float32)
    toward = np.asarray(params["router"][:, 0])
    x = (x + 3.0 * toward / np.linalg.norm(toward)).astype(np.float32)  # expert 0 favoured: uneven on purpose

    @jax.jit
    def stats(params, x):
        layer = nnx.merge(graphdef, params)
        if rules is None:
            return layer(x)[1]
        with use_rules(make_mesh(config.mesh), Rules.load(rules)):
            return layer(x)[1]

    aux = jax.device_get(stats(params, x))
    load, dropped, entropy = numpy_load(x, np.asarray(params["router"]), kernels.capacity(config.model.moe, 32))
    np.testing.assert_array_equal(aux["moe_load"], load)
    assert float(aux["moe_dropped"]) == pytest.approx(dropped, abs=1e-7) and dropped > 0
    assert float(aux["moe_entropy"]) == pytest.approx(entropy, rel=1e-5)
    # The per-layer summary of a stack of two such layers.
    layers = {k: np.stack([aux[k]] * 2) for k in ("moe_load", "moe_dropped", "moe_entropy")}
    summary = jax.device_get(moe.load_metrics(layers))
    mean = load.mean()
    np.testing.assert_allclose(summary["moe_load_max"], [load.max() / mean] * 2, rtol=1e-6)
    np.testing.assert_allclose(summary["moe_load_min"], [load.min() / mean] * 2, rtol=1e-6)
    np.testing.assert_allclose(summary["moe_load_cv"], [load.std() / mean] * 2, rtol=1e-6)
    assert load.max() / mean > 1.5  # uneven on purpose


def test_load_metrics_logged_and_plotted(run_dir):
    steps = ["train.steps=4", "train.log_every=2", f"run_dir={run_dir}", "model.moe.balance=sign"]
    config = tiny_config(*MOE, *steps, rules="ep_fsdp", mesh={"expert": 4, "fsdp": 2})
    fit(Trainer.build(config), progress=False)
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 3]
    for r in records:
        for key in moe.LOAD_METRICS:
            assert len(r[key]) == config.model.layers, key  # one value per MoE layer
        assert all(hi >= 1 >= lo >= 0 for hi, lo in zip(r["moe_load_max"], r["moe_load_min"], strict=True))
    pytest.importorskip("matplotlib")
    assert report.run_png(run_dir).exists()
