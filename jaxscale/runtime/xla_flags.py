"""XLA flag presets for overlapping communication with compute on GPU and TPU (``xla.preset``).

XLA reads its flags once, when the backend starts: GPU (and CPU) flags from
``XLA_FLAGS``, TPU flags from ``LIBTPU_INIT_ARGS`` (read by libtpu only). A
flag the binary does not know aborts the process ("Unknown flag in
XLA_FLAGS"), and names change between releases: ``--xla_gpu_enable_async_collectives``,
``--xla_gpu_enable_async_all_gather`` and ``--xla_gpu_enable_triton_softmax_fusion``,
still on JAX's "GPU performance tips" page, abort jaxlib 0.10.2 (asynchronous
collectives are now the default on GPU). Every flag below was checked on the
versions jax 0.10.2 installs: the GPU ones are parsed by jaxlib 0.10.2's own
flag parser (the CPU wheel holds the same XLA debug options, so
``tests/test_xla_flags.py`` runs a process with the whole GPU preset), the TPU
ones by libtpu 0.0.42.1 (the version ``jax[tpu]==0.10.2`` pins: it rejects an
unknown name with "Unknown command line flag" before it looks for a TPU).

``gpu`` (``XLA_FLAGS``; sources: JAX's "GPU performance tips", NVIDIA
JAX-Toolbox "GPU performance" (rosetta/docs/GPU_performance.md), OpenXLA's
"GPU optimization levels", MaxText's H100 recipes (the A3 Llama 2 7B xpk
script and NVIDIA's DGX Cloud MaxText Llama 3 benchmark), re-checked against
them for H100):

* the latency-hiding scheduler, which moves asynchronous collectives to overlap
  compute, and their stream at the highest priority (all of them);
* pipelined all-gather / reduce-scatter / all-reduce and while-loop double
  buffering: FSDP's per-layer gathers and gradient reductions cross the layer
  scan's iterations (all of them);
* combine thresholds of 128 MiB (fewer, larger NCCL calls; the figure
  ``launch/slurm.sbatch`` already used), combined per operand, not by dimension.
  The recipes disagree on the size (JAX-Toolbox 8 GiB; MaxText's A3 script
  64-128 MiB; NVIDIA's MaxText benchmark 2 GiB for gathers and all-reduces but
  32 MiB for reduce-scatters, so the backward's gradient reductions start as
  the layers produce them); within one layer-scan iteration, what this
  project's steps hold per layer is below 128 MiB up to 8B, so the threshold
  combines a layer's collectives and no more;
* two asynchronous collectives in flight at once, not XLA's one
  (``--xla_gpu_experimental_parallel_collective_overlap_limit=2``): a pipeline tick's conditionals
  hold the stage's TP all-reduces, and with one collective at a time XLA:GPU's scheduler cannot run a
  stage's collective-permute across them, so the tick's last permute ran synchronously (1f1b on
  ``pp_fsdp_tp``, 8 x H100: 20 of 36 in the tick loop synchronous; with two, 34 overlapped and the 2 of
  the peeled last tick synchronous, ``tests/test_compile_gpu_audit.py``); a permute between stages and an
  all-reduce within one run on different devices' links;
* cuBLAS rather than Triton for GEMMs (all of them);
* XLA's own rematerialization pass off (``--xla_disable_hlo_passes=rematerialization``,
  both MaxText H100 recipes): recomputation is ``model.remat``'s choice, which
  the planner sizes against the device's memory (:mod:`jaxscale.analysis.plan`);
  XLA's pass would recompute behind it when its own estimate runs short;
* all-reduces by NCCL, not XLA:GPU 0.12's Triton one-shot kernel
  (``--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false``): compiling a step for 64 H100 on 8 hosts,
  that kernel fails in LLVM ("size mismatch when packing elements for LLVM struct") on the step's scalar
  all-reduces and aborts the process (the tiny model and Llama 3 70B alike);

The whole preset compiles for 8 H100, H200 and B200 (``jaxscale inspect --target h100``,
``tests/test_compile_gpu.py``); ``benchmarks/gpu_flags.py`` compiles a step without each flag in turn and
prints what the flag changes in the program. XLA's own collective matmul (windowed einsum) is left out:
``--xla_gpu_threshold_for_windowed_einsum_mib=0`` (the recipes' "every size") makes XLA:GPU 0.12's HLO
verifier reject every sharded step compiled for H100 (an asynchronous GEMM whose cuBLAS workspace is
4 MiB inside its computation and 32 MiB outside), and jaxscale's sequence-parallel matmuls state their
collectives in ``shard_map``, where ``model.tp_overlap`` decomposes them (collective matmul of its own);
``--xla_gpu_multi_streamed_windowed_einsum`` went with it (it acts on windowed einsums only).

Left out: command buffers (CUDA graphs) keep XLA's default, on for fusions,
cuBLAS, cuDNN and custom calls: MaxText's recipes turned them off with
``--xla_gpu_graph_level=0``, a flag jaxlib 0.10.2 no longer knows, and
JAX-Toolbox's current advice keeps them for launch-bound steps (a step's
``lax.cond`` cuts the capture: the fp8 scales avoid it). Flags the recipes still
list that abort jaxlib 0.10.2: ``--xla_gpu_enable_triton_softmax_fusion``,
``--xla_gpu_enable_async_*``, ``--xla_gpu_graph_level``,
``--xla_gpu_simplify_all_fp_conversions``. The profile-guided latency estimator
(``jax_enable_pgle``) needs a profiled run first, and ``CUDA_DEVICE_MAX_CONNECTIONS``
and the NCCL variables are the launcher's environment, not XLA flags.

``tpu`` (``LIBTPU_INIT_ARGS``; source: MaxText benchmarks/xla_flags_library.py,
``CF_FOR_ALL_REDUCE_AND_ALL_GATHER``, ``DATA_PARALLEL_OVERLAP`` and its
collective-matmul lines): asynchronous collective fusion of all-gathers over
several steps, overlap of compute and collectives on the TensorCore,
asynchronous all-gather, all-reduce and collective-permute, the data-parallel
all-reduce optimisation, and the decomposed all-gather-einsum and
einsum-reduce-scatter (TPU's collective matmul). Multi-slice (megascale / DCN)
flags depend on the slice count and are left to ``xla.flags``. The preset compiles for v5e and v5p
(``tests/test_compile_tpu.py``); MaxText's ``--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true``
left it: libtpu 0.0.50 refuses it on every chip but v5e ("not supported/recommended on platforms other than
TPU v5e ... incorrect results, hang, SDC"), so a v5e run that wants it adds it in ``xla.flags``.

``xla.flags`` adds flags of one's own, in the preset's variable (``XLA_FLAGS``
for ``gpu`` and ``none``, ``LIBTPU_INIT_ARGS`` for ``tpu``); XLA, not jaxscale,
checks their names when the backend starts. A flag already in the environment
always wins over the preset's of the same name, and nothing already set is
dropped. The command line applies the preset before jax is imported; the
programmatic API must call :func:`apply` before jax starts its backend
(:func:`apply` raises :class:`ConfigError` after), and :meth:`Trainer.build`
warns when the preset's flags are missing from the environment or meant for
another backend (the flags only change speed, never results). This module
never imports jax.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, MutableMapping

from jaxscale.config.read import ConfigError, XlaConfig

GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_disable_hlo_passes=rematerialization",
    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false",
)
TPU_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_all_reduce=true",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
    "--xla_tpu_decompose_all_gather_einsum=true",
    "--xla_tpu_decompose_einsum_reduce_scatter=true",
)
PRESETS: dict[str, tuple[str, ...]] = {"none": (), "gpu": GPU_FLAGS, "tpu": TPU_FLAGS}
VARIABLES = {"none": "XLA_FLAGS", "gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}
PLATFORMS = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}


def flag_name(flag: str) -> str:
    """``--xla_a=1`` -> ``xla_a``."""
    return flag.lstrip("-").split("=", 1)[0]


def flags(xla: XlaConfig) -> list[str]:
    """The preset's flags followed by ``xla.flags``."""
    return [*PRESETS[xla.preset], *xla.flags]


