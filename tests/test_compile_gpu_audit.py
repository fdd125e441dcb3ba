"""The GPU path audited by compiling it for 8 x H100 with ``xla.preset gpu`` (issue 36, item 4).

Each test compiles the real step of the tiny model (or moe-tiny) for compile-only H100s
(``tests/compile_target.py``) and reads what XLA:GPU made of it (``jaxscale.analysis.program``). Counts are
written from the model, as in ``tests/test_compile_gpu.py`` (whose docstring explains the 15 projection GEMMs
of a layer: XLA's dot merger joins the GEMMs that share an operand):

* FP8 in each mode runs every projection GEMM as ``__cublas$lt$matmul$f8``; ``blockwise`` (DeepSeek-V3's
  1 x 128 tiles, 128 x 128 blocks) is one f8 cuBLASLt GEMM per projection too, batched over the K/128 slices
  of its contraction (the batch dimension absent where K is one block), each writing its fp32 partial products
  that a fusion scales and sums: FP8 tensor cores, not a bf16 GEMM of dequantized operands;
* the routed experts' grouped GEMMs (``lax.ragged_dot``, dropless) become plain cuBLASLt GEMMs over the rows
  of the receive buffer (one expert per device, ep = 8: a dense GEMM of ``ep·n`` rows), and the dropless
  exchange ``lax.ragged_all_to_all`` an asynchronous ``ragged-all-to-all-start/done`` pair, overlapped;
* every pipeline schedule on ``pp_fsdp_tp`` compiles (MaxText's GPU pipeline fails with a collective-permute
  cycle, maxtext#2739), its stages' collective-permutes asynchronous.

What the compiles showed and what changed (before -> after, each test's docstring gives its figures):

* collective matmul: XLA's dot merger joined each ring's partial matmuls (they share the weight) into one GEMM
  after every transfer, the permutes then synchronous; each partial matmul now follows the previous one
  (``jaxscale.parallel.collective_matmul.after``). Left: the bf16 backward's rings (autodiff's transposes)
  XLA still merges, and the first transfer of a gathered ring stays synchronous;
* pipelines: a tick's conditionals hold the stage's TP all-reduces, and XLA:GPU kept one collective in flight,
  so 1f1b's and gpipe's last permute of a tick ran synchronously; the gpu preset now allows two;
* cuDNN attention in a stage compiled for compile-only GPUs failed ("needs GPU devices, these are cpu"):
  the stage's abstract mesh now names the platform;
* blockwise fp8: the dropless experts' grouped matmul (a ragged dot batched over K/128 slices) aborted XLA:GPU
  with group sizes [G] (it wants [K/B, G]); inside a pipeline stage a device's tensor-parallel share of a
  weight short of whole blocks was a reshape error deep in the trace, now one ConfigError;
* XLA's ragged-dot expander makes each grouped GEMM dense over the whole receive buffer (``ep·n`` rows, the
  worst case) with the groups folded into the contraction (``[rows, G·K] x [G·K, N]``, the rows masked):
  ``E`` times the routed rows' FLOPs (E experts in all); with Triton GEMMs on, the same shapes as Triton
  fusions. XLA's, not fixable in jaxscale short of a grouped-GEMM kernel;
* every program fits in 80 GB; the planner's figure is below the compiled one for the tiny model (cuBLAS's
  32 MiB workspaces are most of the compiled temporaries).

Only the pipeline with FSDP and TP inside a stage (1f1b) and dropless EP run in CI; the rest is slow.
"""

import pytest
from compile_target import GPU_MISSING, compiled

pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

