"""Chunked cross-entropy: compiled temp memory of one training step, plain loss against chunked, as JSON.

The tiny Llama (``configs/experiments/tiny.yaml``) with a large vocabulary, one
training step lowered and compiled (never run) per layout and ``model.loss_chunk``
(0 is the plain loss; ``seq_len / chunk`` vocabulary slices otherwise). Printed per row:
``memory_analysis()`` temp bytes per device, whether any buffer of the per-device logits shape
``[b, s, V/t]`` (fp32) appears in the compiled HLO (instructions of that shape), how many
all-reduces the step has, and the bytes per step that the chunked loss's head-gradient
instructions write (:func:`jaxscale.analysis.hlo_compute.scoped_bytes`; the same for every slice count).

    python benchmarks/loss_memory.py [--vocab 32768] [--seq-len 512] [--batch 8] [--chunks 256 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

from jaxscale.analysis.hlo_compute import scoped_bytes
from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.ops.loss import HEAD_GRADIENT
from jaxscale.training.trainer import Trainer

LAYOUTS = {  # name: (rules, mesh sizes)
    "1 device": ("dp", {}),
    "fsdp8": ("zero3", {"fsdp": 8}),
    "fsdp4 x tp2 + sp": ("fsdp_tp_sp", {"fsdp": 4, "tensor": 2}),
}


def measure(layout: str, chunk: int, args: argparse.Namespace) -> dict:
    rules, mesh = LAYOUTS[layout]
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    overrides = [f"model.vocab_size={args.vocab}", f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
                 f"train.microbatches={args.microbatches}", f"rules={rules}", f"model.loss_chunk={chunk}",
                 *(f"mesh.{k}={v}" for k, v in sizes.items())]
    config = load_config(CONFIG_DIR / "experiments" / "tiny.yaml", overrides)
    devices = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    trainer = Trainer.build(config, jax.devices()[:devices])
    compiled = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    text = compiled.as_text()
    rows = args.batch // args.microbatches // (sizes["data"] * sizes["fsdp"])
    logits = f"f32[{rows},{args.seq_len},{args.vocab // sizes['tensor']}]"
    return {
        "layout": layout,
        "loss_chunk": chunk,
        "temp_MiB": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
        "logits_fp32_MiB": round(rows * args.seq_len * args.vocab // sizes["tensor"] * 4 / 2**20, 1),
        "logits_shaped_instructions": text.count(f"{logits}{{"),
        "all_reduces": text.count(" all-reduce("),
        "head_gradient_MiB": round(scoped_bytes(text, HEAD_GRADIENT) / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 64], help="loss_chunk values besides 0")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    for layout in args.layouts:
        for chunk in (0, *args.chunks):
            print(json.dumps(measure(layout, chunk, args)), flush=True)


if __name__ == "__main__":
    main()
