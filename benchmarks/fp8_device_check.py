"""FP8 on one device, checked and timed in one command (issue 28's device check); JSON out.

    python benchmarks/fp8_device_check.py [--out fp8_check.json]   # one H100/H200 (sized for < 8 minutes)
    python benchmarks/fp8_device_check.py --small                  # CPU-sized (tests/test_fp8_device_check.py)

``projection``: one projection ``y = x · w`` with its backward (``dx``, ``dw`` for a fixed output gradient),
``M x K x N`` = 16384 x 4096 x 4096 (``--small``: 256 x 128 x 128), in bf16 (:func:`jaxscale.precision.policy.einsum`)
and in each ``precision.fp8`` mode (its recipe's einsum, :func:`jaxscale.precision.fp8.kernels`).
``step``: the train step of llama-1b (batch 8 x 2048 tokens; ``--small``: the tiny model) with fp8 off and on.

Each row counts, in the compiled program: ``cublas_f8`` (``__cublas$lt$matmul$f8`` custom calls: the GEMMs
that run on FP8 tensor cores; none on CPU), ``conditionals``; in the lowered program: ``f8_dots`` (``dot_general``
with float8 operands: what the code hands XLA, the count CPU can check), ``dots``. And the time: the
median of ``--iters`` calls (projection: TFLOP/s of its three matmuls, ``6·M·K·N``), or the step time.
Not yet run on a GPU: its time there (4 projections, 3 compiled llama-1b steps) is an estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp

from jaxscale.config.read import MESH_AXES, load_config
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision
from jaxscale.training.trainer import Trainer

MODES = ("off", "delayed", "current", "blockwise")
SHAPES = {False: (16384, 4096, 4096), True: (256, 128, 128)}
STEP = {
    False: ["model=llama-1b", "train.global_batch=8", "train.seq_len=2048"],
    True: ["model=tiny", "model.layers=2", "train.global_batch=2", "train.seq_len=64"],
}
STEP_MODES = {False: ("off", "delayed", "current"), True: ("off", "current")}


def counts(lowered: Any, compiled: Any) -> dict[str, int]:
    """FP8 GEMMs and conditionals of the compiled program, dots (float8 ones apart) of the lowered one."""
    optimized, stablehlo = compiled.as_text(), lowered.as_text()
    dots = [line for line in stablehlo.splitlines() if "stablehlo.dot_general" in line]
    return {
        "cublas_f8": optimized.count("__cublas$lt$matmul$f8"),
        "conditionals": len(re.findall(r"\bconditional\(", optimized)),
        "dots": len(dots),
        "f8_dots": sum("xf8E" in line.split(" : ")[-1].split("->")[0] for line in dots),
    }


def timed(fn: Any, args: tuple, iters: int) -> float:
    """Median seconds per call after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    each = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        each.append(time.perf_counter() - start)
    return statistics.median(each)


def projection(mode: str, shape: tuple[int, int, int], iters: int) -> dict[str, Any]:
    """One projection and its backward in ``mode`` (``off``: bf16)."""
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16) * 1e-3
    history = jnp.zeros((16,), jnp.float32)
    recipe = fp8.Recipe(mode, margin=0, block=128 if k % 128 == 0 else 32)

    def operand(v: jax.Array, grad_history: jax.Array | None) -> jax.Array | fp8.Operand:
        if mode == "off":
            return v
        return fp8.Operand(v, fp8.kernels(recipe).weight(v, history, recipe), history, grad_history, recipe)

    def step(x: jax.Array, w: jax.Array, g: jax.Array) -> tuple:
        y, vjp = jax.vjp(lambda x, w: precision.einsum("mk,kn->mn", operand(x, None), operand(w, history)), x, w)
        return y, *vjp(g)

    lowered = jax.jit(step).lower(x, w, g)
    compiled = lowered.compile()
    seconds = timed(compiled, (x, w, g), iters)
    return {"mode": mode, "shape": [m, k, n], **counts(lowered, compiled), "time_s": seconds,
            "tflops": 6 * m * k * n / seconds / 1e12}


def train_step(mode: str, overrides: list[str], iters: int) -> dict[str, Any]:
    """The train step on one device with ``precision.fp8=mode``."""
    mesh = [f"mesh.{a}=1" for a in MESH_AXES]
    config = load_config(None, [*overrides, *mesh, "rules=dp", f"precision.fp8={mode}", "model.remat=full"])
    trainer = Trainer.build(config, jax.devices()[:1])
    lowered = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch())
    compiled = lowered.compile()
    state, batch = trainer.init_state(), trainer.batch(0)
    for _ in range(2):
        state, out = compiled(state, batch)
    jax.block_until_ready(state)
    each = []
    for _ in range(iters):
        start = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready((state, out))
        each.append(time.perf_counter() - start)
    seconds = statistics.median(each)
    return {"mode": mode, **counts(lowered, compiled), "step_time_s": seconds, "loss": float(out["loss"])}


def check(small: bool, iters: int) -> dict[str, Any]:
    """The report: the device, the projection rows, the step rows."""
    device = jax.devices()[0]
    return {
        "device": f"{device.platform} {device.device_kind}",
        "projection": [projection(mode, SHAPES[small], iters) for mode in MODES],
        "step": [train_step(mode, STEP[small], iters) for mode in STEP_MODES[small]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes and the tiny model")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per row (the median is reported)")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = check(args.small, args.iters)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
