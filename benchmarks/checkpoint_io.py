"""Checkpoint save / restore time and bytes on disk, on simulated CPU devices.

    python benchmarks/checkpoint_io.py --model tiny
    python benchmarks/checkpoint_io.py --model 100m

Saves the train state of a model after one training step (so that Adam's
moments are not all zeros, which would compress) under ``zero3`` on 8 devices,
asynchronously: the blocking device -> host copy, then the time until the step
is committed. Reports the bytes on disk next to 12Ψ (fp32 parameters and two
Adam moments), restores the checkpoint under ``zero3`` on 8 devices, ``tp`` on
4 and ``dp`` on 1, checking every restored value, and checks that a second save
holds its values while a donated train step runs during the write.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from jaxscale.checkpoint.store import Checkpointer
from jaxscale.config.flops import param_count
from jaxscale.config.read import load_config
from jaxscale.training.trainer import Trainer

MODELS = {
    "tiny": ["model=tiny"],
    "100m": ["model.vocab_size=32000", "model.embed=768", "model.layers=8", "model.heads=12", "model.kv_heads=4",
             "model.head_dim=64", "model.mlp=2048"],
}
LAYOUTS = {"zero3 on 8": ("zero3", {"fsdp": 8}, 8), "tp on 4": ("tp", {"tensor": 4}, 4), "dp on 1": ("dp", {}, 1)}


def trainer_for(model: list[str], rules: str, mesh: dict[str, int], devices: int) -> Trainer:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    overrides = [*model, f"rules={rules}", *(f"mesh.{k}={v}" for k, v in sizes.items()), "train.global_batch=8"]
    return Trainer.build(load_config(None, overrides), jax.devices()[:devices])


def assert_equal(tree: object, reference: object) -> None:
    for a, b in zip(jax.tree.leaves(jax.device_get(tree)), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(a, b)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    model = MODELS[args.model]
    directory = Path(args.dir or tempfile.mkdtemp(prefix="jaxscale-ckpt-"))
    source = trainer_for(model, *LAYOUTS["zero3 on 8"])
    psi = param_count(source.config.model)["total"]
    state, _ = source.step(source.init_state(), source.batch(0))
    state = jax.block_until_ready(state)
    reference = jax.device_get(state)
    checkpointer = Checkpointer(directory)
    meta = ({"step": 1}, {"skipped_updates": 0}, source.config.to_dict())
    start = time.perf_counter()
    checkpointer.save(1, state, *meta)
    blocking = time.perf_counter() - start
    checkpointer.wait()
    total = time.perf_counter() - start
    size = disk_bytes(directory / "1")
    print(f"model {args.model}: {psi / 1e6:.1f}M parameters; 12Ψ = {12 * psi / 2**20:.1f} MiB")
    print(f"save (zero3 on 8): blocking {blocking:.2f} s, committed after {total:.2f} s; "
          f"{size / 2**20:.1f} MiB on disk ({size / (12 * psi):.3f} x 12Ψ)")
    for name, layout in LAYOUTS.items():
        target = trainer_for(model, *layout)
        start = time.perf_counter()
        restored = jax.block_until_ready(checkpointer.restore(target.abstract_state(), 1).state)
        elapsed = time.perf_counter() - start
        assert_equal(restored, reference)
        print(f"restore onto {name}: {elapsed:.2f} s (every value checked)")
    checkpointer.save(2, state, *meta)
    jax.block_until_ready(source.step(state, source.batch(1)))  # donates the arrays being written
    checkpointer.wait()
    assert_equal(checkpointer.restore(source.abstract_state(), 2).state, reference)
    print("a donated step during an async save: the checkpoint holds the values at save time")
    checkpointer.close()


if __name__ == "__main__":
    main()
