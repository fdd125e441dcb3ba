"""Block-scaled fp8 (``precision.fp8: mxfp8 | nvfp4``) compiled for 8 x B200 on a machine without a GPU: every
projection's three GEMMs (forward, input gradient, weight gradient) are cuDNN block-scaled GEMMs
(``jax.nn.scaled_matmul`` -> ``__cudnn$blockScaledDot``), on E4M3 (MXFP8) or E2M1 (NVFP4) operands.

The tiny model (4 layers, 7 projections each; ``model.head_dim=32``: whole 32-blocks in each tensor-parallel share)
under ``fsdp_tp``. Unlike cuBLASLt's GEMMs (tests/test_compile_gpu.py), XLA:GPU's dot merger leaves cuDNN's
custom calls apart: q, k and v's forward GEMMs stay three. The LM head and attention stay bf16 cuBLASLt GEMMs;
NVFP4 adds one fp32 cuBLASLt GEMM a layer (measured: 4 on 4 layers; by their fp32 operands, the random Hadamard
transforms of the weight gradients' inputs, all multiplying the one 16 x 16 matrix).
Run by ``.ci/run``'s compile stage; skipped, with the reason, where the CUDA plugin is not installed.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

LAYERS, PROJECTIONS = 4, 7
HEAD_GEMMS, ATTENTION_GEMMS = 3, 2 + 4  # the LM head's three; q·kᵀ and p·v forward and their four gradients
FSDP_TP = ("rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.head_dim=32")
OPERANDS = {"mxfp8": "f8e4m3fn", "nvfp4": "f4e2m1fn"}


@pytest.mark.parametrize("fmt", OPERANDS)
def test_every_projection_gemm_is_a_cudnn_block_scaled_gemm_on_b200(fmt):
    out = compiled("b200", *FSDP_TP, f"precision.fp8={fmt}")
    assert out["device"] == "NVIDIA B200"
    hadamard = {"cublasLt f32": LAYERS} if fmt == "nvfp4" else {}
    assert out["gemms"] == {f"cudnn block-scaled {OPERANDS[fmt]}": 3 * LAYERS * PROJECTIONS,
                            "cublasLt bf16": HEAD_GEMMS + LAYERS * ATTENTION_GEMMS, **hadamard}
    assert out["fits"]
