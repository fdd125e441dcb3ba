"""jaxscale bench on 8 simulated CPU devices: the JSON report's schema and figures (quick suite, a
2- and 4-layer compile suite), option variants that this build lacks or refuses, failed runs."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import jax
import numpy as np
import pytest
from helpers import TINY

from jaxscale.analysis import bench, bench_suites, bench_table
from jaxscale.cli import main
from jaxscale.config import flops
from jaxscale.config.read import ConfigError, load_config
from jaxscale.training.trainer import Trainer

NUM = (int, float)
OPT_NUM = (int, float, type(None))
TOP = {"schema": str, "created": str, "backend": str, "device_kind": str, "devices": int, "jax_version": str,
       "config": (str, type(None)), "cluster": (str, type(None)), "results": list}
MODEL = {"layers": int, "embed": int, "heads": int, "kv_heads": int, "head_dim": int, "mlp": int,
         "vocab_size": int, "dtype": str, "remat": str, "attention": str}
MEMORY = {"argument": int, "output": int, "alias": int, "temp": int, "generated_code": int, "total": int,
          "device_peak_bytes": (int, type(None))}
MESH = dict.fromkeys(("data", "stage", "fsdp", "context", "ulysses", "expert", "tensor"), int)
RESULT = {
    "suite": str, "name": str, "model": (dict, type(None)), "params": (int, type(None)), "overrides": list,
    "mesh": (dict, type(None)), "rules": (str, type(None)), "global_batch": (int, type(None)),
    "seq_len": (int, type(None)), "steps": int, "rounds": int, "lower_time_s": OPT_NUM, "compile_time_s": OPT_NUM,
    "lower_cpu_time_s": OPT_NUM, "compile_cpu_time_s": OPT_NUM,
    "step_time_s": OPT_NUM, "step_time_blocked_s": OPT_NUM, "device_step_time_s": OPT_NUM,
    "dispatch_time_s": OPT_NUM, "tokens_per_s": OPT_NUM, "tflops_per_device": OPT_NUM, "mfu": OPT_NUM,
    "host_overhead_s": OPT_NUM, "host_overhead_blocked_s": OPT_NUM, "loss": OPT_NUM,
    "memory": (dict, type(None)), "status": str, "error": (str, type(None)),
}
PREDICTED = {"predicted_step_time_s": NUM, "predicted_mfu": NUM, "predicted_ratio": NUM, "predicted": dict}
RUN_FIGURES = ("step_time_s", "step_time_blocked_s", "device_step_time_s", "dispatch_time_s", "tokens_per_s",
               "tflops_per_device", "mfu", "host_overhead_s", "host_overhead_blocked_s", "loss")


def check(obj: dict, schema: dict, where: str) -> None:
    """Exactly the schema's keys, each of its types (a bool is not a number)."""
    assert set(obj) == set(schema), f"{where}: keys {sorted(set(obj) ^ set(schema))}"
    for key, types in schema.items():
        value = obj[key]
        assert isinstance(value, types) and not isinstance(value, bool), f"{where}.{key}: {value!r}"


def check_report(report: dict) -> None:
    check(report, TOP, "report")
    assert report["schema"] == "jaxscale.analysis.bench/1"
    for i, row in enumerate(report["results"]):
        where = f"results[{i}]"
        predicted = report["cluster"] is not None and row["status"] == "ok" and row["steps"] > 0
        check(row, RESULT | PREDICTED if predicted else RESULT, where)
        assert row["status"] in ("ok", "skipped", "error")
        assert all(isinstance(o, str) for o in row["overrides"])
        if row["status"] != "ok":
            assert row["error"]
            continue
        assert row["error"] is None
        check(row["model"], MODEL, f"{where}.model")
        check(row["mesh"], MESH, f"{where}.mesh")
        check(row["memory"], MEMORY, f"{where}.memory")
        assert row["memory"]["total"] > 0
        assert min(row[f"{p}_{c}"] for p in ("lower", "compile") for c in ("time_s", "cpu_time_s")) > 0