LAYERS = 4
PROJECTION_GEMMS = 4 + 7 + 4  # forward (qkv, o, gate_up, down), input gradients (7), weight gradients (4)
HEAD_GEMMS = 3  # the output head's forward, input and weight gradient (bf16 unless precision.fp8_head)
ATTENTION_GEMMS = 2 + 4  # q·kᵀ and p·v forward and their four gradients, per layer (dot attention)
ROUTER_GEMMS = 3  # the router's forward, input and weight gradient, in fp32, per MoE layer
FSDP_TP = ("rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
PIPELINE = ("rules=pp_fsdp_tp", "mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4")
DROPLESS_EP = ("--config", "moe-tiny", "--set",  # the experiment, then more KEY=VALUEs (the tests' own follow)
               "rules=ep", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=8", "model.moe.dispatch=dropless")
TP_OVERLAP = ("rules=tp_sp", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "model.tp_overlap=true")
TENSOR = 4
EXPERT_GEMMS = 2 + 3 + 2  # forward (gate_up, down), input gradients (3), weight gradients (gate_up, down)
ATTENTION_PROJECTION_GEMMS = 2 + 4 + 2  # forward (qkv, o), input gradients (4), weight gradients (qkv, o)
# A pipeline stage recomputes its forward in its backward: a layer's projections run 2 x 4 + 7 + 4 GEMMs.
STAGE_PROJECTION_GEMMS = 2 * 4 + 7 + 4


def _permutes_overlap(out: dict, exposed: int = 0) -> None:
    """Every collective-permute in a loop runs asynchronously with compute between its start and done, but for
    ``exposed`` synchronous ones."""
    loops = out["collectives_in_loops"]["collective-permute"]
    assert loops["overlapped"] > 0 and loops["sync"] <= exposed and loops["async_idle"] == 0, loops


def test_a_pipeline_with_fsdp_and_tp_inside_a_stage_overlaps_its_permutes():
    """1f1b on pp_fsdp_tp: the stage's activations and gradients cross by asynchronous collective-permutes, each
    overlapping compute. XLA:GPU runs one collective at a time by default, and a tick's forward and backward are
    conditionals holding the stage's TP all-reduces, so the tick's last permute had nothing to overlap and ran
    synchronously (20 of 36 in the tick loops) until the preset allowed two in flight. The two left synchronous
    are the last tick's messages, in the iterations XLA peels off the loop (nothing after them to hide them)."""
    out = compiled("h100", *PIPELINE, "pipeline.schedule=1f1b")
    assert out["fits"] and set(out["gemms"]) == {"cublasLt bf16"}
    _permutes_overlap(out, exposed=2)
    assert out["collectives"]["collective-permute"]["sync"] <= 2


def test_dropless_ep_moves_rows_by_ragged_all_to_all_and_runs_experts_as_cublas_gemms():
    """moe-tiny, dropless, one expert per GPU: each exchange is an asynchronous ragged-all-to-all overlapping
    compute (forward there and back, and their transposes: 4 a layer), and each grouped matmul (ragged_dot) a
    plain cuBLASLt GEMM over the whole receive buffer (XLA's ragged-dot expander: no grouped GEMM kernel)."""
    out = compiled("h100", *DROPLESS_EP)
    exchange = out["collectives"]["ragged-all-to-all"]
    assert exchange == {"overlapped": LAYERS * 4, "async_idle": 0, "sync": 0}
    assert out["gemms"] == {
        "cublasLt bf16": LAYERS * (ATTENTION_PROJECTION_GEMMS + ATTENTION_GEMMS + EXPERT_GEMMS) + HEAD_GEMMS,
        "cublasLt f32": LAYERS * ROUTER_GEMMS,
    }
    assert out["fits"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("precision.fp8=current",), ("precision.fp8=blockwise", "model.head_dim=32")])
def test_current_and_blockwise_fp8_run_every_projection_as_an_f8_cublaslt_gemm(mode):
    """``current`` as ``delayed`` (test_compile_gpu.py); ``blockwise`` (128 x 128 blocks: head_dim 32 makes the
    key/value width 128) runs each projection as one f8 cuBLASLt GEMM batched over its K/128 slices."""
    out = compiled("h100", *FSDP_TP, *mode)
    assert out["gemms"] == {"cublasLt f8": LAYERS * PROJECTION_GEMMS,
                            "cublasLt bf16": HEAD_GEMMS + LAYERS * ATTENTION_GEMMS}
    assert out["fits"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("precision.fp8=delayed",),
                                  ("precision.fp8=blockwise", "model.head_dim=32", "model.moe.mlp=256")])
def test_fp8_runs_the_routed_experts_as_f8_cublaslt_gemms(mode):
    """Dropless, one expert per GPU. Blockwise: each grouped matmul an f8 GEMM batched over its K/128 slices
    ([K/B, rows, N] fp32 partials), each weight gradient one batched over the rows' 128-row tiles (before,
    group sizes [G] with a batch dimension aborted XLA:GPU: fp8_blockwise_grouped passes [K/B, G])."""
    out = compiled("h100", *DROPLESS_EP, *mode)
    assert out["gemms"] == {
        "cublasLt f8": LAYERS * (ATTENTION_PROJECTION_GEMMS + EXPERT_GEMMS),
        "cublasLt bf16": LAYERS * ATTENTION_GEMMS + HEAD_GEMMS,
        "cublasLt f32": LAYERS * ROUTER_GEMMS,
    }
    assert out["collectives"]["ragged-all-to-all"] == {"overlapped": LAYERS * 4, "async_idle": 0, "sync": 0}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("precision.fp8=delayed",),
                                  ("precision.fp8=blockwise", "model.head_dim=64", "model.mlp=512")])
