"""Per-document balancing of the ring (``data.ring_balance``, jaxscale/parallel/ring_balance.py): the tile count
against a brute force written here, a row's documents rearranged without changing its loss or gradients, and the
largest device's tiles lowered on packed rows of short and of mixed documents."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, rel_err, tiny_config

from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.params import param_table
from jaxscale.analysis.plan import evaluate
from jaxscale.analysis.ring_imbalance import BUSIEST
from jaxscale.analysis.strategy import Strategy, experiment
from jaxscale.config.read import ConfigError
from jaxscale.parallel import ring_schedule
from jaxscale.parallel.ring_balance import arrangement, device_work, documents, executed_tiles
from jaxscale.training.trainer import Trainer


def packed(rng: np.random.Generator, rows: int, seq_len: int, mean: float, lead: int = 0) -> np.ndarray:
    """Positions of rows packed with documents of geometric lengths (``mean`` tokens), each row begun ``lead``
    tokens into a document."""
    out = []
    for _ in range(rows):
        lengths, total = [], lead
        while total < seq_len:
            lengths.append(int(rng.geometric(1 / mean)))
            total += lengths[-1]
        out.append(np.concatenate([np.arange(7, 7 + lead), *(np.arange(n) for n in lengths)])[:seq_len])
    return np.stack(out)


def brute_force(positions: np.ndarray, cp: int, block: int) -> np.ndarray:
    """Each device's computed tiles: a tile pair runs where it is not causally masked and, in some row, some
    query and some key share a document (the document ids: a new one where a position is 0)."""
    rows, seq_len = positions.shape
    doc = np.cumsum(positions == 0, axis=1)
    ids = ring_schedule.block_ids(cp, seq_len, block, True)
    work = np.zeros(cp, np.int64)
    for me in range(cp):
        for step in range(cp):
            for q in ids[me]:
                for k in ids[(me - step) % cp]:
                    if k > q:
                        continue
                    qd, kd = doc[:, q * block:(q + 1) * block], doc[:, k * block:(k + 1) * block]
                    work[me] += any(np.intersect1d(qd[r], kd[r]).size for r in range(rows))
    return work


@pytest.mark.parametrize("cp, rows, lead", [(2, 1, 0), (4, 1, 5), (4, 3, 0), (8, 2, 9)])
def test_the_tile_count_is_the_kernels_skip_rule(cp, rows, lead):
    positions = packed(np.random.default_rng(cp + rows), rows, 256, 20.0, lead)
    want = brute_force(positions, cp, 8)
    assert executed_tiles(positions, cp, 8).tolist() == want.tolist()
    if rows == 1:
        pieces = documents(positions[0])
        first = len(pieces[0]) if lead else 0
        assert device_work([len(p) for p in pieces[1 if lead else 0:]], first, cp, 8).tolist() == want.tolist()


def test_an_arrangement_moves_whole_documents_and_keeps_a_leading_piece_first():
    positions = packed(np.random.default_rng(0), 1, 512, 40.0, lead=11)[0]
    perm = arrangement(positions, 4, 16)
    assert sorted(perm.tolist()) == list(range(512))
    np.testing.assert_array_equal(perm[:11], np.arange(11))  # the piece begun before the row
    moved = positions[perm]
    assert sorted(map(len, documents(moved))) == sorted(map(len, documents(positions)))
    assert all((np.diff(perm[d]) == 1).all() for d in documents(moved))  # each document whole, in order


@pytest.mark.parametrize("mean", [300.0, 2000.0], ids=["short", "long"])
@pytest.mark.parametrize("cp", [4, 8])
def test_arranged_rows_lower_the_largest_devices_tiles(cp, mean):
    """Over 8 one-row batches of 16384 tokens (128-token tiles): the largest device's tiles over the mean fall
    for each row (never rise: a swap is kept only where it lowers the cost) and on average by at least 5%."""
    rng, before, after = np.random.default_rng(cp), [], []
    for _ in range(8):
        positions = packed(rng, 1, 16384, mean, lead=int(rng.integers(0, 40)))
        work = executed_tiles(positions, cp, 128)
        moved = executed_tiles(positions[:, arrangement(positions[0], cp, 128)], cp, 128)
        before.append(work.max() / work.mean())
        after.append(moved.max() / moved.mean())
        assert moved.max() <= work.max()
    assert np.mean(after) <= np.mean(before) - 0.05


@pytest.mark.slow
def test_a_balanced_ring_gives_the_loss_and_gradients_of_one_device(docs):
    data = ("data.source=tokens", f"data.path={docs}", "model.vocab_size=264", "data.documents=true",
            "model.attention_block=4")
    one = Trainer.build(tiny_config(*data), jax.devices()[:1])
    params = jax.device_get(one.init_state().params)
    ref_loss, ref_grads = one.loss_and_grads(params, one.batch(0))
    trainer = Trainer.build(tiny_config(*data, "model.attention=ring", "data.ring_balance=true", rules="cp",
                                        mesh={"fsdp": 2, "context": 4}))
    plain = Trainer.build(tiny_config(*data, "model.attention=ring", rules="cp", mesh={"fsdp": 2, "context": 4}))
    arranged = jax.device_get(trainer.batch(0))
    assert (arranged["inputs"] != jax.device_get(plain.batch(0))["inputs"]).any()  # some row was rearranged
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize("overrides, match", [
    ((), r"^data\.ring_balance: needs data\.documents=true"),
    (("data.documents=true", "model.attention=dot"),
     r"^data\.ring_balance: needs ring attention over 2 or more devices \(model\.attention=dot, a ring of 1"),
])
def test_ring_balance_without_documents_or_a_ring_is_refused_in_one_line(docs, overrides, match):
    with pytest.raises(ConfigError, match=match):
        Trainer.build(tiny_config("data.source=tokens", f"data.path={docs}", "model.vocab_size=264",
                                  "data.ring_balance=true", *overrides, rules="cp", mesh={"fsdp": 2, "context": 4}))


def test_the_planner_waits_for_the_rings_busiest_device_with_packed_documents():
    """``jaxscale plan --documents``: a ring's attention time grows by its busiest device's share of the tiles
    (benchmarks/ring_balance.py's figures; data.ring_balance planned, and written into the experiment), USP's
    by its ring's part, Ulysses' not at all; and the figures say balancing helps."""
    config = tiny_config("model.attention=blockwise")
    model, params, cluster = config.model, param_table(config), load_cluster("h100")
    cases = {(4, 1): BUSIEST["mixed", 4][1], (2, 2): BUSIEST["mixed", 2][1], (1, 4): 1.0}
    for (ring, u), stretch in cases.items():
        plain = Strategy(data=2, context=ring, ulysses=u)
        packed = replace(plain, documents="mixed")
        times = [evaluate(model, params, s, 1024, cluster).time["attention"] for s in (plain, packed)]
        assert times[1] == pytest.approx(stretch * times[0], rel=1e-9), (ring, u)
        assert experiment(packed, {}, 1024, "r.yaml")["data"] == {"documents": True, "ring_balance": ring > 1}
    assert all(after < before for before, after in BUSIEST.values())
