"""docs/formulas.md's textbook figures for a layout, read off the analytic model's own inputs.

The analytic model (:mod:`jaxscale.analysis.predict`) counts what jaxscale's step holds and moves;
this module puts the playbook's closed forms next to it, for the same parameters, placement and
step (:mod:`jaxscale.analysis.params`), so the two can only differ where the formulas do:

* model state per device as jaxscale's precision policy keeps it (:mod:`jaxscale.precision.policy`: fp32
  training 4Ψ params, 8Ψ Adam, 4Ψ gradients; bf16 compute 2Ψ compute copy, 4Ψ fp32 master, 8Ψ Adam,
  2Ψ gradients) and in the playbook's convention (bf16 parameters and gradients, fp32 master copy
  and Adam moments), by ZeRO stage;
  the stage is read from the layout: 3 if the data-parallel axes split the parameters, 2 if the
  gradients, 1 if the optimizer state. TP divides the tensor-sharded parameters Ψ_t by t (the
  rest, norms, stays whole);
* activations per layer after Korthikanti et al. (bf16), times the layers a device holds;
* traffic per device per step: DP 2·(N−1)/N·Ψ·4 (ZeRO-3: 3·), TP 4 all-reduces of b·s·h per layer,
  the CP ring, the PP boundary and bubble, EP's dispatch and combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxscale.analysis.blocks import layers_run, moe_layers
from jaxscale.analysis.params import Param, Step, dtype_bytes
from jaxscale.config.read import ModelConfig
from jaxscale.layout.rules import Layout

DATA_AXES = ("data", "fsdp")


def state_formula(psi: float, n_d: int, stage: int, param_bytes: int = 4, master_bytes: int | None = None
                  ) -> dict[str, float]:
    """docs/formulas.md "Model state per device" at ZeRO ``stage``: parameters and gradients of ``param_bytes``,
    Adam's moments of the master's dtype; ``master_bytes``: a master apart from the parameters (sharded with
    the moments), None: the parameters are the master (fp32 training: 4Ψ params, 8Ψ Adam, 4Ψ gradients)."""
    mb = master_bytes or param_bytes
    p, g, o = param_bytes * psi, param_bytes * psi, 2 * mb * psi
    out = {
        "params": p / n_d if stage >= 3 else p,
        "gradients": g / n_d if stage >= 2 else g,
        "optimizer": o / n_d if stage >= 1 else o,
    }
    if master_bytes is not None:
        out["master"] = mb * psi / n_d if stage >= 1 else mb * psi
    return out


def korthikanti(m: ModelConfig, tokens: float, seq_len: int, t: int = 1, sp: bool = False) -> float:
    """docs/formulas.md's activations per layer (bf16, Korthikanti et al.), for comparison."""
    sbh = tokens * m.embed
    attn = 5 * m.heads * seq_len / m.embed
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def data_ways(params: Sequence[Param], layout: Layout) -> dict[str, int]:
    """Per kind (params, gradients, optimizer): the most ways the data-parallel axes split a parameter."""
    return {
        kind: max(layout.size(a for a in layout.mesh_axes(p.axes, kind) if a in DATA_AXES) for p in params)
        for kind in ("params", "gradients", "optimizer")
    }


def formulas(m: ModelConfig, params: Sequence[Param], layout: Layout, step: Step) -> dict[str, Any]:
    """docs/formulas.md's figures for this layout, in bytes per device (see the module docstring)."""
    mesh = layout.mesh
    compute, master = step.copies(m)
    pbytes, mbytes, cbytes = dtype_bytes(compute), dtype_bytes(master), dtype_bytes(m.dtype)
    apart = mbytes if compute != master else None
    psi = sum(p.size for p in params)
    t = mesh["tensor"]
    psi_t = sum(p.size for p in params if "tensor" in layout.mesh_axes(p.axes))
    local = psi - psi_t + psi_t / t
    nd = mesh["data"] * mesh["fsdp"]
    ways = data_ways(params, layout)
    stage = 3 if ways["params"] > 1 else 2 if ways["gradients"] > 1 else 1 if ways["optimizer"] > 1 else 0
    out: dict[str, Any] = {
        "convention": f"compute copy {pbytes}Ψ" + (f" + master {mbytes}Ψ" if apart else " (the master)")
        + f" + Adam moments {2 * mbytes}Ψ + gradients {pbytes}Ψ (transient), each / its dp ways",
        "psi": psi,
        "psi_tensor_sharded": psi_t,
        "n_d": nd,
        "zero_stage": stage,
        "params_bytes": pbytes * local / ways["params"],
        "grads_bytes": pbytes * local / ways["gradients"],
        "master_bytes": mbytes * local / ways["optimizer"] if apart else 0.0,
        "adam_bytes": 2 * mbytes * local / ways["optimizer"],
        "dp_comm_bytes": (3 if stage == 3 else 2) * (nd - 1) / nd * local * pbytes,
    }
    micro = step.microbatches
    if t > 1:
        b = step.global_batch // (nd * micro)
        bsh = b * (step.seq_len // mesh["context"]) * m.embed * cbytes
        out["tp_comm_bytes"] = 4 * m.layers * micro * 2 * (t - 1) / t * bsh  # 2 all-reduces fwd, 2 bwd
    stage_local = local / mesh["stage"]
    out["state_jaxscale"] = state_formula(stage_local, nd, stage, pbytes, apart)
    out["state_playbook"] = state_formula(stage_local, nd, stage, 2, 4)  # bf16 params and grads, fp32 master + Adam

    context, stages = layout.ways(("length",)), layout.ways(("layers",))
    sp = "tensor" in layout.mesh_axes(("norm_length",))
    rows = step.global_batch / micro / layout.ways(("batch",))
    s = step.seq_len // context
    tokens = rows * s
    full_remat = 2 * tokens * m.embed / (t if sp else 1)  # only the layer input, in bf16
    per_layer = full_remat if m.remat in ("full", "offload_dots") else korthikanti(m, tokens, s, t, sp)
    out["activations_korthikanti_bf16"] = per_layer * (m.layers / stages)
    if context > 1:
        kv = 2 * (context - 1) * rows * s * m.kv_heads * m.head_dim * cbytes
        out["cp_comm_bytes"] = 3 * kv * m.layers * micro  # forward, and twice that backward
    if stages > 1:
        out["pp_comm_bytes"] = 2 * rows * s * m.embed * cbytes * micro  # 2·m·(b/m)·s·h per boundary
        out["pp_bubble"] = (stages - 1) / (step.pipeline_microbatches * step.repeats + stages - 1)
    if m.moe is not None and layout.ways(("expert",)) > 1:
        ep = layout.ways(("expert",))
        per_layer_ep = 2 * m.moe.top_k * rows * s * m.embed * cbytes * (ep - 1) / ep
        out["ep_comm_bytes"] = 2 * per_layer_ep * (moe_layers(m) + layers_run(m) - m.layers) * micro
    return out
