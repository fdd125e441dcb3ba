"""jaxscale plan --calibrate: the devices present measured into a cluster file, and the plan that file gives
ranks layouts in the order of their measured step times."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
import pytest
import yaml
from helpers import optimized_codegen

from jaxscale.analysis import plan, strategy
from jaxscale.analysis.cluster import KINDS, load_cluster
from jaxscale.analysis.params import param_table
from jaxscale.cli import main
from jaxscale.config.read import load_config
from jaxscale.training.trainer import Trainer

# Many parameters and few tokens: the layouts differ in how much of the step is collectives.
MODEL = {"vocab_size": 8192, "embed": 256, "layers": 2, "heads": 8, "kv_heads": 4, "head_dim": 32, "mlp": 512,
         "dtype": "float32", "param_dtype": "float32", "remat": "none"}
SEQ = 4
S = plan.Strategy
LAYOUTS = [  # 32 sequences of 4 tokens on 8 devices; batch split and accumulation vary the traffic
    S(data=8, micro_batch=4),
    S(data=8, micro_batch=1, accumulation=4),
    S(data=8, zero=1, micro_batch=1, accumulation=4),
    S(fsdp=8, micro_batch=4),
    S(fsdp=8, micro_batch=1, accumulation=4),
    S(data=4, tensor=2, micro_batch=8),
    S(data=2, tensor=4, micro_batch=16),
    S(data=2, tensor=4, micro_batch=2, accumulation=8),
]


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "cpu.yaml"
    with optimized_codegen():  # what is timed is compiled as jaxscale compiles it
        assert main(["plan", "--calibrate", str(path)]) == 0
    return path


def test_calibrate_writes_a_cluster_file_the_plan_reads(cluster_file, tmp_path, capsys):
    cluster = load_cluster(str(cluster_file))
    assert cluster.devices == jax.device_count() and cluster.nodes == 1
    assert "measured by jaxscale plan --calibrate" in cluster.source
    assert len(cluster.matmul_efficiency) >= 3 and len(cluster.attention_efficiency) >= 3
    assert all(0 < e <= 1 for _, e in cluster.matmul_efficiency + cluster.attention_efficiency)
    assert set(cluster.collectives["intra"]) == set(KINDS)
    assert cluster.memory_bandwidth > 0 and cluster.intra_bandwidth > 0
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    argv = ["plan", "--cluster", str(cluster_file), "--model", str(model), "--global-batch-tokens", "128",
            "--seq-len", str(SEQ), "--top", "3"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "why:" in out and "#1 " in out and " ms" in out.split("why:")[1]


def _measured(layout: plan.Strategy, start: tuple[Any, Any]) -> float:
    """CPU seconds of one step (the best of three) from ``start`` (a host state and batch): what other
    processes on the machine do not inflate."""
    trainer = Trainer.build(strategy.config_for(layout, MODEL, SEQ), jax.devices()[: layout.devices])
    state = jax.device_put(start[0], trainer.state_shardings)
    batch = jax.device_put(start[1], dict.fromkeys(start[1], trainer.batch_sharding))
    with optimized_codegen():
        step = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    state, out = step(state, batch)
    jax.block_until_ready(out)
    best = np.inf
    for _ in range(3):
        start = time.process_time()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        best = min(best, time.process_time() - start)
    return best


def _ranks(x: list[float]) -> np.ndarray:
    return np.argsort(np.argsort(x)).astype(float)


@pytest.mark.slow
def test_calibrated_plan_ranks_layouts_as_measured(cluster_file, tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    config = load_config(None, [f"model={model}"])
    cluster, params = load_cluster(str(cluster_file)), param_table(config)
    predicted = [plan.evaluate(config.model, params, lay, SEQ, cluster).time["total"] for lay in LAYOUTS]
    # One initial state and batch for every layout (the values do not change a step's time): the state is
    # initialised, and the data read, once.
    first = Trainer.build(strategy.config_for(LAYOUTS[0], MODEL, SEQ), jax.devices()[: LAYOUTS[0].devices])
    start = jax.device_get((first.init_state(), first.batch(0)))
    measured = [_measured(lay, start) for lay in LAYOUTS]
    rho = np.corrcoef(_ranks(predicted), _ranks(measured))[0, 1]  # Spearman: Pearson of the ranks
    table = "\n".join(f"{lay.describe()} b={lay.micro_batch}: {p:.4f} {m:.4f}"
                      for lay, p, m in zip(LAYOUTS, predicted, measured, strict=True))
    assert rho >= 0.8, f"Spearman {rho:.2f}\n{table}"

