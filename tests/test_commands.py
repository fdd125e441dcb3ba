"""jaxscale inspect and report: the compiled step read without running it, a run's pictures, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import TINY

from jaxscale.analysis.inspect import inspect_report
from jaxscale.cli import main
from jaxscale.config.read import CONFIG_DIR
from jaxscale.training.metrics import MetricsLogger
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.fixture
def no_data(monkeypatch):
    """Any use of the trainer's data loader fails the test: inspecting never reads tokens."""

    def touched(self):
        pytest.fail("the data loader was touched")

    for name in ("batches", "eval_batches"):
        monkeypatch.setattr(Trainer, name, property(touched))  # raises if Trainer no longer has the name


def test_inspect_reports_every_parameter_memory_and_collective(no_data, trainers, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    overrides = [f"--set={o}" for o in [*TINY, "rules=fsdp_tp_sp", *MESH]]
    config = str(CONFIG_DIR / "experiments" / "tiny.yaml")
    assert main(["inspect", "--config", config, *overrides, "--json", "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:4] == b"\x89PNG"
    trainer = trainers.get(rules="fsdp_tp_sp", mesh={"data": 2, "fsdp": 2, "tensor": 2})
    assert len(report["params"]) == len(jax.tree.leaves(trainer.abstract_params))
    wq = next(p for p in report["params"] if p["path"] == "blocks.attn.wq")
    assert wq["axes"] == ["layers", "embed", "heads", "head_dim"]
    assert wq["spec"] == "P(None, fsdp, tensor, None)"
    assert wq["bytes_per_device"] == 4 * 2 * 64 * 8 * 8 // 4
    assert sum(p["bytes_per_device"] for p in report["params"]) == report["state"]["params"]
    assert report["memory"]["total"] > report["memory"]["argument"] > 0
    kinds = {r["kind"] for r in report["collective_rows"]}
    assert {"all-gather", "reduce-scatter"} <= kinds  # SP's explicit collectives, FSDP's gathers
    assert sum(r["wire_bytes"] for r in report["collective_rows"]) == pytest.approx(
        report["collectives"]["total"]["wire_bytes"])
    assert report["analytic"]["memory"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)
    assert report["formulas"]["zero_stage"] == 3 and report["formulas"]["tp_comm_bytes"] > 0


def test_inspect_text_names_the_figures(no_data, capsys):
    assert main(["inspect", *(f"--set={o}" for o in [*TINY, "rules=zero3", "mesh.data=1", "mesh.fsdp=8",
                                                      "mesh.tensor=1", "model.attention=auto"])]) == 0
    text = capsys.readouterr().out
    # The silent selection taken (docs/compatibility.md): 32 tokens on CPU are under 4 tiles of 512, so dot.
    assert "selected: model.attention: auto -> dot (docs/compatibility.md)" in text.splitlines()[1]
    for heading in ("parameters", "memory (compiled", "analytic", "docs/formulas.md", "collectives of the compiled"):
        assert heading in text
    assert "P(None, fsdp, None, None)" in text


def test_inspect_llama3_8b_on_64_devices_without_materialising_it():
    """Llama-3-8B, FSDP x TP on 64 simulated devices: 75 GB per device compiled on a 24 GB machine."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the command asks for its 64 devices
    config = str(ROOT / "configs" / "experiments" / "llama3-8b.yaml")
    argv = ["inspect", "--config", config, "--set", "model.dtype=float32", "--json"]
    done = subprocess.run([sys.executable, "-m", "jaxscale", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["mesh"]["fsdp"] == 8 and report["mesh"]["tensor"] == 8
    assert report["memory"]["total"] > 40e9
    assert report["analytic"]["memory"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)
    compiled_wire = report["collectives"]["total"]["rs_wire_bytes"]
    assert report["analytic"]["comm"]["total"] == pytest.approx(compiled_wire, rel=0.05)


def test_inspect_bad_config_is_one_line(capsys):
    assert main(["inspect", "--set", "mesh.tensor=3", "--set", "mesh.fsdp=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxscale: error:") and "\n" not in err


@pytest.mark.parametrize("argv", [["inspect"], ["plan", "--model", "llama3-8b", "--cluster", "h100",
                                                "--global-batch-tokens", "1048576", "--seq-len", "8192"]])
def test_a_picture_without_matplotlib_is_one_line_before_anything_runs(argv, monkeypatch, capsys, tmp_path):
    """``--png`` needs the plot extra: without matplotlib, one line naming it, before the config is read."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, find_spec says None

    def loaded(*args, **kwargs):
        pytest.fail("the config was read")

    monkeypatch.setattr("jaxscale.commands.load_config", loaded)
    assert main([*argv, "--png", str(tmp_path / "memory.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxscale: error: pictures need matplotlib: pip install 'jaxscale[plot]' (from a checkout: '.[plot]')"


def write_run(run_dir: Path) -> None:
    records = [
        {"step": 0, "loss": 5.5, "tokens_per_sec": 1000.0, "memory_bytes": 2e6},
        {"step": 10, "loss": 3.1, "tokens_per_sec": 1500.0, "memory_bytes": 2e6},
        {"step": 10, "eval_loss": 3.3},  # records without a curve's key are skipped
        {"step": 20, "loss": 2.5, "tokens_per_sec": 1600.0, "memory_bytes": 2.1e6},
    ]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_plots_a_run_and_writes_tensorboard(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboardX")
    run = tmp_path / "run"
    write_run(run)
    assert main(["report", str(run), "--tensorboard"]) == 0
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").glob("events.out.tfevents.*"))
    assert b"loss" in events and b"tokens_per_sec" in events and b"eval_loss" in events
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_metrics_logger_writes_tensorboard_when_asked(tmp_path):
    pytest.importorskip("tensorboardX")
    logger = MetricsLogger(tmp_path, total_steps=2, enabled=True, bar=False, tensorboard=True)
    logger.log({"step": 0, "loss": 4.0, "mfu": 0.1})
    logger.close()
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert b"mfu" in events
    assert not (tmp_path / "other" / "tensorboard").exists()
    MetricsLogger(tmp_path / "other", total_steps=2, enabled=True, bar=False).close()
    assert not (tmp_path / "other" / "tensorboard").exists()


def test_inspect_report_is_json_and_measures_the_step(no_data, trainers):
    """The report's figures against what they measure: the executable's own memory analysis, and the
    state and collective bytes of ZeRO-2 on 8 devices worked out from the parameter count."""
    trainer, compiled = trainers.step(rules="zero2", mesh={"data": 8})
    report = inspect_report(trainer, compiled)
    assert json.loads(json.dumps(report)) == report
    analysis = compiled.memory_analysis()
    assert report["memory"]["argument"] == analysis.argument_size_in_bytes
    assert report["memory"]["temp"] == analysis.temp_size_in_bytes
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_params))  # fp32 parameters
    assert report["state"]["params"] == 4 * n  # whole on every device
    moments = 2 * 4 * n // 8  # Adam's two moments, an eighth per device
    assert moments <= report["state"]["opt_state"] <= moments + 64  # + the replicated step counters
    assert report["state"]["batch"] == 3 * 16 * 32 * 4 // 8  # inputs, targets, positions: int32 rows / 8
    # The updated parameters all-gathered over 8 devices: 7/8 of their bytes on the wire per device (XLA
    # may gather one int32 batch array besides); the gradients' reduction adds at most as much again.
    wire = 7 / 8 * 4 * n
    assert wire <= report["collectives"]["by_kind"]["all-gather"]["wire_bytes"] <= wire + 16 * 32 * 4
    assert wire < report["collectives"]["total"]["rs_wire_bytes"] <= 2 * wire
    assert report["formulas"]["zero_stage"] == 2
