"""What the compiled train step holds on the GPUs and TPUs users run, for each shipped model, as JSON lines.

    python benchmarks/compile_targets.py > compile_targets.json      # needs jaxscale[gpu-compile,tpu-compile]
    python benchmarks/compile_targets.py llama3-8b/h100              # the cases named

Each case is a model on a cluster: ``jaxscale plan`` picks the layout (its winner, written with ``--write``;
the tiny models run their experiment's layout in bf16) and ``jaxscale inspect --target`` compiles it for the
cluster's compile-only devices (:mod:`jaxscale.analysis.target`), each in a process of its own. One line per
case: the layout, the GEMMs by kind, cuDNN's fused attention calls, each collective kind as overlapped /
asynchronous with nothing between / synchronous (per step, loop iterations counted), compiled memory per
device against HBM and the planner's figure, and the compile's seconds. A case that does not compile prints
its error's last line. The README's "Compiled for GPUs and TPUs without them" table is this output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BF16 = ("model.dtype=bfloat16",)


def _plan(model: str, cluster: str, tokens: int, seq_len: int, attention: str, *sets: str) -> list[str]:
    return ["--model", model, "--cluster", cluster, *(["--set", *sets] if sets else []), "--global-batch-tokens",
            str(tokens), "--seq-len", str(seq_len), "--attention", attention]


# name -> (target, devices, hosts, plan arguments or None for the experiment's layout, inspect arguments)
CASES: dict[str, tuple[str, int, int, list[str] | None, tuple[str, ...]]] = {
    "tiny/h100": ("h100", 8, 1, None, ("--config", "tiny", "--set", *BF16, "model.attention=cudnn")),
    "llama-1b/h100": ("h100", 1, 1, _plan("llama-1b", "h100", 131072, 8192, "cudnn", "devices_per_node=1"), ()),
    "llama3-8b/h100": ("h100", 8, 1, _plan("llama3-8b", "h100", 1048576, 8192, "cudnn"), ()),
    "llama3-8b/v5e": ("v5e:4x4", 16, 1, _plan("llama3-8b", "tpu-v5e", 1048576, 8192, "auto", "devices_per_node=16"),
                      ()),
    "llama3-70b/h100": ("h100", 64, 8, _plan("llama3-70b", "h100", 4194304, 8192, "cudnn", "nodes=8"), ()),
    "mixtral-8x7b/h100": ("h100", 32, 4, _plan("mixtral-8x7b", "h100", 1048576, 4096, "cudnn", "nodes=4"), ()),
    "deepseek-v3-tiny/h100": ("h100", 8, 1, None, ("--config", "moe-tiny", "--set", "model=deepseek-v3-tiny", *BF16)),
}


def _jaxscale(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "jaxscale", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=3600)


def _failure(done: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in done.stderr.splitlines() if "rror" in ln] or done.stderr.splitlines() or ["no output"]
    return lines[-1][:300]


def run_case(name: str) -> dict[str, Any]:
    """Plan (where the case plans), compile for the target and read the program: one JSON-serialisable row."""
    target, devices, hosts, plan_args, overrides = CASES[name]
    row: dict[str, Any] = {"case": name, "target": target, "devices": devices}
    with tempfile.TemporaryDirectory() as tmp:
        config = list(overrides)
        if plan_args is not None:
            done = _jaxscale(["plan", *plan_args, "--top", "1", "--write", f"{tmp}/plan.yaml"], tmp)
            if done.returncode:
                return {**row, "error": _failure(done)}
            config = ["--config", f"{tmp}/plan.yaml", *overrides]
        start = time.perf_counter()
        done = _jaxscale(["inspect", "--target", target, "--devices", str(devices), "--hosts", str(hosts), "--json",
                          *config, *(["--set"] if "--set" not in config else []), f"run_dir={tmp}/run"], tmp)
        row["wall_seconds"] = round(time.perf_counter() - start, 1)
    if done.returncode:
        return {**row, "error": _failure(done)}
    out = json.loads(done.stdout)
    mem = out["memory"]["total"]
    return {**row, "layout": out["mesh"], "rules": out["rules"], "gemms": out["gemms"], "attention": out["attention"],
            "collectives": out["collectives"], "memory": mem, "hbm_bytes": out["hbm_bytes"], "fits": out["fits"],
            "memory_of_hbm": round(mem / out["hbm_bytes"], 3), "planner_memory": out["planner_memory"],
            "planner_of_compiled": round(out["planner_memory"] / mem, 3), "compile_seconds": out["compile_seconds"]}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case {unknown[0]!r}: one of {', '.join(CASES)}")
    for name in names or CASES:
        print(json.dumps(run_case(name)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
