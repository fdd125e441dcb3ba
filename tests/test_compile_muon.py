"""The Muon step (zero3) compiled for 8 x H100 on a machine without a GPU (tests/compile_target.py): the
Newton-Schulz iteration runs as cuBLAS GEMMs on the owners and the moves to and from them are asynchronous
all-to-alls with compute scheduled under them.

The tiny model with 8 layers over fsdp = 8: each device owns one layer of each of the 7 stacked hidden matrices
(q, k, v, o, gate, up, down), so the update adds 2 all-to-alls per stack and 3 GEMMs per Newton-Schulz step per
stack (``X X^T``, its square, the polynomial times ``X``; one batched GEMM each for the device's layer) to the
AdamW step's program (measured: 2 all-to-alls and 171 GEMMs there, the embedding's lookup and the model's).
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

STACKS = 7
NS_STEPS = 5
ZERO3 = ("rules=zero3", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "model.layers=8")


def test_muon_moves_are_async_all_to_alls_and_its_iteration_gemms():
    muon = compiled("h100", *ZERO3, "train.optimizer=muon")
    adamw = compiled("h100", *ZERO3)
    a2a, base = muon["collectives"]["all-to-all"], adamw["collectives"]["all-to-all"]
    assert sum(a2a.values()) - sum(base.values()) == 2 * STACKS
    assert a2a["sync"] == a2a["async_idle"] == 0  # every one asynchronous, compute scheduled under it
    gemms = muon["gemms"]["cublasLt bf16"] - adamw["gemms"]["cublasLt bf16"]
    assert gemms == 3 * NS_STEPS * STACKS
    assert muon["fits"]
