"""Packed documents (``data.documents``): positions restart at each document, the prediction across a boundary is
not trained, and attention does not cross documents: a packed batch equals its documents one at a time."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, rel_err, tiny_config

from jaxscale.config.read import ConfigError, MeshConfig
from jaxscale.data.batches import IGNORE, make_loader
from jaxscale.data.packing import PackedBins, first_fit
from jaxscale.data.prepare import TokenDir, prepare_data
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models.attention import document_ids, resolve_attention
from jaxscale.parallel import ring_attention, ring_schedule
from jaxscale.training.trainer import Trainer


def config(docs: Path, *overrides: str, **layout):
    return tiny_config("data.source=tokens", f"data.path={docs}", "model.vocab_size=264", *overrides, **layout)


def test_positions_restart_and_boundaries_are_not_trained(docs):
    packed = make_loader(config(docs, "data.documents=true")).rows(3)
    plain = make_loader(config(docs)).rows(3)
    np.testing.assert_array_equal(packed["inputs"], plain["inputs"])  # the same stream, cut the same way
    tokens, starts = np.asarray(TokenDir.open(docs).tokens("train")), TokenDir.open(docs).documents("train")
    eod = 256
    for inputs, targets, positions in zip(packed["inputs"], packed["targets"], packed["positions"], strict=True):
        # A position is 0 right after an end-of-document token, else one more than the one before.
        after_eod = np.concatenate([[positions[0] == 0], inputs[:-1] == eod])
        np.testing.assert_array_equal(positions[1:] == 0, after_eod[1:])
        assert np.all(np.diff(positions)[~after_eod[1:]] == 1)
        # The target of an end-of-document token (the next document's first) is not trained; the rest are.
        np.testing.assert_array_equal(targets == IGNORE, inputs == eod)
    assert plain["positions"][0].tolist() == list(range(32)) and (plain["targets"] >= 0).all()
    both = make_loader(config(docs, "data.documents=true", "data.boundary_targets=true")).rows(3)
    np.testing.assert_array_equal(both["targets"], plain["targets"])  # the boundary trained too
    np.testing.assert_array_equal(both["positions"], packed["positions"])
    assert len(starts) > 300 and tokens[starts[1] - 1] == eod


def alone(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each document (piece) of each packed row alone at the start of its own row, at its own positions,
    padded after it with untrained targets."""
    rows = {k: [] for k in batch}
    length = batch["inputs"].shape[1]
    for r, ids in enumerate(np.asarray(document_ids(jnp.asarray(batch["positions"])))):
        for d in np.unique(ids):
            where = np.nonzero(ids == d)[0]
            pad = length - len(where)
            rows["inputs"].append(np.pad(batch["inputs"][r, where], (0, pad)))
            rows["targets"].append(np.pad(batch["targets"][r, where], (0, pad), constant_values=IGNORE))
            last = batch["positions"][r, where[-1]]
            rows["positions"].append(np.concatenate([batch["positions"][r, where], last + 1 + np.arange(pad)]))
    return {k: np.stack(v).astype(np.int32) for k, v in rows.items()}


def logits_of(trainer: Trainer, params, batch) -> np.ndarray:
    def forward(p, b):
        with trainer.scope():
            return nnx.merge(trainer.graphdef, p)(b["inputs"], b["positions"])

    return np.asarray(jax.jit(forward)(params, {k: jnp.asarray(v) for k, v in batch.items()}))


@pytest.fixture(scope="module")
def reference(docs):
    """One device: a packed batch, the same documents one at a time (plain causal attention), their logits,
    the initial parameters and the loss and gradients of the documents alone."""
    packed_trainer = Trainer.build(config(docs, "data.documents=true"), jax.devices()[:1])
    params = jax.device_get(packed_trainer.init_state().params)
    batch = jax.device_get(packed_trainer.batch(0))
    single = alone(batch)
    plain = Trainer.build(config(docs), jax.devices()[:1])
    loss, grads = plain.loss_and_grads(params, single)
    return packed_trainer, params, batch, single, logits_of(plain, params, single), float(loss), grads, plain


def test_packed_logits_equal_the_documents_one_at_a_time(reference):
    trainer, params, batch, single, single_logits, *_ = reference
    assert len(single["inputs"]) > 2 * len(batch["inputs"])  # several documents per row
    packed = logits_of(trainer, params, batch)
    # Scatter the single rows' logits back to their packed places.
    back, k = np.zeros_like(packed), 0
    for r, ids in enumerate(np.asarray(document_ids(jnp.asarray(batch["positions"])))):
        for d in np.unique(ids):
            where = np.nonzero(ids == d)[0]
            back[r, where] = single_logits[k, : len(where)]
            k += 1
    assert rel_err(packed, back) <= 1e-5
    # Without the mask the packed rows differ: the test sees attention across documents.
    plain = Trainer.build(config(trainer.config.data.path), jax.devices()[:1])
    assert rel_err(logits_of(plain, params, batch), back) > 1e-2


