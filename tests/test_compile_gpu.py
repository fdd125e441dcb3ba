"""The real train step compiled for 8 x H100 (and H200, B200) on a machine without a GPU.

The CUDA plugin compiles for the target spec XLA embeds for each GPU (``jaxscale.analysis.target``); the
scheduled program is read by ``jaxscale.analysis.program``. Run by ``.ci/run``'s compile stage (a venv with
``jaxscale[gpu-compile]``); skipped, with the reason, where the plugin is not installed.

The counts below are written from the tiny model (4 layers; 7 projections a layer: q, k, v, o, gate, up,
down) and what XLA:GPU does with them: its dot merger joins GEMMs that share an operand, so q, k and v's
forward GEMMs (the same input) are one, gate and up's one, and likewise their weight gradients (the same
input, transposed); the input gradients stay one per projection. A layer is 4 + 7 + 4 = 15 projection GEMMs.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

LAYERS = 4
PROJECTION_GEMMS = 4 + 7 + 4  # forward (qkv, o, gate_up, down), input gradient (7), weight gradient (4) per layer
HEAD_GEMMS = 3  # the output head's forward, input and weight gradient (kept in bf16 under fp8)
ATTENTION_GEMMS = 2 + 4  # q·kᵀ and p·v forward; their four gradients, per layer (dot attention)
FSDP_TP = ("rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")


def test_the_gpu_preset_compiles_fsdp_tp_for_h100_with_cudnn_attention():
    """bf16 fsdp_tp with every flag of xla.preset gpu (the compile failed XLA:GPU's verifier before)."""
    out = compiled("h100", *FSDP_TP, "model.attention=cudnn")
    assert out["xla_preset"] == "gpu" and out["device"] == "NVIDIA H100 80GB HBM3"
    assert out["gemms"] == {"cublasLt bf16": LAYERS * PROJECTION_GEMMS + HEAD_GEMMS}
    assert out["attention"] == {"forward": LAYERS, "backward": LAYERS}
    assert out["fits"] and out["memory"]["total"] < out["hbm_bytes"] == 84942979072


def test_delayed_fp8_runs_every_projection_as_an_f8_cublaslt_gemm():
    out = compiled("h100", *FSDP_TP, "precision.fp8=delayed")
    assert out["gemms"] == {"cublasLt f8": LAYERS * PROJECTION_GEMMS,
                            "cublasLt bf16": HEAD_GEMMS + LAYERS * ATTENTION_GEMMS}


def test_fsdp_gathers_and_reduce_scatters_overlap_compute():
    """ZeRO-3 on 8 GPUs: every per-layer gather and gradient reduce-scatter is asynchronous with compute
    scheduled between its start and done; the one synchronous gather is the step's first (the first layer
    and the embedding, before any compute exists to hide it)."""
    out = compiled("h100", "rules=zero3", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1")
    loops = out["collectives_in_loops"]
    for kind in ("all-gather", "reduce-scatter"):
        assert loops[kind]["overlapped"] >= 2 and loops[kind]["sync"] == loops[kind]["async_idle"] == 0, kind
        assert out["collectives"][kind]["async_idle"] == 0, kind
    assert out["collectives"]["reduce-scatter"]["sync"] == 0
    sync_gathers = [c for c in out["unoverlapped"] if c["kind"] == "all-gather"]
    assert len(sync_gathers) <= 1 and not any(c["in_loop"] for c in sync_gathers)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_the_gpu_preset_compiles_for_h200_and_b200(target):
    out = compiled(target, *FSDP_TP)
    assert out["gemms"] == {"cublasLt bf16": LAYERS * (PROJECTION_GEMMS + ATTENTION_GEMMS) + HEAD_GEMMS}
    assert out["fits"]


def test_ulysses_runs_cudnn_fused_attention_between_async_all_to_alls():
    """Ulysses over 4 GPUs (fsdp 2): each layer's q, k, v and output all-to-alls, forward and backward, around
    one cuDNN fused attention forward and one backward on whole sequences; XLA:GPU runs the all-to-alls
    asynchronously, most with compute scheduled under them (measured: 25 of 32 overlapped, 5 synchronous)."""
    out = compiled("h100", "rules=ulysses", "mesh.data=1", "mesh.fsdp=2", "mesh.context=4", "mesh.tensor=1",
                   "model.attention=cudnn")
    assert out["attention"] == {"forward": LAYERS, "backward": LAYERS}
    a2a = out["collectives"]["all-to-all"]
    assert sum(a2a.values()) == 8 * LAYERS
    assert a2a["overlapped"] >= 6 * LAYERS and a2a["sync"] <= LAYERS + 1
