"""What an accelerator's compiled step does: its GEMMs by kind, fused attention and collectives' overlap.

Reads the scheduled HLO text XLA:GPU or the TPU compiler made (``compiled.as_text()``, from a real or a
compile-only device: :mod:`jaxscale.analysis.target`), counting every operation by the times it runs (a
``while`` body's operations times its trip count, a conditional's branches once each):

* **GEMMs by kind**: cuBLAS and cuBLASLt custom calls by operand dtype (``cublasLt f8`` is
  ``__cublas$lt$matmul$f8``: both operands float8), cuDNN's block-scaled GEMMs (``cudnn block-scaled`` with
  the operands' type: MXFP8's f8e4m3fn, NVFP4's f4e2m1fn), Triton GEMM fusions, and on TPU the fusions holding a
  ``convolution`` or ``dot`` (the MXU's matmuls);
* **fused attention**: cuDNN's ``__cudnn$fmha*`` calls, forward and backward;
* **collectives**: each as asynchronous (a ``*-start``/``*-done`` pair, or an ``async-start`` wrapping
  one) or synchronous, and for the asynchronous ones whether compute (a fusion, GEMM, attention call or
  loop) is scheduled between the start and the done: a collective that overlaps nothing is as slow as a
  synchronous one. XLA:GPU marks a pair it will run synchronously ``"is_sync":true``: counted as sync.

No jax: the text alone.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jaxscale.analysis.hlo_text import Computation, Instr, callees, nbytes, parse, shapes, trip_count

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_COMPUTE = ("fusion", "custom-call", "convolution", "dot", "while", "conditional", "call")
_WRAPPERS = ("async-start", "fusion-start")  # a collective run by its called computation (GPU: collective fusions)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w$]+)"')
_GEMM_CALLS = {"__cublas$gemm": "cublas", "__cublas$lt$matmul": "cublasLt", "__cublas$lt$matmul$f8": "cublasLt",
               "__cudnn$blockScaledDot": "cudnn block-scaled"}  # MXFP8 / NVFP4 (jax.nn.scaled_matmul, Blackwell)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of the program: kind, where it is, how often it runs, and whether it overlaps compute."""

    kind: str  # one of COLLECTIVES
    computation: str
    runs: int
    asynchronous: bool
    compute_between: int  # compute operations scheduled between start and done (0 for a synchronous one)
    bytes: int  # the result's bytes
    in_loop: bool  # run inside a loop (:func:`_looped`: a layer scan's per-layer collectives, a pipeline tick's)

    @property
    def overlapped(self) -> bool:
        return self.asynchronous and self.compute_between > 0


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled accelerator step, read from its HLO (counts are per step, loops unrolled by trip count)."""

    gemms: dict[str, int]
    attention: dict[str, int]  # "forward", "backward": cuDNN fused attention calls
    collectives: tuple[CollectiveOp, ...]

    def collective_counts(self, in_loops: bool = False) -> dict[str, dict[str, int]]:
        """Per kind: operations run asynchronously and overlapped, asynchronously with nothing between, sync
        (``in_loops``: those in loop bodies alone)."""
        out: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            if in_loops and not c.in_loop:
                continue
            row = out.setdefault(c.kind, {"overlapped": 0, "async_idle": 0, "sync": 0})
            row["overlapped" if c.overlapped else "async_idle" if c.asynchronous else "sync"] += c.runs
        return out

    def as_dict(self) -> dict:
        return {"gemms": self.gemms, "attention": self.attention, "collectives": self.collective_counts(),
                "collectives_in_loops": self.collective_counts(in_loops=True),
                "unoverlapped": [dataclasses.asdict(c) for c in self.collectives if not c.overlapped]}


def executions(comps: dict[str, Computation], entry: str) -> dict[str, int]:
    """How many times each computation runs in one execution of the entry: a loop body its trip count times
    its caller's (1 where the text does not state the count), every other callee as often as its caller."""
    runs: dict[str, int] = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for instr in comps[name].instrs.values():
            times = runs[name] * ((trip_count(instr, comps) or 1) if instr.opcode == "while" else 1)
            for _, callee in callees(instr):
                if callee in comps and runs.get(callee, 0) < times:
                    runs[callee] = times
                    stack.append(callee)
    return runs


def _dtype(instr: Instr, comp: Computation) -> str:
    """The two operands' element types (printed inline, else their definitions'), ``bf16`` or ``f32xbf16``."""
    types = []
    for name, inline in list(zip(instr.operands, instr.operand_types, strict=True))[:2]:
        found = shapes(inline or (comp.instrs[name].type if name in comp.instrs else ""))
        types.append(found[0][0] if found else "?")
    return "x".join(dict.fromkeys(types)) or "?"


def _gemm_kind(instr: Instr, comp: Computation, comps: dict[str, Computation]) -> str | None:
    """The GEMM kind of one instruction, None where it is no GEMM."""
    if instr.opcode == "custom-call":
        target = (_TARGET.findall(instr.attrs) or [""])[0]
        if target in _GEMM_CALLS:
            return f"{_GEMM_CALLS[target]} {'f8' if target.endswith('f8') else _dtype(instr, comp)}"
        return None
    if instr.opcode in ("dot", "convolution"):
        return f"{instr.opcode} {_dtype(instr, comp)}"
    if instr.opcode != "fusion":
        return None
    kind = (_FUSION_KIND.findall(instr.attrs) or [""])[0]
    if "triton" in kind and "gemm" in kind:
        return "triton"
    body = [comps[c] for _, c in callees(instr) if c in comps]
    if not kind and any(i.opcode in ("convolution", "dot") for c in body for i in c.instrs.values()):
        return "fused dot"  # a matmul fused with its neighbours (TPU's MXU fusions; XLA:GPU without cuBLAS)
    return None