RING = ("model.attention=ring", "model.attention_block=4")  # 4-token tiles: several per zig-zag chunk
PIPE = ("pipeline.microbatches=4", "pipeline.schedule=1f1b")
LAYOUTS = {
    "dot": ({}, {"rules": "dp", "mesh": {"data": 8}}),
    "tp_sp": ({}, {"rules": "tp_sp", "mesh": {"data": 2, "tensor": 4}}),
    "pp_1f1b": (PIPE, {"rules": "pp", "mesh": {"stage": 2, "data": 4}}),
    "blockwise": (("model.attention=blockwise", "model.attention_block=8"), {"rules": "dp", "mesh": {"data": 8}}),
    "ring_cp4": (RING, {"rules": "cp", "mesh": {"fsdp": 2, "context": 4}}),
    "blockwise_tp_sp": (("model.attention=blockwise", "model.attention_block=8"),
                        {"rules": "tp_sp", "mesh": {"data": 2, "tensor": 4}}),
    # ring with a context of 2 (and tensor 2) in 1F1B stages
    "ring_cp2_pp_1f1b": ((*RING, *PIPE), {"rules": "pp_tp_cp", "mesh": {"stage": 2, "context": 2, "tensor": 2}}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_loss_and_gradients_equal_the_documents_one_at_a_time(reference, docs, name):
    """Every kernel and layout that masks across documents: dot (also under tp_sp and in 1F1B stages), blockwise
    (also under tp_sp), ring with a context of 4 and of 2 (in 1F1B stages, with tensor 2), the ring fed
    the sequence in its zig-zag order."""
    _, params, batch, _, _, ref_loss, ref_grads, _ = reference
    overrides, layout = LAYOUTS[name]
    trainer = Trainer.build(config(docs, "data.documents=true", *overrides, **layout))
    order = trainer.sequence_order
    if order is not None:
        batch = {k: v[:, order] for k, v in batch.items()}
    placed = jax.device_put(batch, dict.fromkeys(batch, trainer.batch_sharding))
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), placed)
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_trees_close(grads, ref_grads)


def test_a_tile_is_skipped_exactly_when_no_query_shares_a_document_with_a_key():
    full, skip, across = ring_schedule.FULL, ring_schedule.SKIP, ring_schedule.FULL + ring_schedule.ACROSS
    visible = ring_schedule.visible
    # Document starts of 4-token tiles (two rows): the query tile's documents begin at 8 and 10, or at 12.
    q = jnp.array([[8, 8, 10, 10], [12, 12, 12, 12]])
    assert visible(full, q, jnp.array([[4, 4, 4, 8], [4, 4, 4, 4]])) == across  # row 0 shares 8: masked pairwise
    assert visible(full, q, jnp.array([[0, 0, 4, 4], [4, 4, 4, 4]])) == skip  # none shares one
    assert visible(full, q, jnp.array([[0, 0, 4, 4], [4, 4, 12, 12]])) == across  # row 1 shares 12
    one = jnp.array([[8, 8, 8, 8], [12, 12, 12, 12]])
    assert visible(full, one, one) == full  # each row in one document: no mask
    assert visible(ring_schedule.DIAGONAL, one, one) == ring_schedule.DIAGONAL  # causal only
    assert visible(skip, one, one) == skip  # causally masked stays skipped
    assert visible(skip, q, jnp.array([[4, 4, 4, 8], [4, 4, 4, 4]])) == skip  # however its documents lie
    # Queries spanning two documents, keys inside one of them (or the other way round): the key tile is in one
    # document but not every query's, so the tile is masked pair by pair, never read as one document.
    two = jnp.array([[8, 8, 10, 10], [12, 12, 12, 12]])
    assert visible(full, two, jnp.array([[10, 10, 10, 10], [12, 12, 12, 12]])) == across
    assert visible(full, two, jnp.array([[8, 8, 8, 8], [12, 12, 12, 12]])) == across
    assert visible(full, jnp.array([[10, 10, 10, 10], [12, 12, 12, 12]]), two) == across


