"""Block-scaled fp8 (``precision.fp8: mxfp8 | nvfp4``) compiled for 8 x B200 on a machine without a GPU: each
quantized projection's three GEMMs (forward, input gradient, weight gradient) are cuDNN block-scaled GEMMs
(``jax.nn.scaled_matmul`` -> ``__cudnn$blockScaledDot``), on E4M3 (MXFP8) or E2M1 (NVFP4) operands.

The tiny model (4 layers, 7 projections each; ``model.head_dim=32``: whole 32-blocks in each tensor-parallel share)
under ``fsdp_tp``. Unlike cuBLASLt's GEMMs (tests/test_compile_gpu.py), XLA:GPU's dot merger leaves cuDNN's
custom calls apart: q, k and v's forward GEMMs stay three. The LM head and attention stay bf16 cuBLASLt GEMMs;
NVFP4 adds one fp32 cuBLASLt GEMM a quantized layer (measured: 4 on 4 layers; by their fp32 operands, the random
Hadamard transforms of the weight gradients' inputs, all multiplying the one 16 x 16 matrix), and keeps its last
layer in bf16 (``precision.nvfp4.bf16_last``: 0.15 of 4 layers, rounded): that layer's 21 GEMMs are bf16 cuBLASLt
ones, which XLA's dot merger joins as in any bf16 layer (q, k and v's forward and input gradients, 3 to 1 each;
gate and up's, 2 to 1 each: 15 left).
Run by ``.ci/run``'s compile stage; skipped, with the reason, where the CUDA plugin is not installed.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

LAYERS, PROJECTIONS = 4, 7
HEAD_GEMMS, ATTENTION_GEMMS = 3, 2 + 4  # the LM head's three; q·kᵀ and p·v forward and their four gradients
FSDP_TP = ("rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.head_dim=32")
OPERANDS = {"mxfp8": "f8e4m3fn", "nvfp4": "f4e2m1fn"}
PLAIN = {"mxfp8": 0, "nvfp4": 1}  # the layers in bf16: round(0.15 x 4) for NVFP4
MERGED = 2 * (3 - 1) + 2 * (2 - 1)  # a bf16 layer's GEMMs the dot merger joins: q/k/v and gate/up, forward and dx


@pytest.mark.parametrize("fmt", OPERANDS)
def test_each_quantized_projection_gemm_is_a_cudnn_block_scaled_gemm_on_b200(fmt):
    out = compiled("b200", *FSDP_TP, f"precision.fp8={fmt}")
    assert out["device"] == "NVIDIA B200"
    quantized, plain = LAYERS - PLAIN[fmt], PLAIN[fmt]
    hadamard = {"cublasLt f32": quantized} if fmt == "nvfp4" else {}
    assert out["gemms"] == {
        f"cudnn block-scaled {OPERANDS[fmt]}": 3 * quantized * PROJECTIONS,
        "cublasLt bf16": HEAD_GEMMS + LAYERS * ATTENTION_GEMMS + plain * (3 * PROJECTIONS - MERGED),
        **hadamard,
    }
    assert out["fits"]
