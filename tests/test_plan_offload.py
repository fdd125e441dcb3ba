"""The planner's activation offload (``model.remat: offload_dots``, ``jaxscale/analysis/host_link.py``): the
device keeps what ``full`` keeps, the backward recomputes what ``save_dots``' does, and the transfers over the
cluster's host link cost what the compute does not hide."""

from __future__ import annotations

import dataclasses

import pytest

from jaxscale.analysis import host_link, plan, remat, strategy
from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.memory import memory
from jaxscale.analysis.params import param_table
from jaxscale.config import flops
from jaxscale.config.read import load_config

SEQ = 8192


@pytest.fixture(scope="module")
def llama8b():
    config = load_config(None, ["model=llama3-8b"])
    return config.model, param_table(config)


def evaluate(llama8b, remat: str, *cluster: str):
    m, params = llama8b
    link = ["host_bandwidth=55.0e9", *cluster]  # PCIe Gen5 (configs/clusters/h100.yaml)
    return plan.evaluate(m, params, plan.Strategy(fsdp=8, remat=remat), SEQ, load_cluster("h100", link))


def test_offload_dots_moves_save_dots_activations_off_the_device(llama8b):
    """Llama 3 8B, fsdp=8, one sequence of 8192 a device: per layer and token q (4096), k and v (1024 each),
    the attention projection (4096), gate and up (14336 each) in bf16 go to the host, 20.4 GB a step."""
    m, params = llama8b
    moved = m.layers * SEQ * (4096 + 2 * 1024 + 4096 + 2 * 14336) * 2
    layout = plan.Strategy(fsdp=8, remat="offload_dots")
    model, step = strategy.model_for(m, layout), strategy.step_for(layout, SEQ)
    assert host_link.offloaded_bytes(model, params, strategy.placement(layout), step) == moved
    dots, offload, full = (evaluate(llama8b, r) for r in ("save_dots", "offload_dots", "full"))
    assert offload.memory["activations"] == full.memory["activations"]
    assert dots.memory["activations"] - offload.memory["activations"] == moved
    # 20.4 GB at 55 GB/s (0.37 s) each way hides behind the forward and the backward: save_dots' time.
    assert offload.time["recompute"] == dots.time["recompute"] < full.time["recompute"]


def test_a_slow_host_link_costs_what_the_compute_does_not_hide(llama8b):
    dots, slow = evaluate(llama8b, "save_dots"), evaluate(llama8b, "offload_dots", "host_bandwidth=5.0e9")
    assert slow.time["recompute"] > dots.time["recompute"]
    assert host_link.exposed_seconds(10.0, 1.0, forward=4.0, backward=8.0) == (10 - 4) + (10 - 8)
    assert host_link.exposed_seconds(10.0, 5.0, forward=4.0, backward=8.0) == 0.0


def test_the_plan_considers_offload_only_over_a_known_host_link(llama8b):
    m, _ = llama8b
    without = load_cluster("h100")
    with_link = dataclasses.replace(without, host_bandwidth=55.0e9)
    assert "offload_dots" in {s.remat for s in plan.layouts(m, with_link, SEQ)}
    assert "offload_dots" not in {s.remat for s in plan.layouts(m, without, SEQ)}


def test_llama3_405b_on_1024_h100_fits_its_fastest_layout_only_with_offload():
    """configs/models/llama3-405b.yaml holds Llama 3.1 405B's published shapes: 2·V·h for the untied embedding and
    head, per layer q and o (h·h each), k and v (h·1024 each), SwiGLU (3·h·53248) and two norms, and the final norm.
    On 128 nodes of 8 H100 at 2048 x 8192 tokens, fsdp=512 context=2 at two sequences per rank keeps ``full``'s
    activations with ``offload_dots`` and fits the 72 GB; ``full`` (its peak) and ``save_dots`` (its kept
    activations) do not, and offload's transfers hide behind the compute (save_dots' step time)."""
    config = load_config(None, ["model=llama3-405b"])
    h, v, layers = 16384, 128256, 126
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * 53248 + 2 * h
    assert flops.param_count(config.model)["total"] == 2 * v * h + layers * layer + h == 405_853_388_800
    cluster = load_cluster("h100", ["nodes=128", "host_bandwidth=55.0e9"])
    m, params = config.model, param_table(config)
    runs = {r: plan.evaluate(m, params, plan.Strategy(fsdp=512, context=2, remat=r, micro_batch=2, accumulation=2),
                             SEQ, cluster) for r in ("full", "save_dots", "offload_dots")}
    assert runs["offload_dots"].memory["total"] <= cluster.budget < runs["full"].memory["total"]
    assert runs["save_dots"].memory["total"] > 4 * cluster.budget
    assert runs["offload_dots"].memory["activations"] == runs["full"].memory["activations"]
    assert runs["offload_dots"].time["total"] == runs["save_dots"].time["total"] < runs["full"].time["total"]


def test_remat_auto_takes_offload_dots_over_full_where_the_host_link_makes_it_faster(llama8b):
    """Llama 3 8B, fsdp=8, one 8192-token sequence a device, a budget between full's peak and save_dots': auto
    takes save_dots where it fits, else offload_dots (on the device what full keeps) over a fast link, full without
    a link or over one too slow to hide 20.4 GB behind the forward and the backward."""
    m, params = llama8b
    layout = plan.Strategy(fsdp=8, remat="full")
    model, place, step = strategy.model_for(m, layout), strategy.placement(layout), strategy.step_for(layout, SEQ)
    peak = {r: memory(dataclasses.replace(model, remat=r), params, place, step)["total"]
            for r in ("save_dots", "offload_dots", "full")}
    # 44.5 GB, 50.3 GB, more: full's backward recomputes a whole layer at once, offload_dots save_dots' part
    assert peak["offload_dots"] < peak["full"] < peak["save_dots"]
    between = (peak["full"] + peak["save_dots"]) / 2

    def auto(budget: float, *cluster: str) -> str:
        return remat.choose(model, params, place, step, budget, load_cluster("h100", list(cluster)))

    assert auto(between, "host_bandwidth=55.0e9") == "offload_dots"
    assert auto(peak["save_dots"], "host_bandwidth=55.0e9") == "save_dots"
    assert auto(between) == "full"
    assert auto(between, "host_bandwidth=1.0e9") == "full"  # 20.4 s each way: longer than the recomputation
    assert remat.choose(model, params, place, step, between) == "full"  # no cluster: as before
    # Where full does not fit but offload_dots does, a slow link still takes offload_dots.
    assert auto(peak["offload_dots"], "host_bandwidth=1.0e9") == "offload_dots"


def test_a_cluster_file_for_remat_auto_is_read_before_jax_starts(capsys):
    from jaxscale.cli import main

    assert main(["train", "--cluster", "bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxscale: error: no cluster named 'bogus'") and "\n" not in err
