"""Ulysses and USP context parallelism (jaxscale/parallel/ulysses.py): the kernel against the textbook softmax,
the train step's loss and every gradient against one device (fp32, 1e-5) with packed documents, replicated kv
heads, TP and MLA, the collectives of the compiled attention, and bad layouts refused in one line."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, fails_early, rel_err, tiny_config

from jaxscale.analysis.cluster import load_cluster
from jaxscale.analysis.communication import communication
from jaxscale.analysis.hlo import collectives
from jaxscale.analysis.inspect import step_collectives
from jaxscale.analysis.params import Step, param_table
from jaxscale.analysis.plan import layouts
from jaxscale.analysis.strategy import Strategy, model_for, placement, rules_for
from jaxscale.config.read import ConfigError, MeshConfig, ModelConfig, load_config
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, layout_of, use_rules
from jaxscale.models import attention
from jaxscale.parallel import ring_schedule
from jaxscale.training.trainer import Trainer

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
BATCH, SEQ, HEADS, HEAD_DIM = 2, 32, 8, 8


def softmax_attention(q, k, v, positions):
    """The textbook reference: kv heads repeated, the whole causal score matrix masked to each document."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    doc = jnp.cumsum(positions == 0, axis=1)
    keep = jnp.tril(jnp.ones((q.shape[1],) * 2, bool)) & (doc[:, :, None] == doc[:, None, :])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep[:, None], scores, -jnp.inf), axis=-1), v)


def packed_positions() -> np.ndarray:
    """Positions of rows packed with documents of 5, 11, 3 and 13 tokens (row 0) and 20 and 12 (row 1)."""
    rows = [[5, 11, 3, 13], [20, 12]]
    return np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]).astype(np.int32)


# name -> (rules, mesh, model.attention, kv heads): Ulysses over 4 devices, USP as a 2 x 2.
KERNELS = {
    "ulysses_dot": ("ulysses", {"context": 4}, "dot", 4),
    "ulysses_blockwise_kv2": ("ulysses", {"context": 4}, "blockwise", 2),
    "ulysses_ring_kv1": ("ulysses", {"context": 4}, "ring", 1),
    "usp_kv2": ("usp", {"context": 2, "ulysses": 2}, "ring", 2),
    "usp_kv1": ("usp", {"context": 2, "ulysses": 2}, "ring", 1),
}


