"""``jaxscale inspect --target``'s bad input: one line before jax starts, whether or not a compiler is installed."""

import subprocess
import sys

import pytest
from compile_target import GPU_MISSING


def _inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxscale", "inspect", *args], capture_output=True, text=True,
                          timeout=120)


def test_an_unknown_target_is_one_line_naming_the_targets():
    done = _inspect("--target", "h900")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jaxscale: error: unknown compile target 'h900': one of a100, h100, h100-pcie, h200, b200, b300, gb200, a "
        "device name XLA embeds (e.g. 'NVIDIA H100 80GB HBM3'), a GpuTargetConfigProto file (.txtpb), or a TPU "
        "topology of v4, v5e, v5p, v6e (e.g. v5e:2x4, v5p:2x2x2)"]


@pytest.mark.skipif(GPU_MISSING is None, reason="the CUDA plugin is installed here")
def test_a_gpu_target_without_the_plugin_names_the_extra():
    done = _inspect("--target", "h100")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jaxscale: error: compiling for GPU needs its compiler: pip install 'jaxscale[gpu-compile]' "
        "(Python 3.12, jax 0.12)"]


def test_a_missing_spec_file_is_one_line(tmp_path):
    done = _inspect("--target-spec", str(tmp_path / "nope.txtpb"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxscale: error: ")