def sets(overrides: list[str]) -> list[str]:
    return [f"--set={o}" for o in overrides]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``jaxscale bench --suite quick`` on the test model, with the plan's prediction on the H100 cluster file: the
    report and what the command printed."""
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--suite", "quick", "--steps", "2", "--warmup", "1", "--rounds", "2", "--out", str(out),
                     "--predict", "h100", *sets(TINY)])
    assert code == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_quick_suite_report_schema_and_figures(quick):
    report, printed = quick
    check_report(report)
    assert report["backend"] == "cpu" and report["devices"] == 8
    (row,) = report["results"]
    assert row["suite"] == "quick" and row["status"] == "ok" and (row["steps"], row["rounds"]) == (2, 2)
    assert row["overrides"] == TINY and row["rules"] == "fsdp_tp" and row["mesh"]["fsdp"] == 8
    config = load_config(bench.BASE_CONFIG, TINY)
    abstract = Trainer.build(config).abstract_params
    assert row["params"] == sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    assert (row["global_batch"], row["seq_len"], row["model"]["layers"]) == (16, 32, 2)
    step = row["step_time_s"]
    assert all(row[k] >= 0 for k in RUN_FIGURES if k != "host_overhead_blocked_s")  # that one is signed
    assert step > 0 and row["device_step_time_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(16 * 32 / step)
    model_flops = flops.flops_per_token(config.model, 32) * 16 * 32
    assert row["tflops_per_device"] == pytest.approx(model_flops / step / 8 / 1e12)
    assert row["mfu"] == pytest.approx(model_flops / step / (8 * flops.PEAK_FLOPS["cpu"]))
    assert row["host_overhead_s"] == pytest.approx(max(0.0, step - row["device_step_time_s"]))
    assert row["host_overhead_blocked_s"] == pytest.approx(row["step_time_blocked_s"] - row["device_step_time_s"])
    assert 0 < row["loss"] < np.log(256) + 0.5  # 15 updates: 1 + the loop's untimed 2 + 2 rounds of 3 x 2
    assert row["memory"]["total"] >= row["memory"]["argument"] > 0
    assert "tiny" in printed and "meaningless" in printed and "wrote" in printed


def test_quick_suite_carries_the_plans_prediction(quick):
    """``--predict``: the analytic model's step time for the same trainer on the cluster file, next to the measured."""
    from jaxscale.analysis.cluster import load_cluster
    from jaxscale.analysis.predict import predict_trainer

    report, printed = quick
    (row,) = report["results"]
    expected = predict_trainer(Trainer.build(load_config(bench.BASE_CONFIG, TINY)), load_cluster("h100")).time
    assert row["predicted_step_time_s"] == pytest.approx(expected["total"])
    assert row["predicted_mfu"] == pytest.approx(expected["mfu"])
    assert row["predicted_ratio"] == pytest.approx(expected["total"] / row["step_time_s"])
    assert set(row["predicted"]) == set(bench.PARTS) and sum(row["predicted"].values()) <= expected["total"] * 1.001
    assert "pred/meas" in printed


def test_predict_needs_a_readable_cluster_file(tmp_path, capsys):
    """A cluster file that is not there: one line and exit code 2, before anything compiles."""
    assert main(["bench", "--suite", "quick", "--predict", str(tmp_path / "missing.yaml"), *sets(TINY)]) == 2
    assert "no cluster named" in capsys.readouterr().err


def test_compile_suite_by_depth():
    report = bench.run_suite("compile", overrides=TINY, layers=[2, 4])
    check_report(report)
    rows = report["results"]
    assert [r["name"] for r in rows] == ["layers=2", "layers=4"]
    assert all(r["status"] == "ok" and r["steps"] == 0 for r in rows)
    assert all(r[k] is None for r in rows for k in RUN_FIGURES)
    assert [r["model"]["layers"] for r in rows] == [2, 4] and rows[1]["params"] > rows[0]["params"]
    ratio = bench_table.compile_ratio(report)
    assert ratio["layers"] == (2, 4)
    assert ratio["compile_cpu"] == pytest.approx(rows[1]["compile_cpu_time_s"] / rows[0]["compile_cpu_time_s"])
    assert min(ratio[f"{p}_{c}"] for p in ("compile", "total") for c in ("wall", "cpu")) > 0
    assert "compile time, 4 vs 2 layers: XLA compile" in bench_table.table(report)