def kernel_run(name: str, documents: bool):
    """Output and gradients of <output, cotangent> in the natural order, and the compiled HLO."""
    rules, sizes, kind, kv_heads = KERNELS[name]
    mesh = make_mesh(MeshConfig(data=1, **sizes), jax.devices()[:4])
    model = ModelConfig(attention=kind, attention_block=4, heads=HEADS, kv_heads=kv_heads, head_dim=HEAD_DIM)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = [(BATCH, SEQ, HEADS, HEAD_DIM), *[(BATCH, SEQ, kv_heads, HEAD_DIM)] * 2, (BATCH, SEQ, HEADS, HEAD_DIM)]
    q, k, v, ct = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True))
    positions = packed_positions() if documents else np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))
    ring = sizes["context"] if rules == "usp" else 1
    order = ring_schedule.sequence_order(SEQ, ring) if ring > 1 else np.arange(SEQ)

    def attend(q, k, v):
        with use_rules(mesh, Rules.load(rules)):
            return attention.attention(q, k, v, jnp.asarray(positions[:, order]) if documents else None,
                                       Q_AXES, KV_AXES, model)

    def value_and_grads(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(ct[:, order])

    step = jax.jit(value_and_grads)
    got = step(*(x[:, order] for x in (q, k, v)))
    want_out, vjp = jax.vjp(partial(softmax_attention, positions=jnp.asarray(positions)), q, k, v)
    inverse = np.argsort(order)
    pairs = zip((got[0], *got[1]), (want_out, *vjp(ct)), strict=True)
    hlo = step.lower(*(x[:, order] for x in (q, k, v))).compile().as_text()
    return [rel_err(np.asarray(a)[:, inverse], b) for a, b in pairs], hlo, mesh


def wire(hlo: str, mesh, kind: str) -> float:
    """Bytes each device sends per call through the compiled collectives of ``kind``."""
    return sum(c.wire_bytes for c in collectives(hlo, mesh) if c.kind == kind)


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_ulysses_and_usp_attention_match_the_softmax_reference(name, documents):
    errors, hlo, mesh = kernel_run(name, documents)
    assert max(errors) <= 1e-5, f"{name}: out, dq, dk, dv relative errors {errors}"
    rules, sizes, _, kv_heads = KERNELS[name]
    ring = sizes["context"] if rules == "usp" else 1
    u = 4 // ring
    kinds = [c.kind for c in collectives(hlo, mesh)]
    assert kinds.count("all-to-all") == 8  # q, k, v and the output, forward and backward
    assert kinds.count("all-gather") == (1 if documents else 0)  # the positions, over the all-to-all axes
    assert ("collective-permute" in kinds) == (ring > 1)  # the ring part passes its K/V blocks; Ulysses alone none
    if documents:
        return
    # The formulas (docs/formulas.md, "CP (Ulysses, USP)"), fp32: each all-to-all keeps 1/u of its tensor; kv heads
    # fewer than u are replicated to u before it. The ring part (r devices) passes the head-split K and V blocks
    # r-1 times and their fp32 gradients r times (the backward's K/V hops are the forward's here: XLA merges the
    # identical permutes of one program without remat; a train step's layer scan keeps both).
    tokens, g = BATCH * SEQ // 4, max(kv_heads, u)
    assert wire(hlo, mesh, "all-to-all") == 2 * (u - 1) / u * tokens * (2 * HEADS + 2 * g) * HEAD_DIM * 4
    block = BATCH * SEQ // ring * g // u * HEAD_DIM * 4
    assert wire(hlo, mesh, "collective-permute") == ((2 * (ring - 1) + 2 * ring) * block if ring > 1 else 0)


def with_ulysses(tmp_path_factory, preset: str) -> Path:
    """A rules preset with Ulysses over its context axis."""
    text = (Path(__file__).parent.parent / f"configs/rules/{preset}.yaml").read_text()
    path = tmp_path_factory.mktemp("rules") / f"{preset}_ulysses.yaml"
    path.write_text(text.replace("  length: context\n", "  length: context\n  ulysses: context\n"))
    return path


@pytest.fixture(scope="module")
def rules_files(tmp_path_factory) -> dict[str, Path]:
    """fsdp_tp_cp and pp_tp_cp with Ulysses over context: heads over tensor x context inside attention."""
    return {"tp": with_ulysses(tmp_path_factory, "fsdp_tp_cp"), "pp": with_ulysses(tmp_path_factory, "pp_tp_cp")}


DOCS = ("data.documents=true", "model.attention_block=4")
# name -> (overrides, rules, mesh): packed documents throughout; kv_heads below the all-to-all's degree where said.
STEPS = {
    "ulysses4_dot_kv2": (("model.kv_heads=2", "model.attention=dot"), "ulysses", {"fsdp": 2, "context": 4}),
    "ulysses4_blockwise": (("model.attention=blockwise",), "ulysses", {"fsdp": 2, "context": 4}),
    # as the planner writes pure Ulysses: rules usp with the ring's axis of size 1, over the ulysses mesh axis
    "ulysses4_own_axis_blockwise": (("model.attention=blockwise",), "usp", {"fsdp": 2, "ulysses": 4}),
    "usp2x2_ring_kv1": (("model.kv_heads=1", "model.attention=ring"), "usp", {"fsdp": 2, "context": 2, "ulysses": 2}),
    "ulysses2_tp2_fsdp2_kv2": (("model.kv_heads=2", "model.attention=blockwise"), "tp", {"fsdp": 2, "context": 2,
                                                                                         "tensor": 2}),
    # in 1F1B stages: the loop manual over context, the all-to-alls written there, blockwise on whole sequences
    "ulysses2_tp2_pp2_1f1b": (("model.attention=ring", "pipeline.microbatches=4", "pipeline.schedule=1f1b"), "pp",
                              {"stage": 2, "context": 2, "tensor": 2}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "ulysses4_dot_kv2" else pytest.mark.slow)
                                  for n in STEPS])
