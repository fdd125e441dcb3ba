"""What each flag of ``xla.preset: gpu`` changes in the program XLA:GPU compiles for 8 x H100 (JSON).

Compiles one step (the tiny model, bf16, fsdp_tp 4 x 2, and zero3 over 8 for FSDP's collectives) with the
whole preset, then once without each flag, every compile in a process of its own (XLA reads its flags once),
and prints per flag what differs from the whole preset: GEMM kinds, fused attention, collectives (overlapped,
async with nothing between, sync; in loops), memory and whether the scheduled program's text differs at all.
Needs ``jaxscale[gpu-compile]`` (Python 3.12).

    python3 benchmarks/gpu_flags.py [--rules fsdp_tp|zero3] [--flag NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

LAYOUTS = {
    "fsdp_tp": ["rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "zero3": ["rules=zero3", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"],
}


def compile_once(rules: str, without: str | None) -> dict:
    """In this process: the step compiled with the preset's flags but ``without`` (None: all of them)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxscale.runtime import xla_flags

    os.environ["XLA_FLAGS"] = " ".join(f for f in xla_flags.GPU_FLAGS if xla_flags.flag_name(f) != without)
    from jaxscale.analysis import program
    from jaxscale.analysis.target import compile_only
    from jaxscale.analysis.xla import compile_step, memory
    from jaxscale.config.read import load_config
    from jaxscale.training.trainer import Trainer

    config = load_config("tiny", [*LAYOUTS[rules], "model.dtype=bfloat16", "run_dir=/tmp/jaxscale-gpu-flags"])
    trainer = Trainer.build(config, list(compile_only("h100", 8).devices))
    compiled = compile_step(trainer)
    text = compiled.as_text()
    return {**program.read(text).as_dict(), "memory": memory(compiled)["total"],
            "text_sha": hashlib.sha256(text.split("\n", 1)[1].encode()).hexdigest()[:12]}


def _child(rules: str, without: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--rules", rules, *(["--without", without] if without else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _diff(base: dict, other: dict) -> dict:
    keys = ("gemms", "attention", "collectives", "collectives_in_loops", "memory")
    out = {k: {"with": base[k], "without": other[k]} for k in keys if base.get(k) != other.get(k)}
    out["program_changed"] = base["text_sha"] != other.get("text_sha")
    return out


def main() -> None:
    from jaxscale.runtime import xla_flags

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", choices=sorted(LAYOUTS), default="fsdp_tp")
    parser.add_argument("--flag", action="append", help="only these flags (names without --)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--without", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(compile_once(args.rules, args.without)))
        return
    base = _child(args.rules, None)
    if "error" in base:
        sys.exit(f"the whole preset does not compile: {base['error']}")
    names = args.flag or [xla_flags.flag_name(f) for f in xla_flags.GPU_FLAGS]
    rows = {}
    for name in names:
        other = _child(args.rules, name)
        rows[name] = other if "error" in other else _diff(base, other)
        print(json.dumps({name: rows[name]}), file=sys.stderr, flush=True)
    print(json.dumps({"rules": args.rules, "preset": base, "without": rows}, indent=1))


if __name__ == "__main__":
    main()