def test_options_suite_skips_what_this_build_lacks(tmp_path):
    """Variants as data: a key this build lacks or a value it refuses is a skipped row naming the key,
    before anything compiles; the rest of the suite runs."""
    suites = tmp_path / "suites.yaml"
    suites.write_text(
        "options:\n  steps: 1\n  warmup: 0\n  rounds: 1\n  variants:\n    baseline: []\n    missing: [nosuch.key=1]\n"
        "    refused: [model.attention=nosuch]\n"
    )
    report = bench.run_suite("options", overrides=[*TINY, "mesh.fsdp=1"], suites=suites)
    check_report(report)
    rows = {r["name"]: r for r in report["results"]}
    assert [r["status"] for r in rows.values()] == ["ok", "skipped", "skipped"]
    assert rows["baseline"]["mesh"]["fsdp"] == 1 and (rows["baseline"]["steps"], rows["baseline"]["rounds"]) == (1, 1)
    assert "unknown config key 'nosuch'" in rows["missing"]["error"]
    assert rows["refused"]["overrides"][-1] == "model.attention=nosuch"
    assert "model.attention" in rows["refused"]["error"] and rows["refused"]["params"] is None
    assert "skipped  unknown config key 'nosuch'" in bench_table.table(report)


@pytest.mark.slow  # jaxscale's own logic, the same on every JAX: the whole suite (Python 3.11) runs it
def test_a_row_with_other_xla_flags_runs_in_a_child_process_started_with_them(tmp_path, recwarn):
    # In this process jax started without the preset's flags: measured here, the row would warn that
    # they are not in XLA_FLAGS. A child process started with them measures it instead.
    suites = tmp_path / "suites.yaml"
    suites.write_text("options:\n  steps: 1\n  warmup: 0\n  rounds: 1\n  variants:\n    preset: [xla.preset=gpu]\n")
    report = bench.run_suite("options", overrides=[*TINY, "mesh.fsdp=1"], suites=suites)
    (row,) = report["results"]
    assert row["status"] == "ok", row["error"]
    assert row["overrides"][-1] == "xla.preset=gpu" and row["step_time_s"] > 0 and row["mesh"]["fsdp"] == 1
    assert not [w for w in recwarn if "XLA_FLAGS" in str(w.message)]


def test_a_failing_run_is_an_error_row(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nallocation details")

    monkeypatch.setattr(bench, "measure", out_of_memory)
    row = bench.run_one("quick", bench_suites.Run("tiny", TINY), bench.BASE_CONFIG, steps=1, warmup=0)
    assert row["status"] == "error" and row["error"] == "RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert row["params"] > 0 and row["step_time_s"] is None


def test_suites_table_order_of_overrides():
    table = bench_suites.load_suites()
    assert set(bench_suites.SUITES) <= set(table)
    assert {"fp8", "tp_overlap", "xla_preset", "loss_chunk", "attention_blockwise"} <= set(table["options"]["variants"])
    assert set(table["full"]["runs"]) == {"tiny", "llama-150m", "llama-1b"}
    user = ["train.seq_len=64"]
    full = bench_suites.plan("full", user, table, models=["llama-1b"])
    assert [r.name for r in full] == ["llama-1b"] and full[0].overrides[0] == "model=llama-1b"
    assert full[0].overrides[-1] == "train.seq_len=64"  # the command line tunes the workload
    fp8 = bench_suites.plan("options", ["precision.fp8=none"], table, variants=["fp8"])
    assert fp8[0].overrides == ["precision.fp8=none", "precision.fp8=delayed"]  # the variant wins
    depth = bench_suites.plan("compile", user, table)
    assert [r.name for r in depth] == ["layers=2", "layers=8", "layers=32"] and all(r.compile_only for r in depth)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "nosuch"], "--suite nosuch: no such suite"),
    (["--suite", "full", "--models", "tiny,llama-9b"], "--models llama-9b: not in the suite"),
    (["--suite", "compile", "--models", "tiny"], "--models: suite 'compile' has no model runs"),
    (["--suite", "compile", "--layers", "2,x"], "--layers 2,x: expected positive integers"),
    (["--suite", "quick", "--steps", "0"], "--steps and --rounds must be at least 1"),
    (["--suite", "quick", "--rounds", "0"], "--steps and --rounds must be at least 1"),
    (["--set", "model.layers=0"], "model.layers must be positive"),
])
def test_bad_input_is_one_line(argv, message, capsys, tmp_path):
    assert main(["bench", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text, message", [
    ("quick: [a]\n", "suite 'quick' is not a mapping"),
    ("quick:\n  runs:\n    tiny: model=tiny\n", "quick.runs.tiny is not a list of KEY=VALUE strings"),
    ("quick:\n  steps: many\n  runs: {tiny: []}\n", "quick.steps is not an integer"),
    ("compile:\n  layers: [2, 0]\n", "compile.layers is not a list of positive integers"),
    ("compile:\n  layers: 4\n", "compile.layers is not a list of positive integers"),
])
def test_malformed_suites_table(text, message, tmp_path):
    path = tmp_path / "suites.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        bench_suites.load_suites(path)