def test_a_step_under_ulysses_gives_the_loss_and_gradients_of_one_device(name, docs, rules_files):
    overrides, rules, mesh = STEPS[name]
    data = ("data.source=tokens", f"data.path={docs}", "model.vocab_size=264", *DOCS, *overrides)
    one = Trainer.build(tiny_config(*data), jax.devices()[:1])
    params = jax.device_get(one.init_state().params)
    ref_loss, ref_grads = one.loss_and_grads(params, one.batch(0))
    trainer = Trainer.build(tiny_config(*data, rules=str(rules_files.get(rules, rules)), mesh=mesh))
    assert (trainer.sequence_order is not None) == (mesh.get("context", 1) > 1 and rules == "usp")  # USP's zig-zag
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_deepseek_mla_and_mtp_under_ulysses_give_the_loss_and_gradients_of_one_device(documents, docs):
    """Multi-head latent attention (queries and keys 24 wide, values 16) with its multi-token prediction, Ulysses
    over 4 devices (one head each), blockwise on the whole sequences; with packed documents under
    model.attention=ring (blockwise under Ulysses alone: the rows stay in order, so MTP reads its targets as on
    one device, where a ring of 2 or more is refused)."""
    data = (("data.source=tokens", f"data.path={docs}", "model.vocab_size=264", "data.documents=true",
             "model.attention=ring") if documents else ("data.max_bytes=200000", "model.attention=blockwise"))

    def config(rules: str, **mesh: int):
        sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 1, **mesh}
        return load_config(None, ["model=deepseek-v3-tiny", "train.global_batch=8", "train.seq_len=32",
                                  "model.attention_block=8", *data, f"rules={rules}",
                                  *(f"mesh.{k}={v}" for k, v in sizes.items())])

    one = Trainer.build(config("dp"), jax.devices()[:1])
    params = jax.device_get(one.init_state().params)
    ref_loss, ref_grads = one.loss_and_grads(params, one.batch(0))
    trainer = Trainer.build(config("ulysses", fsdp=2, context=4))
    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.param_shardings()), trainer.batch(0))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize(
    "overrides, rules, mesh, match",
    [
        (["model.attention=dot"], "usp", {"fsdp": 2, "context": 2, "ulysses": 2},
         r"rules 'usp': USP \(all-to-all over \['ulysses'\], a ring over \['context'\]\) needs model\.attention=ring"),
        (["model.kv_heads=3", "model.heads=6"], "ulysses", {"fsdp": 2, "context": 4},
         r"Ulysses over \['context'\] \(4 devices\) splits each device's heads: its 6 query heads must divide by 4"),
        (["model.kv_heads=2", "model.heads=12", "model.attention=dot"], "ulysses", {"data": 1, "context": 8},
         r"its 12 query heads must divide by 8, and its 2 kv heads"),
    ],
)
def test_bad_ulysses_layouts_fail_in_one_line_before_compiling(overrides, rules, mesh, match):
    with fails_early(match):
        Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh))


def test_ulysses_axes_must_close_the_sequence_axes(tmp_path):
    text = (Path(__file__).parent.parent / "configs/rules/usp.yaml").read_text()
    path = tmp_path / "usp_inverted.yaml"
    path.write_text(text.replace("length: [context, ulysses]", "length: [ulysses, context]"))
    with pytest.raises(ConfigError, match=r"ulysses \['ulysses'\] must be the last mesh axes of length "
                                          r"\['ulysses', 'context'\]"):
        Trainer.build(tiny_config("model.attention=ring", rules=str(path), mesh={"fsdp": 2, "context": 2,
                                                                                  "ulysses": 2}))


