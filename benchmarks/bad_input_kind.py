"""One kind of bad input (:class:`Kind`), the helpers that build kinds, and how an outcome is classified
(:func:`classify`; the outcomes are ``benchmarks/bad_inputs.py``'s)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import time
from collections.abc import Callable
from pathlib import Path

from jaxscale import cli

# A run small enough to compile in seconds should a bad value be accepted.
RUN = ["train.steps=2", "train.log_every=1", "data.max_bytes=200000", "train.warmup_steps=1"]


@dataclasses.dataclass
class Kind:
    """One bad input: ``argv(tmp)`` builds the command in a fresh directory (after ``setup(tmp)``)."""

    name: str
    argv: Callable[[Path], list[str]]
    names: tuple[str, ...] = ()  # what its one line must name
    setup: Callable[[Path], None] | None = None
    keep: str | None = None  # a path under tmp whose files must be unchanged
    succeeds: Callable[[Path], bool] | None = None  # a kind that must succeed, and this holds after it
    prints: str = ""  # what a kind that must succeed prints on stdout


def train(*sets: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", "--no-progress", "--set", f"run_dir={tmp / 'run'}", *RUN, *sets]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def write(path: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        data = text.encode() if isinstance(text, str) else text
        (tmp / path).write_bytes(data)
    return setup


def classify(kind: Kind, tmp: Path) -> dict[str, object]:
    """Run ``kind`` in the empty directory ``tmp`` and classify its outcome (``benchmarks/bad_inputs.py``)."""
    if kind.setup is not None:
        kind.setup(tmp)
    kept = digest(tmp / kind.keep) if kind.keep else None
    argv = [a.replace("{tmp}", str(tmp)) for a in kind.argv(tmp)]
    err, out = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    escaped = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: its usage line and message
            code = e.code if isinstance(e.code, int) else 2
        except Exception as e:
            escaped, code = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None
    seconds = time.perf_counter() - start
    lines = [line for line in err.getvalue().splitlines() if line.strip() and not line.startswith("jaxscale: warning")]
    errors = [line for line in lines if line.startswith(("jaxscale: ", "usage: ", "jaxscale ")) or ": error: " in line]
    if kind.keep and digest(tmp / kind.keep) != kept:
        outcome = "data_lost"
    elif escaped is not None or "Traceback" in err.getvalue():
        outcome = "traceback"
    elif kind.succeeds is not None:
        outcome = "ok" if code == 0 and kind.succeeds(tmp) and kind.prints in out.getvalue() else "failed"
    elif code == 0:
        outcome = "silent"
    elif argv[0] != "bench" and len([line for line in lines if "error" in line]) > 1:
        outcome = "traceback"
    elif all(name in " ".join(errors) for name in kind.names):
        outcome = "one_line"
    else:
        outcome = "misleading"
    message = escaped or (errors[-1] if errors else (lines[-1] if lines else ""))
    return {"kind": kind.name, "outcome": outcome, "exit": code, "seconds": round(seconds, 2), "line": message[:300]}
