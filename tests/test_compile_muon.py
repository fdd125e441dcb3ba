"""The Muon step (zero3) compiled for 8 x H100 on a machine without a GPU (tests/compile_target.py): the
Newton-Schulz iteration runs as cuBLAS GEMMs on the owners and the moves to and from them are asynchronous
all-to-alls with compute scheduled under them.

The tiny model with 8 layers over fsdp = 8: each device owns one layer of each of the 7 stacked hidden matrices
(q, k, v, o, gate, up, down), so the update adds 2 all-to-alls per stack and 3 GEMMs per Newton-Schulz step per
stack (``X X^T``, its square, the polynomial times ``X``; one GEMM each for the device's layer) to the AdamW
step's program: 21 GEMMs a layer and 3 for the head (tests/test_compile_gpu.py, dot attention) and 2 all-to-alls
(the embedding's lookup and its gradient), measured on the AdamW step.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

LAYERS, STACKS, NS_STEPS = 8, 7, 5
ADAMW_GEMMS = LAYERS * (15 + 6) + 3  # projections and dot attention per layer, the head (tests/test_compile_gpu.py)
ADAMW_ALL_TO_ALLS = 2  # the embedding's lookup (measured on the AdamW step)


def test_muon_moves_are_async_all_to_alls_and_its_iteration_gemms():
    out = compiled("h100", "rules=zero3", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", f"model.layers={LAYERS}",
                   "train.optimizer=muon")
    a2a = out["collectives"]["all-to-all"]
    assert sum(a2a.values()) == ADAMW_ALL_TO_ALLS + 2 * STACKS
    assert a2a["sync"] == a2a["async_idle"] == 0  # every one asynchronous, compute scheduled under it
    assert out["gemms"] == {"cublasLt bf16": ADAMW_GEMMS + 3 * NS_STEPS * STACKS}
    assert out["fits"]
