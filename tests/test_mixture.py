"""Weighted mixtures: each source's share, the rows each gives, bit-exact resume, changed weights, the metrics,
bad input."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiny_config

from jaxscale.config.interleave import Interleave
from jaxscale.config.read import ConfigError
from jaxscale.data.batches import make_loader
from jaxscale.data.prepare import prepare_data
from jaxscale.training import report
from jaxscale.training.loop import fit
from jaxscale.training.report import read_records
from jaxscale.training.trainer import Trainer

WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three token directories of different standard-library files (bytes), a fifth of each held out."""
    root = tmp_path_factory.mktemp("mixture")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = {}
    for k, name in enumerate(WEIGHTS):
        out[name] = root / name
        prepare_data(files[10 * k : 10 * k + 10], out[name], val_fraction=0.2)
    return out


def mixture(sources: dict[str, Path], weights: dict[str, float] = WEIGHTS) -> str:
    return "data.mixture=[" + ", ".join(f"{{path: '{sources[n]}', weight: {w}}}" for n, w in weights.items()) + "]"


def config(sources, *overrides: str, weights: dict[str, float] = WEIGHTS):
    return tiny_config("data.source=tokens", mixture(sources, weights), "model.vocab_size=264", *overrides,
                       mesh={"data": 8})


def test_three_sources_give_their_weights_and_their_own_rows(sources):
    loader = make_loader(config(sources))
    ids = np.concatenate([loader.sources(step) for step in range(200)])  # 200 steps of 16 rows
    counts = np.bincount(ids, minlength=3)
    # 3200 rows: the exact shares 5/10, 3/10, 2/10 give exactly 1600/960/640.
    assert counts.tolist() == [1600, 960, 640]
    # Row g is its source's next sequence: the k-th row from source i is that source's k-th shuffled sequence.
    seen = dict.fromkeys(range(3), 0)
    parts = list(loader.parts.values())
    for step in range(3):
        windows = loader.windows(step, range(16))
        for row, i in enumerate(loader.sources(step)):
            np.testing.assert_array_equal(windows[row], parts[i].dataset[seen[i]])
            seen[i] += 1
    assert make_loader(config(sources)).rows(5)["inputs"].tobytes() == loader.rows(5)["inputs"].tobytes()


def test_shares_are_within_one_row_of_the_weights_at_every_prefix(sources):
    """0.6/0.25/0.15 (whose integer scaling to 400/166/100 gave 0.25 24.92%: 6007/2492/1501 of 10,000 rows):
    after every n rows of 10,000, each source's count is within one row of n·w (strictly: |count - n·w| < 1)."""
    weights = {"a": 0.6, "b": 0.25, "c": 0.15}
    loader = make_loader(config(sources, weights=weights))
    ids = np.concatenate([loader.sources(step) for step in range(625)])  # 625 steps of 16 rows
    n = np.arange(1, len(ids) + 1)[:, None]
    counts = np.cumsum(ids[:, None] == np.arange(3), axis=0)
    assert np.abs(counts - n * np.array([0.6, 0.25, 0.15])).max() < 1
    assert counts[-1].tolist() == [6000, 2500, 1500]
    # Each source's rows are its own sequences in order, wherever the batch starts (a resumed step's).
    parts = list(loader.parts.values())
    windows = loader.windows(401, range(16))
    for row, i in enumerate(ids[401 * 16 : 402 * 16]):
        np.testing.assert_array_equal(windows[row], parts[i].dataset[int(counts[401 * 16 + row - 1, i])])