def _attention(instr: Instr) -> str | None:
    target = (_TARGET.findall(instr.attrs) or [""])[0] if instr.opcode == "custom-call" else ""
    if not target.startswith("__cudnn$fmha"):
        return None
    return "backward" if "Backward" in target else "forward"


def _wrapped(instr: Instr, comps: dict[str, Computation]) -> str | None:
    """The collective an asynchronous wrapper starts: XLA:GPU's ``async-start`` and ``fusion-start``
    (collective fusions), the TPU compiler's fusion holding an ``AsyncCollectiveStart`` call; else None."""
    body = [i for _, c in callees(instr) if c in comps for i in comps[c].instrs.values()]
    tpu_start = instr.opcode == "fusion" and any(
        i.opcode == "custom-call" and 'custom_call_target="AsyncCollectiveStart"' in i.attrs for i in body)
    if instr.opcode not in _WRAPPERS and not tpu_start:
        return None
    return next((i.opcode for i in body if i.opcode in COLLECTIVES), None)


def _start(instr: Instr, comps: dict[str, Computation]) -> str | None:
    """The collective an instruction starts asynchronously, None where it starts none."""
    if instr.opcode.endswith("-start") and instr.opcode.removesuffix("-start") in COLLECTIVES:
        return instr.opcode.removesuffix("-start")
    return _wrapped(instr, comps)


def _done(order: list[Instr], k: int) -> int:
    """Where the asynchronous operation started at ``order[k]`` is waited for: the first later instruction
    that reads its result (through ``get-tuple-element``s, as a TPU's collective done does); the end where none."""
    names = {order[k].name}
    for j in range(k + 1, len(order)):
        if names.intersection(order[j].operands):
            if order[j].opcode != "get-tuple-element":
                return j
            names.add(order[j].name)
    return len(order)


def _collectives(comp: Computation, started: dict[str, str], runs: int, nested: set[str],
                 in_loop: bool) -> list[CollectiveOp]:
    """The collectives of one computation in schedule order (``started``: the collective each of its
    asynchronous starts starts, by name); those inside asynchronous wrappers are skipped here (``nested``:
    counted at the wrapper)."""
    order = list(comp.instrs.values())
    out = []
    for k, instr in enumerate(order):
        if (kind := started.get(instr.name)) is not None:
            done = _done(order, k)
            between = sum(o.opcode in _COMPUTE for o in order[k + 1:done])
            sync = '"is_sync":true' in instr.attrs
            size = nbytes(order[done].type) if done < len(order) else nbytes(instr.type)
            out.append(CollectiveOp(kind, comp.name, runs, not sync, 0 if sync else between, size, in_loop))
        elif instr.opcode in COLLECTIVES and comp.name not in nested:
            out.append(CollectiveOp(instr.opcode, comp.name, runs, False, 0, nbytes(instr.type), in_loop))
    return out


def _looped(comps: dict[str, Computation]) -> set[str]:
    """The computations that run inside a loop: a ``while``'s body and everything it calls (a pipeline tick's
    conditionals, a stage's layer loop)."""
    stack = [c for comp in comps.values() for i in comp.instrs.values() if i.opcode == "while"
             for role, c in callees(i) if role == "body"]
    found: set[str] = set()
    while stack:
        name = stack.pop()
        if name in comps and name not in found:
            found.add(name)
            stack += [c for i in comps[name].instrs.values() for _, c in callees(i)]
    return found


def read(hlo_text: str) -> Program:
    """The program's GEMMs, fused attention and collectives, each counted by the times it runs."""
    comps, entry = parse(hlo_text)
    runs = executions(comps, entry)
    started = {name: {i.name: kind for i in comp.instrs.values() if (kind := _start(i, comps)) is not None}
               for name, comp in comps.items()}
    nested = {c for name, comp in comps.items() for i in comp.instrs.values() if i.name in started[name]
              for _, c in callees(i)}
    fused = {c for comp in comps.values() for i in comp.instrs.values() if i.opcode == "fusion"
             for _, c in callees(i)}
    looped = _looped(comps)
    gemms: Counter[str] = Counter()
    attention: Counter[str] = Counter()
    found: list[CollectiveOp] = []
    for name, comp in comps.items():
        if name not in runs:
            continue
        for instr in comp.instrs.values():
            if name in fused and instr.opcode in ("dot", "convolution"):
                continue  # a fusion's matmul: counted at the fusion (a fusion's library call is counted here)
            if (kind := _gemm_kind(instr, comp, comps)) is not None:
                gemms[kind] += runs[name]
            if (part := _attention(instr)) is not None:
                attention[part] += runs[name]
        found += _collectives(comp, started[name], runs[name], nested, name in looped)
    return Program(dict(gemms), dict(attention), tuple(found))
