"""Activation offload in the program compiled for 8 x H100 (``jaxscale inspect --target h100``): the offloaded
activations in host memory, moved by asynchronous copies, and off the device.

The tiny experiment (4 layers, MLP width 384, fsdp 4 x tensor 2, 16 sequences of 128 tokens, bf16) keeping
``mlp_hidden`` (the SwiGLU output, MLP wide, split over the tensor axis) on the device, offloading it, or
keeping nothing but the layer inputs; every other value of a layer is recomputed (``model.remat: save_named``).
Measured: host memory 786,432 bytes, the formula's; device temporaries 39.5 MB kept, 10.950 MB offloaded,
10.944 MB keeping nothing (XLA's peak with the kept buffers is more than their bytes: it holds them while the
backward's larger buffers live). Run by ``.ci/run``'s compile stage; skipped, with the reason, where the
CUDA plugin is not installed.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

FSDP_TP = ("rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.remat=save_named")
LAYERS, MLP, BATCH, SEQ, FSDP, TENSOR, BF16 = 4, 384, 16, 128, 4, 2, 2
# Per device: every layer's SwiGLU output, its tokens over fsdp, its width over tensor, in bf16.
OFFLOADED_BYTES = LAYERS * (BATCH // FSDP * SEQ) * (MLP // TENSOR) * BF16  # 786,432


def test_offloaded_activations_live_in_host_memory_moved_asynchronously():
    kept = compiled("h100", *FSDP_TP, "model.remat_names=[mlp_hidden]")
    moved = compiled("h100", *FSDP_TP, "model.remat_offload=[mlp_hidden]")
    neither = compiled("h100", *FSDP_TP)
    assert kept["memory"]["host_temp"] == 0 and kept["host_transfers"] == {"async": 0, "overlapped": 0}
    assert moved["memory"]["host_temp"] == OFFLOADED_BYTES
    # The device holds none of them: its temporaries are those of keeping nothing (within 1%) ...
    assert moved["memory"]["temp"] == pytest.approx(neither["memory"]["temp"], rel=0.01)
    # ... and keeping them on the device costs at least their bytes.
    assert kept["memory"]["temp"] - moved["memory"]["temp"] >= OFFLOADED_BYTES
    transfers = moved["host_transfers"]  # writes in the forward's loop, reads in the backward's
    assert transfers["async"] >= 2 and transfers["overlapped"] >= 1


DP = ("rules=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")
EMBED, Q_WIDTH, KV_WIDTH = 128, 8 * 16, 4 * 16  # h, heads x head_dim, kv_heads x head_dim
# offload_dots moves what save_dots keeps but the layer input: q, k, v, the attention projection, gate, up.
DOTS_BYTES = LAYERS * (BATCH * SEQ // 8) * (Q_WIDTH + 2 * KV_WIDTH + EMBED + 2 * MLP) * BF16  # 2,359,296


def test_offload_dots_moves_save_dots_outputs_to_the_host_as_the_planner_has_it():
    """Measured: device temporaries 41.93 MB under save_dots, 39.81 MB under offload_dots (2.11 MB less, 0.90 of
    the bytes moved: XLA's peak is not the sum of every saved buffer); 36 async transfers, 32 overlapping."""
    kept = compiled("h100", *DP, "model.remat=save_dots")
    moved = compiled("h100", *DP, "model.remat=offload_dots")
    assert kept["memory"]["host_temp"] == 0 and moved["memory"]["host_temp"] == DOTS_BYTES
    assert kept["memory"]["temp"] - moved["memory"]["temp"] == pytest.approx(DOTS_BYTES, rel=0.15)
    assert kept["planner_memory"] - moved["planner_memory"] == DOTS_BYTES
    assert moved["host_transfers"]["overlapped"] >= LAYERS


PP = ("rules=pp", "mesh.stage=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "pipeline.schedule=1f1b",
      "pipeline.microbatches=4")
# The stage's stash: 1F1B's 4 act slots (2p) x 2 layers a stage x 1 row (16 / 4 data / 4 microbatches) x 128
# tokens x 128 wide, bf16, per device.
STASH_BYTES = 4 * (LAYERS // 2) * (BATCH // 4 // 4) * SEQ * EMBED * BF16  # 262,144


def test_a_pipeline_stages_stash_lives_in_host_memory_moved_asynchronously():
    """Measured: host memory 524,288 bytes, two buffers of the stash (the loop's carry and its initial value);
    device temporaries 36.34 MB on the device, 35.93 MB with the stash on the host; 21 async transfers, 18 with
    compute between start and done."""
    kept = compiled("h100", *PP)
    moved = compiled("h100", *PP, "pipeline.offload_stash=true")
    assert kept["memory"]["host_temp"] == 0 and kept["host_transfers"] == {"async": 0, "overlapped": 0}
    assert moved["memory"]["host_temp"] == 2 * STASH_BYTES
    assert kept["memory"]["temp"] - moved["memory"]["temp"] >= STASH_BYTES
    assert moved["host_transfers"]["overlapped"] >= 2
    assert kept["planner_memory"] - moved["planner_memory"] == 2 * STASH_BYTES  # the planner's host_stash