def merge(existing: str | None, new: list[str]) -> str:
    """``new`` flags not already named in ``existing``, then ``existing`` unchanged (so it also wins last)."""
    tokens = (existing or "").split()
    taken = {flag_name(t) for t in tokens if t.startswith("-")}
    return " ".join([*(f for f in new if flag_name(f) not in taken), *tokens])


def environment(xla: XlaConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variable to set and its merged value; empty when there is nothing to add."""
    new = flags(xla)
    if not new:
        return {}
    var = VARIABLES[xla.preset]
    return {var: merge(environ.get(var), new)}


def backend_started() -> bool:
    """Whether jax has started a backend (after which XLA reads no more flags)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public query; jax.distributed uses the same one

    return xla_bridge.backends_are_initialized()


def apply(xla: XlaConfig, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put the flags into the environment (``os.environ`` by default) before jax starts its backend."""
    updates = environment(xla, os.environ if environ is None else environ)
    if updates and environ is None and backend_started():
        raise ConfigError(
            f"xla.preset={xla.preset}: the jax backend has already started and reads its flags only once; "
            f"call jaxscale.runtime.xla_flags.apply before the first jax computation, or set {', '.join(updates)} "
            "in the environment"
        )
    (os.environ if environ is None else environ).update(updates)
    return updates


def problems(xla: XlaConfig, platform: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why the configured flags are not in effect on this backend (nothing when they are)."""
    environ = os.environ if environ is None else environ
    var = VARIABLES[xla.preset]
    present = {flag_name(t) for t in environ.get(var, "").split() if t.startswith("-")}
    missing = [flag_name(f) for f in flags(xla) if flag_name(f) not in present]
    out = []
    if missing:
        out.append(
            f"xla.preset={xla.preset}: {len(missing)} flag(s) not in {var} (e.g. {missing[0]}): "
            "call jaxscale.runtime.xla_flags.apply(config.xla) before jax starts, or use the jaxscale command"
        )
    if xla.preset in PLATFORMS and platform not in PLATFORMS[xla.preset]:
        out.append(f"xla.preset={xla.preset} on the {platform} backend: its flags have no effect there")
    return out


def warn(xla: XlaConfig, platform: str) -> None:
    """A warning for each of :func:`problems` (the flags change speed only, so a run goes on)."""
    for problem in problems(xla, platform):
        warnings.warn(problem, stacklevel=3)
