"""One-line mutations the test suite must kill: each applied to a scratch copy of the repository, its tests run there.

    python benchmarks/mutations.py [NAME ...]

prints one JSON object, ``{mutation: killed_by}``: the tests that failed (or errored) on the mutated copy, or
``"SURVIVED"`` when they all passed, or ``"pattern missing"`` when the line to mutate is no longer in the
code (then update :data:`MUTATIONS` to the new code). Exit 1 unless every mutation is killed. Each mutation
is a plain text replacement in one file; the repository itself is never changed. Not collected by pytest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    """Replace ``old`` by ``new`` in ``path``; ``tests`` (pytest node ids) must then fail."""

    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = {
    # The pipeline's custom VJP returning its gradients as if the cotangent were 1.
    "pipeline backward ignores its cotangent": Mutation(
        "jaxscale/parallel/pipeline.py", "(d * g).astype(dt)", "d.astype(dt)",
        ("tests/test_pipeline.py::test_the_pipeline_backward_scales_with_its_cotangent",)),
    # ZeRO-1/2 silently plain data parallelism.
    "Rules.table ignores the optimizer and gradients overrides": Mutation(
        "jaxscale/layout/rules.py", "return {**self.params, **getattr(self, kind)}", "return self.params",
        ("tests/test_gold_equivalence.py::test_layout_matches_single_device[zero1]",
         "tests/test_gold_equivalence.py::test_layout_matches_single_device[zero2]")),
    # The bubble without the chunks per stage.
    "formula_bubble drops v": Mutation(
        "jaxscale/parallel/schedules.py", "return (p - 1) / (v * m + p - 1)", "return (p - 1) / (m + p - 1)",
        ("tests/test_pipeline.py::test_counted_bubble_is_the_formula",)),
    # The optimizer stepping the bf16 compute copy instead of the fp32 master (the master then its upcast).
    "optimizer steps the compute copy": Mutation(
        "jaxscale/precision/policy.py", "weights = optax.apply_updates(weights, updates)",
        "weights = cast(optax.apply_updates(params, updates), p.master)",
        ("tests/test_precision.py::test_an_update_below_bf16_resolution_moves_the_master_only",)),
    # A tile whose queries span two documents and whose keys lie in one of them read as one document (unmasked).
    "two-document tile read as one": Mutation(
        "jaxscale/parallel/ring_schedule.py", "one = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)",
        "one = (k_lo == k_hi) & (q_lo <= k_lo) & (k_lo <= q_hi)",
        ("tests/test_documents.py::test_a_tile_is_skipped_exactly_when_no_query_shares_a_document_with_a_key",)),
}


def scratch_copy(into: Path) -> None:
    """The working tree's tracked and untracked, not ignored files, copied under ``into``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def killed_by(name: str, mutation: Mutation) -> list[str] | str:
    """The tests that fail with ``mutation`` applied to a scratch copy."""
    with tempfile.TemporaryDirectory(prefix="jaxscale-mutant-") as scratch:
        root = Path(scratch)
        scratch_copy(root)
        target = root / mutation.path
        text = target.read_text()
        if text.count(mutation.old) != 1:
            return "pattern missing"
        target.write_text(text.replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": str(root)}
        command = [sys.executable, "-m", "pytest", *mutation.tests, "-n", "0", "-q", "-rf", "-p", "no:cacheprovider"]
        print(f"{name}: {' '.join(command[3:])}", file=sys.stderr, flush=True)
        out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True).stdout
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
        return failed or "SURVIVED"


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        print(f"unknown mutation {unknown[0]!r}; one of: {', '.join(MUTATIONS)}", file=sys.stderr)
        return 2
    results = {name: killed_by(name, MUTATIONS[name]) for name in names or MUTATIONS}
    print(json.dumps(results, indent=2))
    return 0 if all(isinstance(r, list) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