def test_fp8_runs_a_pipeline_stages_projections_as_f8_cublaslt_gemms(mode):
    """The same program as bf16's with every projection GEMM f8: 19 per layer run (its forward twice, the
    stage's backward recomputing it), the attention and head GEMMs the bf16 program's others. Blockwise needs
    each device's tensor-parallel share in whole 128 x 128 blocks (head_dim 64, mlp 512: else a ConfigError)."""
    plain = compiled("h100", *PIPELINE, "pipeline.schedule=1f1b")
    out = compiled("h100", *PIPELINE, "pipeline.schedule=1f1b", *mode)
    f8, bf16 = out["gemms"]["cublasLt f8"], out["gemms"]["cublasLt bf16"]
    assert f8 % STAGE_PROJECTION_GEMMS == 0 and f8 + bf16 == plain["gemms"]["cublasLt bf16"]
    _permutes_overlap(out, exposed=2)
    assert out["fits"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "circular", "interleaved_1f1b", "zb_h1"])
def test_every_pipeline_schedule_compiles_with_fsdp_and_tp_inside_a_stage(schedule):
    """MaxText's GPU pipeline fails to compile with a collective-permute cycle (maxtext#2739); each of ours
    compiles for 8 x H100, fits, and overlaps its stage permutes."""
    repeats = ("pipeline.repeats=2",) if schedule in ("circular", "interleaved_1f1b") else ()
    out = compiled("h100", *PIPELINE, f"pipeline.schedule={schedule}", *repeats)
    assert out["fits"] and set(out["gemms"]) == {"cublasLt bf16"}
    _permutes_overlap(out)


@pytest.mark.slow
def test_cudnn_attention_runs_in_a_pipeline_stage():
    """One fused forward a layer run, and one more for the recompute in the stage's backward, per backward."""
    out = compiled("h100", *PIPELINE, "pipeline.schedule=1f1b", "model.attention=cudnn")
    assert out["attention"]["forward"] == 2 * out["attention"]["backward"] > 0
    _permutes_overlap(out, exposed=2)


@pytest.mark.slow
def test_ring_attention_overlaps_its_permutes():
    """cp over 4 GPUs: the key/value blocks pass round the ring by asynchronous collective-permutes, every one
    overlapping a block's attention."""
    out = compiled("h100", "rules=cp", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=1", "mesh.context=4",
                   "model.attention=ring")
    permutes = out["collectives"]["collective-permute"]
    assert permutes["sync"] == permutes["async_idle"] == 0 and permutes["overlapped"] > 0
    _permutes_overlap(out)


@pytest.mark.slow
def test_tp_collective_matmul_overlaps_its_permutes_with_the_partial_matmuls():
    """tp_sp over 4 GPUs with model.tp_overlap: each layer's four rings (qkv and gate_up gathered, o and down
    reduce-scattered) pass TENSOR − 1 chunks each. Each partial matmul now follows the previous one
    (collective_matmul.after); before, XLA's dot merger joined a ring's partial matmuls into one GEMM after every
    transfer and the permutes ran synchronously: 14 of the loops' 72 overlapped, 44 now (the forward's 40 of
    48). The rest are the backward's rings (autodiff's transposes), which XLA still merges."""
    out = compiled("h100", *TP_OVERLAP)
    loops = out["collectives_in_loops"]["collective-permute"]
    assert loops["overlapped"] > loops["sync"] and loops["async_idle"] == 0, loops
    assert out["fits"]


@pytest.mark.slow
def test_fp8_collective_matmul_runs_the_projections_in_f8_and_overlaps_its_permutes():
    """The fp8 rings (jaxscale.precision.fp8.collective, backward written out) under tp_sp over 4 GPUs: only
    attention's GEMMs and the head's (itself gathered by a ring: TENSOR forward and weight-gradient chunks, one
    input gradient) stay bf16; every forward ring step's partial matmul is f8; in the loops 56 permutes overlap
    and 16 do not (before collective_matmul.after: 23 and 47, the f8 partial matmuls merged, 80 f8 GEMMs)."""
    out = compiled("h100", *TP_OVERLAP, "precision.fp8=delayed")
    assert out["gemms"]["cublasLt bf16"] == LAYERS * ATTENTION_GEMMS + 2 * TENSOR + 1
    assert out["gemms"]["cublasLt f8"] >= LAYERS * 4 * TENSOR
    loops = out["collectives_in_loops"]["collective-permute"]
    assert loops["overlapped"] > 3 * loops["sync"] and loops["async_idle"] == 0, loops