# The same shape under the three strategies: context 4 (fsdp 2), tiny model with 4 kv heads; and as the planner
# writes each (Ulysses over its own mesh axis).
STRATEGIES = {
    "ring": ("cp", {"fsdp": 2, "context": 4}, "model.attention=ring"),
    "ulysses": ("ulysses", {"fsdp": 2, "context": 4}, "model.attention=dot"),
    "usp": ("usp", {"fsdp": 2, "context": 2, "ulysses": 2}, "model.attention=ring"),
}
# (data 2 for fsdp 2: the planner's fsdp is ZeRO-3, which the presets here do not shard)
PLANNED = {"ring": Strategy(data=2, context=4), "ulysses": Strategy(data=2, ulysses=4),
           "usp": Strategy(data=2, context=2, ulysses=2)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_steps_context_bytes_equal_the_formula(name, trainers):
    """The compiled step's all-to-all and collective-permute wire bytes per device against the formula written
    here (fp32, 2 layers, per device b = 8 rows of s/c = 8 tokens, 8 heads and 4 kv heads of 8; a layer's
    collectives once forward, once backward: no remat), and the analytic model's (jaxscale.analysis) the same,
    on the trainer's rules and on the planner's (:data:`PLANNED`)."""
    rules, mesh, kernel = STRATEGIES[name]
    trainer, step = trainers.step(kernel, rules=rules, mesh=mesh)
    compiled = {}
    for c in step_collectives(trainer, step)[0]:
        compiled[c.kind] = compiled.get(c.kind, 0) + c.wire_bytes
    layers, rows, tokens, heads, kv, d = 2, 8, 8, 8, 4, 8
    u = {"ring": 1, "ulysses": 4, "usp": 2}[name]
    r = 4 // u
    a2a = 2 * (u - 1) / u * rows * tokens * (2 * heads + 2 * kv) * d * 4  # q, k, v, out; forward and backward
    block = rows * tokens * u * (kv // u) * d * 4  # one device's K (or V) block round the ring: s/r tokens, g/u heads
    ring = (2 * (r - 1) * 2 + 2 * r) * block if r > 1 else 0  # K, V r-1 hops each way; dK, dV r hops
    assert compiled.get("all-to-all", 0) == layers * a2a
    assert compiled.get("collective-permute", 0) == layers * ring
    config = trainer.config
    for layout in (layout_of(trainer.mesh, trainer.rules), placement(PLANNED[name])):
        flows = communication(config.model, param_table(config), layout, Step.from_config(config))
        for kind, want in (("all-to-all", a2a), ("collective-permute", ring)):
            assert sum(f.wire_bytes for f in flows if f.kind == kind) == layers * want


def test_the_planner_tries_ulysses_and_usp_where_they_split_the_heads():
    """Each context degree's layouts come with Ulysses over all of it and USP (the all-to-all's u devices inside
    the node, the ring's r across) where a device's heads divide by u (kv heads replicated where fewer), never in a
    pipeline; their rules name the all-to-all's mesh axis, Ulysses' kernel runs whole sequences, USP's the ring's."""
    model = load_config(None, ["model=llama3-8b"]).model  # 32 heads, 8 kv heads
    cluster = load_cluster("h100")  # one node of 8

    def splits(t: int, u: int) -> bool:  # a device's 32/t query heads divide by u; its 8/t kv heads divide or fit u
        return 32 // t % u == 0 and (8 // t % u == 0 or u % (8 // t) == 0)

    found = [s for s in layouts(model, cluster, 131072) if s.cp > 1]
    ulysses = {(s.tensor, s.ulysses) for s in found if s.cp_kind == "Ulysses"}
    assert ulysses == {(t, c) for t in (1, 2, 4, 8) for c in (2, 4, 8) if splits(t, c) and t * c <= 8}
    usp = {(s.tensor, s.ulysses, s.context) for s in found if s.cp_kind == "USP"}
    assert usp == {(t, u, r) for t in (1, 2, 4) for u in (2, 4) for r in (2, 4) if splits(t, u) and t * u * r <= 8}
    assert {(s.tensor, s.context) for s in found if s.cp_kind == "ring"} >= {(1, 8), (2, 4)}
    assert not any(s.ulysses > 1 and s.stage > 1 for s in found)
    one, usp2 = Strategy(fsdp=2, ulysses=4), Strategy(fsdp=2, context=2, ulysses=2)
    assert placement(one).ulysses_axes == ("ulysses",) and placement(one).ring_size == 1
    assert placement(usp2).ulysses_axes == ("ulysses",) and placement(usp2).ring_axes == ("context",)
    written, preset = rules_for(usp2)["rules"], Rules.load("usp").params  # the planner's rules: the preset's
    assert all(tuple(written[name]) == preset[name] for name in ("length", "norm_length")) and written["ulysses"] == \
        "ulysses"
    assert [model_for(model, s).attention for s in (one, usp2, replace(one, ulysses=1, context=4))] == \
        ["blockwise", "ring", "ring"]
