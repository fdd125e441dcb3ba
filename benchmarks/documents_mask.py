"""Packed documents: the step time and temp memory of masking across documents (``data.documents``) against the
unmasked packed stream, as JSON.

The tiny Llama on one device, ``model.attention: dot``, byte tokens of the standard library's sources
(prepared into a temporary directory); the same compiled-shape step with and without the document mask,
each timed over ``--steps`` steps after one warm-up step (median step time), and the compiled step's
``memory_analysis()`` temp bytes. CPU timings are noisy on a shared machine: compare the two rows of one run.

    python benchmarks/documents_mask.py [--seq-len 512] [--batch 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

from jaxscale.config import CONFIG_DIR, load_config
from jaxscale.prepare import prepare_data
from jaxscale.train import Trainer


def measure(tokens: Path, documents: bool, args: argparse.Namespace) -> dict[str, object]:
    overrides = ["data.source=tokens", f"data.path={tokens}", f"data.documents={str(documents).lower()}",
                 "model.vocab_size=264", "model.attention=dot", "rules=dp", "mesh.data=1", "mesh.fsdp=1",
                 "mesh.tensor=1",
                 f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}"]
    trainer = Trainer.build(load_config(CONFIG_DIR / "experiments" / "tiny.yaml", overrides), jax.devices()[:1])
    step, _ = trainer.compiled_guarded_step
    state = trainer.init_state()
    state, out = step(state, trainer.batch(0))
    jax.block_until_ready(out)
    times = []
    for k in range(1, args.steps + 1):
        batch = trainer.batch(k)
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return {"documents": documents, "median_step_s": round(statistics.median(times), 4),
            "temp_bytes": step.memory_analysis().temp_size_in_bytes, "loss": float(out["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    with tempfile.TemporaryDirectory() as tmp:
        prepare_data(files, Path(tmp) / "tokens", val_fraction=0.0)
        for documents in (False, True):
            print(json.dumps(measure(Path(tmp) / "tokens", documents, args)))


if __name__ == "__main__":
    main()
