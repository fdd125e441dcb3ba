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
