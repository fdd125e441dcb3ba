"""FP8 projections (``precision.fp8``): every fp8 module of the package, and the one dispatcher that picks a
recipe's kernels (:func:`kernels`, the table of :mod:`jaxscale.precision.fp8.recipes`).

What is quantized: the projections of every block, q/k/v/o of attention and gate/up/down of the MLP (the shared
expert's too), and the routed experts' (a scale and a history per expert, :mod:`jaxscale.ops.routing`). The
embedding and the MoE router stay in ``model.dtype``; so does the LM head unless ``precision.fp8_head`` (the head
and the router are small and sensitive). Master weights, gradients and Adam's moments stay fp32
(:mod:`jaxscale.training.optim`).

The modules: :mod:`~.scaling` (per-tensor scales and the recipe), :mod:`~.operand` (an operand on its way into
fp8), :mod:`~.state` (a module's amax histories and the weights' copies made once a step), :mod:`~.recipes` (the
table), and the kernels: :mod:`~.per_tensor`, :mod:`~.blockwise` (DeepSeek-V3's tiles and blocks), their grouped
matmuls (:mod:`~.grouped`, :mod:`~.blockwise_grouped`) and collective matmuls (:mod:`~.collective`,
:mod:`~.blockwise_collective`, written on the ring steps of :mod:`jaxscale.layout.ring`); the block-scaled formats
MXFP8 and NVFP4 (:mod:`~.microscaling`), their projections (:mod:`~.block_scaled`: cuDNN's block-scaled GEMMs on
Blackwell), grouped matmuls (:mod:`~.block_scaled_grouped`: fp32 ragged dots of the dequantized operands) and
collective matmuls (:mod:`~.block_scaled_collective`); the stack's last units unquantized
(:mod:`~.tail`: NVFP4's last layers in ``model.dtype``).

Sharding: inputs and weights are quantized in the partitioned program, so their amax is the partitioner's global
reduction; inside a sequence-parallel ``shard_map`` the f8 arrays are what is gathered, and the output gradient's
amax is a ``pmax`` over the axes it varies over: every layout quantizes as one device. Inside a pipeline stage
(:mod:`jaxscale.parallel.stage_program`) each stage holds its own layers' histories and quantizes its weights
once per step, before the loop of ticks; a history's update is the largest of the microbatches'
(:func:`~jaxscale.precision.fp8.scaling.global_amax`,
:meth:`~jaxscale.parallel.stage_units.Units.add_amax`; the head's on the last stage). Per-tensor scales
there are per microbatch, as under ``train.microbatches``. Collective matmuls (``model.tp_overlap``) quantize as
the plain collectives do: one scale per operand for the whole ring (``blockwise``: each chunk's tiles), a
``custom_vjp`` around it.
"""

from jaxscale.precision.fp8.operand import Deferred, Operand, mapped, pushed, sharing
from jaxscale.precision.fp8.per_tensor import RESIDUAL
from jaxscale.precision.fp8.recipes import KERNELS, Kernels, kernels
from jaxscale.precision.fp8.scaling import E4M3, E5M2, Quantized, Recipe, global_amax, quantize, stacked
from jaxscale.precision.fp8.state import Copies, Fp8, Fp8Meta, Inputs, check_resume, combine, live, prepare, using
from jaxscale.precision.fp8.tail import scan_stack

__all__ = [
    "E4M3", "E5M2", "KERNELS", "RESIDUAL", "Copies", "Deferred", "Fp8", "Fp8Meta", "Inputs", "Kernels", "Operand",
    "Quantized", "Recipe", "check_resume", "combine", "global_amax", "kernels", "live", "mapped",
    "prepare", "pushed", "quantize", "scan_stack", "sharing", "stacked", "using",
]