@pytest.mark.parametrize("ring", [False, True], ids=["blockwise", "ring_cp4"])
def test_document_masks_add_no_length_squared_memory_under_a_layer_scan(ring):
    """The kernel's gradient under a scan of two layers, the positions the same for both (JAX may hoist what
    depends on them alone out of the scan): temp memory within 10% of the unmasked kernel's, where one
    [length, length] boolean mask per layer would add more than 10%."""
    seq, heads, head_dim = 2048, 4, 16
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4]) if ring else None
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.float32)
    axes = ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim")

    def loss(q, k, v, positions):
        def layer(x, _):
            with use_rules(mesh, Rules.load("cp")) if ring else contextlib.nullcontext():
                return ring_attention.attention(x, k, v, *axes, positions=positions, block=256, ring=ring), None

        return jax.lax.scan(layer, q, None, length=2)[0].sum()

    temp = {}
    for positions in (None, jax.ShapeDtypeStruct((1, seq), jnp.int32)):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, positions).compile()
        temp[positions is not None] = compiled.memory_analysis().temp_size_in_bytes
    assert 2 * seq * seq > 0.1 * temp[False], temp  # the bound sees a mask of one byte per pair and layer
    assert temp[True] <= 1.1 * temp[False], temp


def test_cudnn_refuses_documents_and_names_the_kernel_to_use(docs):
    with pytest.raises(ConfigError, match=r"^data\.documents: model\.attention 'cudnn' does not mask across "
                                          r"documents .*: use 'blockwise'"):
        Trainer.build(config(docs, "data.documents=true", "model.attention=cudnn", "model.dtype=bfloat16",
                             mesh={"data": 8}))
    with pytest.raises(ConfigError, match=r"^data\.documents: needs data\.source=tokens"):
        tiny_config("data.documents=true")
    model = tiny_config("model.attention=auto", "model.dtype=bfloat16").model
    assert resolve_attention(model, "gpu", 32) == "cudnn"
    assert resolve_attention(model, "gpu", 32, documents=True) == "dot"  # auto never picks cuDNN for documents
    assert resolve_attention(model, "gpu", 4096, documents=True) == "blockwise"


def test_first_fit_places_each_document_in_the_first_sequence_with_room():
    # Capacity 10: 6 opens 0; 5 opens 1 (0 has 4 left); 4 fills 0; 3 goes to 1 (5 + 3); 2 to 1 (10); 9 opens 2.
    assert first_fit(np.array([6, 5, 4, 3, 2, 9]), 10).tolist() == [0, 0 + 1, 0, 1, 1, 2]
    # With one open sequence, each that does not fit closes the one before: 6 | 5 4 | 3 2 ... in order.
    assert first_fit(np.array([6, 5, 4, 3, 2, 9]), 10, open_bins=1).tolist() == [0, 1, 1, 2, 2, 3]


def test_first_fit_rows_hold_whole_documents(docs):
    data = TokenDir.open(docs)
    tokens, starts = np.asarray(data.tokens("train")), data.documents("train")
    bins = PackedBins(tokens, 32, None, starts, "train")
    found = []
    for i in range(len(bins)):  # one epoch: every document once, whole, beginning at position 0
        w = bins[i]
        cuts = [*np.nonzero(w[2] == 0)[0], len(w[0])]  # where a document (or a pad) begins
        for a, b in itertools.pairwise(cuts):
            if b - a == 1 and w[0, a] == 0 and w[1, a] == 0:
                continue  # a pad: token 0, untrained, position 0
            found.append(w[0, a:b].astype(tokens.dtype).tobytes())
            assert w[1, a:b].all()  # trained (the loader leaves out the boundary)
    assert sorted(found) == sorted(tokens[a:b].tobytes() for a, b in itertools.pairwise(starts))
    assert len(bins) < 1.3 * len(tokens) / 33  # little padding
    rows = make_loader(config(docs, "data.documents=true", "data.packing=first_fit")).windows(0, range(16))
    assert any(np.array_equal(rows[0], bins[i]) for i in range(len(bins)))  # shuffled sequences of the same bins


def test_a_document_longer_than_a_sequence_is_refused_under_first_fit(tmp_path):
    (tmp_path / "long.txt").write_text("x" * 40)
    prepare_data([tmp_path / "long.txt"], tmp_path / "tokens", val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"^data\.packing=first_fit: 1 documents of the train split of data\.path="
                                          r".* are longer than train\.seq_len \+ 1 = 33 tokens \(the longest 41\)"):
        Trainer.build(config(tmp_path / "tokens", "data.documents=true", "data.packing=first_fit", mesh={"data": 8}))
    with pytest.raises(ConfigError, match=r"^data\.packing=first_fit: needs data\.documents=true"):
        config(tmp_path / "tokens", "data.packing=first_fit")


def test_first_fit_loss_and_gradients_equal_the_documents_one_at_a_time(reference, docs):
    trainer, params, *_, plain = reference  # the packed trainer's step, fed first-fit rows
    loader = make_loader(config(docs, "data.documents=true", "data.packing=first_fit"))
    batch = loader.rows(0)
    assert (batch["targets"] == IGNORE).sum() > (batch["inputs"] == 256).sum()  # pads besides the boundaries
    ref_loss, ref_grads = plain.loss_and_grads(params, alone(batch))
    loss, grads = trainer.loss_and_grads(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    assert_trees_close(grads, ref_grads)
