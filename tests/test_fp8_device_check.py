"""benchmarks/fp8_device_check.py at CPU size: it runs, and its counts say what the lowered programs hold."""

import importlib.util

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_device_check_runs_small():
    spec = importlib.util.spec_from_file_location("fp8_device_check", ROOT / "benchmarks" / "fp8_device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--small", "--iters", "1"])
    rows = {row["mode"]: row for row in report["projection"]}
    assert set(rows) == {"off", "delayed", "current", "blockwise"}
    # bf16: three bf16 dots; every fp8 mode: the forward, input-gradient and weight-gradient dots on float8.
    assert (rows["off"]["dots"], rows["off"]["f8_dots"]) == (3, 0)
    assert all((rows[m]["dots"], rows[m]["f8_dots"]) == (3, 3) for m in ("delayed", "current", "blockwise"))
    assert all(row["conditionals"] == 0 and row["cublas_f8"] == 0 and row["time_s"] > 0 for row in rows.values())
    steps = {row["mode"]: row for row in report["step"]}
    # The 2-layer tiny model under model.remat=full (as the check runs): 7 projections x 3 dots in the one lowered
    # layer body, the 9 others (attention, head), and the forward dots the recompute repeats: every projection but
    # the o-projection (its output is not needed by the backward) and attention's 2, 6 of them on float8.
    assert (steps["off"]["dots"], steps["off"]["f8_dots"]) == (7 * 3 + 9 + 6 + 2, 0)
    assert (steps["current"]["dots"], steps["current"]["f8_dots"]) == (7 * 3 + 9 + 6 + 2, 7 * 3 + 6)
    assert all(row["conditionals"] == 0 and row["step_time_s"] > 0 for row in steps.values())
