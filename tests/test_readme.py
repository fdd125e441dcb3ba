"""The README stays true: every file it (and docs/) cites exists, and its shell and Python blocks run as written.

Each ```bash and ```python block of README.md runs in order, in one scratch directory that holds
links to the repository's top-level entries (so a block may use what an earlier one wrote, such as
a checkpoint), with this checkout's code first on ``PYTHONPATH`` and no ``XLA_FLAGS`` (the command
line asks for its own simulated devices). A bash block runs under ``set -euo pipefail``; lines that
install the package (``python3 -m pip install ...``) are not re-run: the package is installed. A
marker in an HTML comment right above a block says what the test does with it:

* ``<!-- readme-test: skip REASON -->``: never run here (a cluster, a GPU, files of one's own);
* ``<!-- readme-test: long -->``: minutes on 2 CPU cores; run only with ``JAXSCALE_README_LONG=1``.

Every other block runs in the suite, so a block that fails fails the test.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from jaxscale.config.read import Config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LONG = os.environ.get("JAXSCALE_README_LONG") == "1"
TIMEOUT_S = 900
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n(?P<code>.*?)```", re.S)
CITED = re.compile(r"(?<![\w./<-])((?:configs|jaxscale|launch|benchmarks|docs|tests)/[\w./*-]*\w/?)")
INSTALL = re.compile(r"^\s*python3? -m pip install ")


@dataclasses.dataclass(frozen=True)
class Block:
    index: int
    line: int
    lang: str
    code: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.index}-{self.lang}-line{self.line}"


def blocks(text: str) -> list[Block]:
    out = []
    for i, m in enumerate(BLOCK.finditer(text)):
        line = text.count("\n", 0, m.start("code"))
        out.append(Block(i, line, m["lang"], m["code"], (m["marker"] or "").strip()))
    return out


def cited(text: str) -> set[str]:
    """Repository paths named in ``text`` (placeholders such as ``EXP.yaml`` left out)."""
    found = set()
    for path in CITED.findall(text):
        path = path.rstrip(".")
        if any(part.isupper() for part in re.split(r"[/.]", path)):
            continue
        found.add(path)
    return found


RUNNABLE = [b for b in blocks(README.read_text()) if b.lang in ("bash", "python")]


def test_the_readme_and_docs_cite_only_files_that_exist():
    missing = []
    for doc in [README, *DOCS]:
        for path in sorted(cited(doc.read_text())):
            if not glob.glob(str(ROOT / path)):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "cited but missing: " + ", ".join(missing)


def test_every_block_is_bash_python_or_plain_text_and_markers_are_known():
    for b in blocks(README.read_text()):
        assert b.lang in ("bash", "python", "yaml", ""), f"block at line {b.line}: language '{b.lang}'"
        assert b.marker == "" or b.marker == "long" or b.marker.startswith("skip "), (
            f"block at line {b.line}: unknown marker '{b.marker}'"
        )


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A working directory with the repository's entries linked in; what the blocks write stays here."""
    where = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "data"):
            (where / entry.name).symlink_to(entry)
    return where


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, scratch: Path):
    if block.marker.startswith("skip "):
        pytest.skip(f"README line {block.line}: {block.marker[5:]}")
    if block.marker == "long" and not LONG:
        pytest.skip(f"README line {block.line}: long (JAXSCALE_README_LONG=1 runs it)")
    if block.lang == "python":
        script = scratch / f"block_{block.index}.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        code = "\n".join(line for line in block.code.splitlines() if not INSTALL.match(line))
        command = ["bash", "-c", "set -euo pipefail\n" + code]
    done = subprocess.run(command, cwd=scratch, env=_environment(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    assert done.returncode == 0, f"README block at line {block.line} exited {done.returncode}:\n{tail}"


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass (``mesh.dcn`` counted as one)."""
    out = []
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        nested = [t for t in typing.get_args(typing.get_type_hints(cls)[field.name]) or
                  (typing.get_type_hints(cls)[field.name],) if dataclasses.is_dataclass(t)]
        if nested and key != "mesh.dcn":
            out += _keys(nested[0], key + ".")
        else:
            out.append(key)
    return out


def test_the_readme_shows_the_gpt2_example_as_written():
    """The README's model block is examples/gpt2.py itself (so running the block runs the example), under 60 lines."""
    example = (ROOT / "examples" / "gpt2.py").read_text()
    assert any(b.code == example for b in RUNNABLE), "README.md does not show examples/gpt2.py as written"
    assert len(example.splitlines()) < 60


def test_docs_config_names_every_key():
    text = (ROOT / "docs" / "config.md").read_text()
    sections = re.split(r"(?m)^#{2,3} ", text)
    missing = []
    for key in _keys(Config):
        prefix, _, leaf = key.rpartition(".")
        where = [s for s in sections if f"`{prefix}.*`" in s.split("\n", 1)[0]] if prefix else sections[1:2]
        if not any(f"`{leaf}`" in s or f"`{key}`" in s or f"`{key}.*`" in s for s in where):
            missing.append(key)
    assert not missing, "docs/config.md lacks: " + ", ".join(missing)