def test_any_weights_keep_every_source_within_one_row_at_every_prefix():
    """The bound for 200 random weightings of 2 to 7 sources (integers, or decimals of two digits), over two
    periods (the interleave repeats after one: a function of the row alone), and each source's rows in order."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        m = int(rng.integers(2, 8))
        drawn = rng.integers(1, 60, m) if trial % 2 else np.round(rng.uniform(0.01, 1, m), 2)
        weights = [float(w) for w in drawn]
        mix = Interleave(weights)
        rows = np.arange(2 * mix.period)
        ids, index = mix.rows(rows)
        counts = np.cumsum(ids[:, None] == np.arange(m), axis=0)
        exact = (rows + 1)[:, None] * np.array(weights) / sum(weights)
        assert np.abs(counts - exact).max() < 1, weights
        for i in range(m):
            assert index[ids == i].tolist() == list(range(int(counts[-1, i]))), weights


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory):
    """Four steps straight; the same split in two by a resume (checkpoints every 2 steps, evaluation at 2 and 4)."""
    overrides = ["train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_steps=1",
                 "checkpoint.every=2"]
    trainer = Trainer.build(config(sources, *overrides))
    straight_dir, resumed_dir = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    trainer.config.run_dir = str(straight_dir)
    straight, straight_log = fit(trainer, progress=False)
    trainer.config.run_dir, trainer.config.checkpoint.resume = str(resumed_dir), "auto"
    _, first = fit(trainer, progress=False, stop_at=2)
    resumed, second = fit(trainer, progress=False)
    return trainer, jax.device_get(straight), straight_log, jax.device_get(resumed), first + second, resumed_dir


def test_a_resumed_mixture_equals_the_straight_run_bit_for_bit(runs):
    _, straight, straight_log, resumed, resumed_log, run_dir = runs
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = [{r["step"]: r["loss"] for r in log if "loss" in r} for log in (straight_log, resumed_log)]
    assert losses[0] == losses[1] and sorted(losses[0]) == [0, 1, 2, 3]
    records = read_records(run_dir / "metrics.jsonl")
    shares = [r for r in records if "loss" in r]
    assert all(abs(sum(r[f"share/{n}"] for n in WEIGHTS) - 1) < 1e-9 for r in shares)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert all(2.0 < r[f"eval_loss/{n}"] < np.log(264) + 0.5 for n in WEIGHTS)


def test_report_plots_the_eval_losses_and_each_sources_loss_and_share(runs):
    plt = pytest.importorskip("matplotlib.pyplot")
    run_dir = runs[5]
    records = read_records(run_dir / "metrics.jsonl")
    fig = report.run_figure(run_dir)
    try:
        panels = {ax.get_ylabel(): {line.get_label(): line for line in ax.get_lines()} for ax in fig.axes}
    finally:
        plt.close(fig)
    losses = ["loss", "eval_loss", *(f"eval_loss/{n}" for n in WEIGHTS)]
    assert sorted(panels["loss"]) == sorted(losses)
    assert sorted(panels["mixture share"]) == sorted(f"share/{n}" for n in WEIGHTS)
    for key, line in {**panels["loss"], **panels["mixture share"]}.items():
        want = [(r["step"], r[key]) for r in records if key in r]
        assert want and list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == want, key
    assert report.run_png(run_dir).stat().st_size > 0


def test_weights_changed_on_resume_go_on_with_the_new_weights(runs, sources):
    trainer = runs[0]
    trainer.config.train.steps, trainer.config.train.schedule_steps = 6, 4
    trainer.config.data.mixture = config(sources, weights={"a": 0.2, "b": 0.3, "c": 0.5}).data.mixture
    trainer.__dict__.pop("batches")  # the loader is built anew from the changed config; the step stays compiled
    _, log = fit(trainer, progress=False)
    assert sorted(r["step"] for r in log if "loss" in r) == [4, 5]
    assert trainer.batches.state(6)["weights"] == {"a": 0.2, "b": 0.3, "c": 0.5}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"a": 0.5, "b": 0.0, "c": 0.2}, r"^data\.mixture\[1\]\.weight must be positive, got 0\.0$"),
        ({"a": 0.5, "b": -1, "c": 0.2}, r"^data\.mixture\[1\]\.weight must be positive, got -1\.0$"),
    ],
)
def test_bad_weights_are_one_line(sources, change, match):
    with pytest.raises(ConfigError, match=match):
        config(sources, weights=change)


def test_bad_mixtures_are_one_line(sources, tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.mixture: the weights' exact ratio repeats every 2000000001 rows, "
                       r"over 131072: write them with fewer digits$"):
        config(sources, weights={"a": 1, "b": 1e-9, "c": 1})
    with pytest.raises(ConfigError, match=r"^data\.mixture: needs data\.source=tokens and no data\.path"):
        config(sources, f"data.path={sources['a']}")
    with pytest.raises(ConfigError, match=r"^data\.mixture: the name 'a' is given twice"):
        tiny_config("data.source=tokens", f"data.mixture=[{{path: '{sources['a']}'}}, {{path: '{sources['a']}'}}]")
    missing = {**sources, "b": tmp_path / "nowhere"}
    with pytest.raises(ConfigError, match=r"^data\.mixture\[1\]\.path: .*nowhere does not exist$"):
        Trainer.build(config(missing))
