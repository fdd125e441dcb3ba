"""jaxscale.analysis.program on hand-written scheduled HLO: no jax, no compiler."""

from jaxscale.analysis import program

# A loop of one trip holding an all-gather with nothing scheduled between its start and done, then a loop of 4
# trips whose conditional's branch holds a synchronous all-reduce (a pipeline tick's TP all-reduce) and whose
# body holds an asynchronous collective-permute with a GEMM between start and done.
HLO = """HloModule m

%peel (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ag)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %agd)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%branch (b: f32[8]) -> f32[8] {
  %b = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%b), to_apply=%add
}

%other (o: f32[8]) -> f32[8] {
  ROOT %o = f32[8]{0} parameter(0)
}

%add (a: f32[], z: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %z = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %z)
}

%tick (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %y = f32[8]{0} get-tuple-element(%q), index=1
  %pred = pred[] constant(true)
  %cd = f32[8]{0} conditional(%pred, %y, %y), true_computation=%branch, false_computation=%other
  %cp = (f32[8]{0}, f32[8]{0}) collective-permute-start(%cd), source_target_pairs={{0,1},{1,0}}
  %g = (f32[8,8]{1,0}, s8[4]{0}) custom-call(%y, %y), custom_call_target="__cublas$lt$matmul"
  %cpd = f32[8]{0} collective-permute-done(%cp)
  ROOT %r = (s32[], f32[8]{0}) tuple(%j, %cpd)
}

ENTRY %main (e: f32[8]) -> (s32[], f32[8]) {
  %e = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %e)
  %w1 = (s32[], f32[8]) while(%init), condition=%cond, body=%peel, backend_config={"known_trip_count":{"n":"1"}}
  ROOT %w4 = (s32[], f32[8]{0}) while(%w1), condition=%cond, body=%tick, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_what_a_loops_body_calls_runs_in_the_loop():
    found = {c.kind: c for c in program.read(HLO).collectives}
    gather, reduce, permute = found["all-gather"], found["all-reduce"], found["collective-permute"]
    assert (gather.runs, gather.asynchronous, gather.compute_between, gather.in_loop) == (1, True, 0, True)
    assert (reduce.runs, reduce.asynchronous, reduce.in_loop) == (4, False, True)
    assert (permute.runs, permute.asynchronous, permute.compute_between, permute.in_loop) == (4, True, 1, True)


def test_the_loops_gemm_counts_once_per_trip():
    out = program.read(HLO).as_dict()
    assert out["gemms"] == {"cublasLt f32": 4}
    assert out["collectives_in_loops"] == {"all-gather": {"overlapped": 0, "async_idle": 1, "sync": 0},
                                           "all-reduce": {"overlapped": 0, "async_idle": 0, "sync": 4},
                                           "collective-permute": {"overlapped": 4, "async_idle": 0, "sync": 0}}


# XLA:GPU's forms: an all-reduce run by a Triton collective fusion (fusion-start/done) with a fusion between,
# a reduce-scatter wrapped in async-start/done marked is_sync, an f8 cuBLASLt GEMM, a bf16 GEMM inside a
# dynamic-slice fusion (its library call counts, the fusion does not), cuDNN attention forward and backward;
# then libtpu's form: a fusion holding the all-gather and an AsyncCollectiveStart call, its done reached
# through get-tuple-elements, a fused dot between.
GPU_HLO = """HloModule g

%add (a: f32[], z: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %z = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %z)
}

%fused_all-reduce (p0: bf16[8]) -> bf16[8] {
  %p0 = bf16[8]{0} parameter(0)
  ROOT %ar = bf16[8]{0} all-reduce(%p0), replica_groups={}, to_apply=%add
}

%wrapped_rs (p1: f32[8]) -> f32[4] {
  %p1 = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%p1), dimensions={0}, to_apply=%add
}

