"""Packed documents: the step time and temp memory of masking across documents (``data.documents``) against the
unmasked packed stream, per attention kernel, as JSON.

The tiny Llama, byte tokens of the standard library's sources (prepared into a temporary directory): with
``--corpus files`` each file is a document (a few thousand tokens: most tiles in one document), with
``paragraphs`` each blank-line-separated paragraph (a few hundred: many tiles across documents, skipped or
masked). For each kernel the same compiled-shape step with and without the document mask, each timed over
``--steps`` steps after one warm-up step, the two runs' steps interleaved (least and median step time: on a
shared machine the least is the steadier), and the compiled step's ``memory_analysis()`` temp bytes per device.
``dot`` and ``blockwise`` run on one device, ``ring`` on a ring of ``--context`` simulated CPU devices (rules
``cp``). One line per run, then one per kernel with the masked run's step time and temp memory over the
unmasked one's. CPU timings are noisy on a shared machine: compare the rows of one run.

    python benchmarks/documents_mask.py [--kernels dot,blockwise,ring] [--corpus files|paragraphs] [--seq-len 1024]
        [--batch 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxscale import simulate_devices

KERNELS = ("dot", "blockwise", "ring")


def build(tokens: Path, kernel: str, documents: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The trainer of one run, its compiled step and its state after one warm-up step."""
    import jax

    from jaxscale.config.read import CONFIG_DIR, load_config
    from jaxscale.training.trainer import Trainer

    devices = args.context if kernel == "ring" else 1
    layout = ["rules=cp", f"mesh.context={devices}"] if kernel == "ring" else ["rules=dp", "mesh.context=1"]
    overrides = ["data.source=tokens", f"data.path={tokens}", f"data.documents={str(documents).lower()}",
                 "model.vocab_size=264", f"model.attention={kernel}", f"model.attention_block={args.block}",
                 *layout, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
                 f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}"]
    trainer = Trainer.build(load_config(CONFIG_DIR / "experiments" / "tiny.yaml", overrides), jax.devices()[:devices])
    step, _ = trainer.compiled_guarded_step
    state, out = step(trainer.init_state(), trainer.batch(0))
    jax.block_until_ready(out)
    return {"trainer": trainer, "step": step, "state": state, "times": [], "out": out}


def timed_step(run: dict[str, Any], k: int) -> None:
    import jax

    batch = run["trainer"].batch(k)
    start = time.perf_counter()
    run["state"], run["out"] = run["step"](run["state"], batch)
    jax.block_until_ready(run["out"])
    run["times"].append(time.perf_counter() - start)


def measure(tokens: Path, kernel: str, args: argparse.Namespace) -> list[dict[str, object]]:
    """The unmasked and the masked run of ``kernel``, their steps interleaved (the machine's load shared)."""
    runs = [build(tokens, kernel, documents, args) for documents in (False, True)]
    for k in range(1, args.steps + 1):
        for run in runs:
            timed_step(run, k)
    rows = [{"kernel": kernel, "corpus": args.corpus, "documents": documents,
             "min_step_s": round(min(run["times"]), 4), "median_step_s": round(statistics.median(run["times"]), 4),
             "temp_bytes": run["step"].memory_analysis().temp_size_in_bytes,
             "loss": round(float(run["out"]["loss"]), 4)} for documents, run in zip((False, True), runs, strict=True)]
    plain, masked = rows
    ratio = {f"{k}_ratio": round(masked[f"{k}_s"] / plain[f"{k}_s"], 3) for k in ("min_step", "median_step")}
    return [*rows, {"kernel": kernel, **ratio, "temp_ratio": round(masked["temp_bytes"] / plain["temp_bytes"], 4)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: dot, blockwise, ring")
    parser.add_argument("--corpus", choices=("files", "paragraphs"), default="files",
                        help="a document per standard-library file, or per paragraph")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=128, help="model.attention_block: the tile of blockwise/ring")
    parser.add_argument("--context", type=int, default=4, help="the ring's devices")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    simulate_devices(args.context if "ring" in kernels else 1)
    from jaxscale.data.prepare import prepare_data

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus == "paragraphs":
            texts = [p for f in files for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
            (Path(tmp) / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            files = [Path(tmp) / "docs.jsonl"]
        prepare_data(files, Path(tmp) / "tokens", val_fraction=0.0)
        for kernel in kernels:
            for row in measure(Path(tmp) / "tokens", kernel, args):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
