"""Shared by the compile-only tests: a step compiled for GPUs or TPU chips by ``jaxscale inspect --target``.

Each compile runs in a process of its own (the CUDA plugin and libtpu read their flags once, when they start),
fully optimised (``JAX_DISABLE_MOST_OPTIMIZATIONS=0``: the program a user's run compiles), and is cached
for the session by its arguments, so tests reading one program compile it once.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

from jaxscale.analysis.target import available

GPU_MISSING = available("gpu")
TPU_MISSING = available("tpu")


@functools.cache
def compiled(target: str, *overrides: str, devices: int | None = None, hosts: int = 1) -> dict:
    """``jaxscale inspect --target TARGET --json`` of the tiny experiment with ``overrides``, as a dict."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "jaxscale", "inspect", "--target", target, "--json", "--hosts", str(hosts),
               *(["--devices", str(devices)] if devices else []),
               "--set", f"run_dir={run_dir}", "model.dtype=bfloat16", *overrides]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)
