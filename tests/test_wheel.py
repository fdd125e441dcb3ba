"""A built wheel works without the source checkout: configs and corpus installed with the package.

The wheel is built from a copy of the packaged files, installed into a fresh virtual environment
whose only other packages are this interpreter's site-packages (listed in a ``.pth`` file, so jax is
not downloaded and an editable jaxscale there is not imported), and run from a directory outside
the repository with no ``PYTHONPATH``: ``jaxscale train`` a few steps, ``jaxscale plan --cluster
h100``, and the README's Python block.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ("pyproject.toml", "setup.py", "README.md", "jaxscale", "configs")
TIMEOUT_S = 600


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """``cmd``'s stdout and stderr; it must succeed."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv's bin directory, a working directory outside the repository, its environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp / "dist"),
         str(source)], tmp, env)
    (wheel,) = (tmp / "dist").glob("jaxscale-*.whl")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    (purelib / "parent.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], tmp, env)
    away = tmp / "away"
    away.mkdir()
    code = "import jaxscale.config.read as c; print(c.__file__); print(c.CONFIG_DIR)"
    found = run([str(python), "-c", code], away, env)
    installed = purelib / "jaxscale"
    assert found.split()[-2:] == [str(installed / "config" / "read.py"), str(installed / "configs")]
    return venv / "bin", away, env


@pytest.mark.slow
def test_the_installed_wheel_trains_and_plans_outside_the_repository(installed):
    bin_dir, away, env = installed
    out = run([str(bin_dir / "jaxscale"), "train", "--no-progress", "--set", "train.steps=2",
               "--set", f"run_dir={away / 'run'}"], away, env)
    assert re.search(r"step 0 loss 5\.58\d+ -> step 1 loss", out), out
    out = run([str(bin_dir / "jaxscale"), "plan", "--model", "llama3-8b", "--cluster", "h100",
               "--global-batch-tokens", "1048576", "--seq-len", "8192", "--attention", "cudnn"], away, env)
    assert "ZeRO-3" in out


@pytest.mark.slow
def test_the_readmes_python_block_runs_from_the_installed_wheel(installed):
    bin_dir, away, env = installed
    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[:1]
    out = run([str(bin_dir / "python"), "-c", code], away, env)
    assert out.splitlines()[0].startswith("0 5.5")  # step 0's loss on the builtin corpus
