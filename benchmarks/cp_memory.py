"""Context parallelism: compiled per-device memory and ring traffic of one training step, as JSON.

For each sequence length, one training step of the tiny Llama on 8 (simulated)
devices is lowered and compiled, never run:

* ``cp``: ``rules=fsdp_cp``, ``mesh.context=8``, ring attention; one sequence,
  ``s/8`` tokens per device.
* ``no_cp``: ``rules=zero3``, ``mesh.fsdp=8``; one sequence per device, ``s``
  tokens per device; once with blockwise (flash) attention, once with
  ``jax.nn.dot_product_attention`` (the whole ``s x s`` scores).

Parameters are sharded 8 ways in both, so the difference is activations. The
collective-permute bytes of the CP step are read from its HLO (each
instruction's result size times the trip counts of the loops around it) and
printed next to docs/formulas.md's ``2·(c−1)·b·(s/c)·g·d_h·bytes`` per layer
forward and this kernel's backward: K, V again ``c−1`` times and their fp32
gradient accumulators ``c`` times. The load balance of causal attention is
counted from the tiles each device computes (zig-zag against contiguous chunks).

    python benchmarks/cp_memory.py [--seq-lens 1024 4096 16384 32768] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.parallel.ring_schedule import DIAGONAL, FULL, tile_counts
from jaxscale.training.trainer import Trainer

CP = 8
LAYOUTS = {
    "cp": ("fsdp_cp", {"context": CP}, "ring", 1),
    "no_cp_blockwise": ("zero3", {"fsdp": CP}, "blockwise", CP),
    "no_cp_dot": ("zero3", {"fsdp": CP}, "dot", CP),
}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_CALL = re.compile(
    r"\b(condition|body|calls|to_apply|branch_computations|true_computation|false_computation)=(?:\{([^}]*)\}|%([\w.\-]+))"
)


def compile_step(name: str, seq_len: int, args: argparse.Namespace):
    rules, mesh, attention, batch = LAYOUTS[name]
    sizes = {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, **mesh}
    config = load_config(
        CONFIG_DIR / "experiments" / "tiny.yaml",
        [
            f"rules={rules}",
            *(f"mesh.{axis}={size}" for axis, size in sizes.items()),
            f"model.attention={attention}",
            f"model.attention_block={args.block}",
            f"model.dtype={args.dtype}",
            f"model.remat={args.remat}",
            f"train.seq_len={seq_len}",
            f"train.global_batch={batch}",
            "data.max_bytes=4000000",
        ],
    )
    trainer = Trainer.build(config)
    start = time.perf_counter()
    compiled = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return trainer, compiled, time.perf_counter() - start


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "total_bytes": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "argument_bytes": m.argument_size_in_bytes,
    }


def _array_bytes(type_text: str) -> tuple[str, int]:
    dtype, dims = re.search(r"(\w+)\[([\d,]*)\]", type_text).groups()
    return dtype, _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))


def permute_bytes(hlo: str) -> dict[str, int]:
    """Collective-permute bytes per device per step, by dtype: result size x runs of the enclosing loops."""
    calls: dict[str, list[tuple[str, int]]] = {}
    permutes: dict[str, list[tuple[str, int]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            calls[current], permutes[current] = [], []
            continue
        if current is None or " = " not in line:
            continue
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        for role, listed, single in _CALL.findall(line):
            for callee in (listed or single).split(","):
                runs = int(trips.group(1)) if role == "body" and trips else 1
                calls[current].append((callee.strip().lstrip("%"), runs))
        match = re.search(r"= (.+?) collective-permute(?:-start)?\(", line)
        if match:
            permutes[current].append(_array_bytes(match.group(1)))
    totals: dict[str, int] = {}

    def visit(comp: str, runs: int) -> None:
        for dtype, size in permutes.get(comp, []):
            totals[dtype] = totals.get(dtype, 0) + runs * size
        for callee, trips in calls.get(comp, []):
            visit(callee, runs * trips)

    visit(entry, 1)
    return totals


def ring_formula(trainer: Trainer, seq_len: int, kv_bytes: int) -> dict[str, float]:
    """docs/formulas.md's CP figure per step (all layers), and this kernel's backward, in bytes per device."""
    m = trainer.config.model
    c, b = CP, trainer.config.train.global_batch // (trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"])
    block = b * (seq_len // c) * m.kv_heads * m.head_dim  # one K (or V) block, elements
    forward = 2 * (c - 1) * block * kv_bytes * m.layers
    backward = (2 * (c - 1) * block * kv_bytes + 2 * c * block * 4) * m.layers
    return {"kv_bytes": kv_bytes, "forward": forward, "backward": backward, "total": forward + backward}


def load_balance(seq_len: int, block: int) -> dict[str, list[float]]:
    """Causal attention FLOPs per device (tiles computed x 4·tile²·d_h per head), zig-zag and contiguous."""
    out = {}
    for layout in ("zigzag", "contiguous"):
        counts = tile_counts(CP, seq_len, min(block, seq_len // (2 * CP)), causal=True, layout=layout)
        computed = counts[:, DIAGONAL] + counts[:, FULL]
        out[layout] = {
            "tiles_per_device": computed.tolist(),
            "max_over_min": float(computed.max() / computed.min()),
            "max_over_mean": float(computed.max() / computed.mean()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--skip-dot-above", type=int, default=32768, help="no dot-attention baseline above this length")
    args = parser.parse_args()
    rows = []
    for seq_len in args.seq_lens:
        row = {"seq_len": seq_len}
        for name in LAYOUTS:
            if name == "no_cp_dot" and seq_len > args.skip_dot_above:
                continue
            trainer, compiled, seconds = compile_step(name, seq_len, args)
            tokens = seq_len // (CP if name == "cp" else 1)
            row[name] = {**memory(compiled), "tokens_per_device": tokens, "compile_s": round(seconds, 1)}
            if name == "cp":
                measured = permute_bytes(compiled.as_text())
                row[name]["collective_permute_bytes"] = {
                    "measured": measured,
                    "measured_total": sum(measured.values()),
                    "formula": ring_formula(trainer, seq_len, np.dtype(args.dtype).itemsize),
                    # XLA:CPU moves bf16 collectives as f32 (the program sends bf16): the formula as compiled here.
                    "formula_kv_fp32": ring_formula(trainer, seq_len, 4),
                }
        base = row["no_cp_blockwise"]
        row["no_cp_over_cp"] = {"total": base["total_bytes"] / row["cp"]["total_bytes"],
                                "temp": base["temp_bytes"] / row["cp"]["temp_bytes"]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    result = {
        "model": "configs/models/tiny.yaml",
        "dtype": args.dtype,
        "remat": args.remat,
        "attention_block": args.block,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "rows": rows,
        "load_balance_cp8": load_balance(max(args.seq_lens), args.block),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