def test_rows_are_printed_as_they_finish(monkeypatch, capsys, tmp_path):
    """Each row's line is on stdout (flushed) before the next run starts; the header before the first."""
    started = []

    def fake_run(suite, run, *args):
        started.append((run.name, capsys.readouterr().out))
        return {"name": run.name, "status": "skipped", "error": f"{run.name} done", "steps": 0}

    monkeypatch.setattr(bench, "run_one", fake_run)
    assert main(["bench", "--suite", "full", "--out", str(tmp_path / "x.json"), *sets(TINY)]) == 0
    assert [name for name, _ in started] == ["tiny", "llama-150m", "llama-1b"]
    assert started[0][1].startswith("jaxscale bench: 8 x cpu (cpu)") and "done" not in started[0][1]
    assert started[1][1] == f"{'tiny':<22} skipped  tiny done\n"
    assert started[2][1] == f"{'llama-150m':<22} skipped  llama-150m done\n"
    assert capsys.readouterr().out.startswith(f"{'llama-1b':<22} skipped  llama-1b done\n")


def test_a_suite_larger_than_the_machine_is_refused_before_anything_runs(monkeypatch, capsys, tmp_path):
    """The issue's case: ``--suite full --models tiny,llama-150m`` on the 24 GiB machine where the kernel killed
    it at 21 GB (its MemAvailable: 21.3 GB). The analytic model puts llama-150m (seq 1024, batch 8, FSDP over
    8 simulated CPU devices, activations in float32 as XLA:CPU computes them) at 2.69 GB per device, 21.5 GB
    in all, over the 0.8 of the host's memory a CPU step may use: one line, exit 2, before any row runs or prints."""
    monkeypatch.setattr(bench, "available_memory", lambda device: (21_300_000_000, True))
    monkeypatch.setattr(bench, "run_one", lambda *args: pytest.fail("a run started"))
    out = tmp_path / "x.json"
    assert main(["bench", "--suite", "full", "--models", "tiny,llama-150m", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1
    need = re.fullmatch(r"jaxscale: error: bench: run 'llama-150m' needs ([\d.]+) GB \(([\d.]+) GB x 8 CPU devices, "
                        r"the analytic model's prediction\) but a step may use 17\.0 GB \(0\.8 of the 21\.3 GB "
                        r"available\): leave it out \(--models, "
                        r"--variants\) or shrink it \(--set\)\n", printed.err)
    assert need and float(need[1]) == pytest.approx(8 * float(need[2]), abs=0.1) and float(need[1]) > 21.3
    assert not out.exists()
    monkeypatch.setattr(bench, "available_memory", lambda device: (None, False))  # an accelerator without statistics
    bench.check_memory(bench_suites.plan("full", [], bench_suites.load_suites(), ["llama-150m"]), bench.BASE_CONFIG)
