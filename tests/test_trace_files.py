"""A traced dense train step enters few of the package's files (the house's weight stays where it belongs).

``sys.setprofile`` records every function call while the step of a dense ``dp`` trainer is traced once
(``jax.make_jaxpr`` inside the trainer's scope; building the trainer is not counted); the files under
``jaxscale/`` those calls ran in are counted. Run with ``-s`` to print them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
from helpers import tiny_config

import jaxscale
from jaxscale.training.trainer import Trainer

PACKAGE = Path(jaxscale.__file__).resolve().parent
# 13: the step (training/trainer, training/optim with the schedule's length from config/schema,
# precision/policy and precision/letters, an einsum's letters written once for the policy, the collective
# matmuls and the fp8 kernels; ops/loss), the model (models/llama, models/attention, ops/lean) and the layout
# (layout/rules, layout/sharding, layout/collectives: the gradient-dtype collectives and `lay_out`,
# parallel/sequence). fp8 and models/moe.py are skipped by plain config checks at their call sites
# (models/llama.py, parallel/sequence.py) when precision.fp8 is off and the model is dense.
MAX_FILES = 13


def traced_files(trainer: Trainer) -> list[str]:
    """The package's files (relative paths) whose functions run while ``trainer``'s step is traced."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    with trainer.scope():
        sys.setprofile(profile)
        try:
            jax.make_jaxpr(trainer._train_step)(trainer.abstract_state(), trainer.abstract_batch())
        finally:
            sys.setprofile(None)
    inside = (Path(f).resolve() for f in seen if f.endswith(".py"))
    return sorted(str(p.relative_to(PACKAGE)) for p in inside if p.is_relative_to(PACKAGE))


def test_a_traced_dense_step_enters_few_files():
    files = traced_files(Trainer.build(tiny_config(rules="dp", mesh={"data": 8})))
    print(f"{len(files)} files: {', '.join(files)}")
    assert {"training/trainer.py", "models/llama.py", "ops/loss.py"} <= set(files)
    assert len(files) <= MAX_FILES, files