%ds (d0: bf16[4,8], d1: bf16[8,8]) -> bf16[4,8] {
  %d0 = bf16[4,8]{1,0} parameter(0)
  %d1 = bf16[8,8]{1,0} parameter(1)
  ROOT %gemm = (bf16[4,8]{1,0}, s8[4]{0}) custom-call(%d0, %d1), custom_call_target="__cublas$lt$matmul"
}

%elementwise (e0: bf16[8]) -> bf16[8] {
  ROOT %e0 = bf16[8]{0} parameter(0)
}

ENTRY %main (x: bf16[8], y: f32[8], a: f8e4m3fn[4,8], b: f8e4m3fn[8,8], q: bf16[4,8]) -> bf16[8] {
  %x = bf16[8]{0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %a = f8e4m3fn[4,8]{1,0} parameter(2)
  %b = f8e4m3fn[8,8]{1,0} parameter(3)
  %q = bf16[4,8]{1,0} parameter(4)
  %fs = ((bf16[8]{0}), bf16[8]{0}) fusion-start(%x), kind=kCustom, calls=%fused_all-reduce
  %f = bf16[8]{0} fusion(%x), kind=kLoop, calls=%elementwise
  %fd = bf16[8]{0} fusion-done(%fs)
  %as = ((f32[8]{0}), f32[4]{0}) async-start(%y), calls=%wrapped_rs, backend_config={"is_sync":true}
  %ad = f32[4]{0} async-done(%as)
  %f8 = (f32[4,8]{1,0}, s8[4]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  %dsf = bf16[4,8]{1,0} fusion(%q, %q), kind=kCustom, calls=%ds
  %fwd = (bf16[4,8]{1,0}, s8[4]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax"
  %bwd = (bf16[4,8]{1,0}, s8[4]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  ROOT %out = bf16[8]{0} add(%fd, %f)
}
"""

TPU_HLO = """HloModule t

%gather_fusion (t0: bf16[4]) -> (bf16[4], bf16[8], u32[]) {
  %t0 = bf16[4]{0} parameter(0)
  %ag = bf16[8]{0} all-gather(%t0), dimensions={0}
  ROOT %cc = (bf16[4]{0}, bf16[8]{0}, u32[]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

%mxu (m0: bf16[8,8]) -> bf16[8,8] {
  %m0 = bf16[8,8]{1,0} parameter(0)
  ROOT %dot = bf16[8,8]{1,0} convolution(%m0, %m0), dim_labels=bf_io->bf
}

%done_fusion (u0: bf16[8]) -> bf16[8] {
  ROOT %u0 = bf16[8]{0} parameter(0)
}

ENTRY %main (x: bf16[4], w: bf16[8,8]) -> bf16[8] {
  %x = bf16[4]{0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %start = (bf16[4]{0}, bf16[8]{0}, u32[]) fusion(%x), kind=kCustom, calls=%gather_fusion
  %gte = bf16[8]{0} get-tuple-element(%start), index=1
  %mm = bf16[8,8]{1,0} fusion(%w), kind=kOutput, calls=%mxu
  ROOT %done = bf16[8]{0} fusion(%gte), kind=kCustom, calls=%done_fusion
}
"""


def test_gpu_collective_fusions_async_wrappers_and_library_calls():
    p = program.read(GPU_HLO)
    assert p.gemms == {"cublasLt f8": 1, "cublasLt bf16": 1}
    assert p.attention == {"forward": 1, "backward": 1}
    assert p.collective_counts() == {"all-reduce": {"overlapped": 1, "async_idle": 0, "sync": 0},
                                     "reduce-scatter": {"overlapped": 0, "async_idle": 0, "sync": 1}}


def test_a_tpu_collective_fusion_is_async_until_its_done_reads_it():
    p = program.read(TPU_HLO)
    assert p.gemms == {"fused dot": 1}
    (gather,) = p.collectives
    assert (gather.kind, gather.asynchronous, gather.compute_between, gather.bytes) == ("all-gather", True, 1, 16)
