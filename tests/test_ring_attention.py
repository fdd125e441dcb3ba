"""Context parallelism: ring attention equals plain softmax attention, and a CP step equals one device."""

import re
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, assert_trees_close, rel_err, run_steps, tiny_config

from jaxscale.config.read import CONFIG_DIR, ConfigError, MeshConfig, ModelConfig
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, constrain, use_rules
from jaxscale.models.attention import attention, sequence_order
from jaxscale.parallel import ring_attention, ring_schedule
from jaxscale.training.trainer import Trainer

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
BATCH, SEQ, HEADS, HEAD_DIM, TILE = 2, 64, 4, 8, 4


def softmax_attention(q, k, v, causal: bool):
    """The textbook reference: kv heads repeated, the whole score matrix, softmax."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def value_and_grads(attend, q, k, v, cotangent):
    """Output and the gradients of <output, cotangent> with respect to q, k, v."""
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(cotangent)


def inputs(kv_heads: int, seed: int = 0):
    shapes = [(BATCH, SEQ, HEADS, HEAD_DIM), *[(BATCH, SEQ, kv_heads, HEAD_DIM)] * 2, (BATCH, SEQ, HEADS, HEAD_DIM)]
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes, strict=True)]


@pytest.fixture(scope="module")
def references():
    """(causal, kv heads) -> the plain softmax and jax.nn.dot_product_attention outputs and gradients."""
    out, evaluate = {}, jax.jit(value_and_grads, static_argnums=0)
    for causal in (True, False):
        for kv_heads in (2, HEADS):
            q, k, v, ct = inputs(kv_heads)
            plain = partial(softmax_attention, causal=causal)
            dot = partial(jax.nn.dot_product_attention, is_causal=causal)
            out[causal, kv_heads] = tuple(evaluate(f, q, k, v, ct) for f in (plain, dot))
    return out


def ring_value_and_grads(kv_heads: int, causal: bool, mesh_sizes: dict[str, int], rules: str, layout: str = "zigzag"):
    """Ring attention on a mesh, fed each sequence in the ring's order; results back in natural order."""
    cp = mesh_sizes["context"]
    devices = jax.devices()[: int(np.prod(list(mesh_sizes.values())))]
    mesh = make_mesh(MeshConfig(data=1, **mesh_sizes), devices)
    order = ring_schedule.sequence_order(SEQ, cp, layout) if causal else np.arange(SEQ)
    inverse = np.argsort(order)

    def attend(q, k, v):
        with use_rules(mesh, Rules.load(rules)):
            return ring_attention.attention(q, k, v, Q_AXES, KV_AXES, causal=causal, block=TILE, layout=layout)

    out, grads = jax.jit(value_and_grads, static_argnums=0)(attend, *(x[:, order] for x in inputs(kv_heads)))
    return out[:, inverse], [g[:, inverse] for g in grads]


def assert_close(got, want, what: str) -> None:
    (out, grads), (want_out, want_grads) = got, want
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads), strict=True):
        err = rel_err(x, ref)
        assert err <= RTOL, f"{what}: {name} relative error {err:.1e}"


# cp=2 also shards the batch and heads (over fsdp and tensor), cp=4 the heads.
RINGS = {2: {"fsdp": 2, "context": 2, "tensor": 2}, 4: {"context": 4, "tensor": 2}, 8: {"context": 8}}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", list(RINGS))
def test_ring_attention_matches_softmax_reference(cp, causal, references):
    for kv_heads in (2, HEADS):  # grouped-query and multi-head
        got = ring_value_and_grads(kv_heads, causal, RINGS[cp], "fsdp_tp_cp")
        plain, dot = references[causal, kv_heads]
        assert_close(got, plain, f"cp={cp} kv_heads={kv_heads} vs softmax")
        assert_close(got, dot, f"cp={cp} kv_heads={kv_heads} vs jax.nn.dot_product_attention")


def test_contiguous_chunks_are_correct_too(references):
    """The schedule the load-balance figures count is the kernel's: it is right for either chunk layout."""
    got = ring_value_and_grads(2, True, {"context": 4}, "cp", layout="contiguous")
    assert_close(got, references[True, 2][0], "contiguous cp=4")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blockwise_attention(causal, references):
    """Without a ring the kernel is flash-style attention over the whole sequence (16 tiles): on one device,
    and under rules that shard the batch and heads (the sequence, split over context, is gathered)."""
    q, k, v, ct = inputs(2)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, context=2, tensor=2))

    def attend(q, k, v, rules: str | None):
        if rules is None:
            return ring_attention.attention(q, k, v, Q_AXES, KV_AXES, causal=causal, block=TILE)
        with use_rules(mesh, Rules.load(rules)):
            return ring_attention.attention(q, k, v, Q_AXES, KV_AXES, causal=causal, block=TILE, ring=False)

    for rules in (None, "fsdp_tp_cp"):
        got = jax.jit(value_and_grads, static_argnums=0)(partial(attend, rules=rules), q, k, v, ct)
        assert_close(got, references[causal, 2][0], f"blockwise under rules {rules}")


def test_gradient_memory_is_linear_in_the_sequence_under_a_layer_scan():
    """Linearizing a scan over layers must not stack anything per tile (JAX hoists constant-only values)."""
    temp = {}
    for seq_len in (2048, 4096):
        q = jax.ShapeDtypeStruct((1, seq_len, HEADS, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, seq_len, 2, 16), jnp.float32)

        def loss(q, k, v):
            def layer(x, _):
                return ring_attention.attention(x, k, v, Q_AXES, KV_AXES, causal=True, block=128), None

            return jax.lax.scan(layer, q, None, length=2)[0].sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        temp[seq_len] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[4096] < 2.5 * temp[2048], temp


def test_zigzag_balances_causal_work():
    """Per-device attention FLOPs from the tiles the kernel computes: equal with zig-zag, ~2x with contiguous."""
    for cp in (2, 4, 8):
        computed = {}
        for layout in ring_schedule.LAYOUTS:
            # One tile per chunk: device i meets 2·cp chunks of keys with each of its 2 query chunks.
            counts = ring_schedule.tile_counts(cp, 2 * cp * 64, 64, causal=True, layout=layout)
            assert (counts.sum(axis=1) == 4 * cp).all()
            computed[layout] = counts[:, ring_schedule.DIAGONAL] + counts[:, ring_schedule.FULL]
        assert computed["zigzag"].tolist() == [2 * cp + 1] * cp
        assert computed["contiguous"].tolist() == [4 * i + 3 for i in range(cp)]
    flops = computed["zigzag"] * 4 * 64 * 64 * HEAD_DIM * HEADS
    assert flops.max() <= 1.05 * flops.min()
    assert computed["contiguous"].max() / computed["contiguous"].mean() == pytest.approx(31 / 17)  # cp=8: 1.8x
    # Finer tiles inside the chunks: still balanced, and every query tile meets every key tile once.
    counts = ring_schedule.tile_counts(8, 1024, 16, causal=True)
    assert (counts.sum(axis=1) == (1024 // 16) ** 2 // 8).all()
    assert len(set((counts[:, ring_schedule.DIAGONAL] + counts[:, ring_schedule.FULL]).tolist())) == 1


def test_data_path_reorders_tokens_targets_and_positions():
    plain = Trainer.build(tiny_config(rules="cp", mesh={"fsdp": 2, "context": 4}))
    ring = Trainer.build(tiny_config("model.attention=ring", rules="cp", mesh={"fsdp": 2, "context": 4}))
    assert plain.batches.rows(0)["positions"][0].tolist() == list(range(32))
    order = sequence_order(ring.config.model, 32, ring.mesh, ring.rules)
    assert sorted(order) == list(range(32))
    assert order[:8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]  # device 0: chunks 0 and 7 of 8
    want, got = plain.batches.rows(0), ring.batches.rows(0)
    for key in ("inputs", "targets", "positions"):
        np.testing.assert_array_equal(got[key], want[key][:, order])


# -- a training step under CP equals one device ----------------------------------------


_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(kind, result shapes) of every collective in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            dims = re.findall(r"\w+\[([\d,]*)\]", match.group(1))
            found.append((match.group(2), [tuple(int(d) for d in s.split(",") if d) for s in dims]))
    return found


def full_kv_gathers(hlo: str, seq_len: int, kv_heads: int) -> list:
    """All-gathers or all-to-alls whose result holds keys or values of the whole sequence."""
    return [
        (kind, shapes)
        for kind, shapes in collectives(hlo)
        if kind in ("all-gather", "all-to-all") and any(s[-3:] == (seq_len, kv_heads, 8) for s in shapes)
    ]


CP_LAYOUTS = {
    "cp": {"fsdp": 2, "context": 4},
    "fsdp_cp": {"data": 2, "context": 4},
    "fsdp_tp_cp": {"fsdp": 2, "context": 2, "tensor": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("rules", list(CP_LAYOUTS))
def test_cp_step_matches_single_device(rules, one_device):
    _, ref_loss, ref_grads, ref_params, *_ = one_device
    mesh = CP_LAYOUTS[rules]
    config = tiny_config("model.attention=ring", "model.attention_block=2", rules=rules, mesh=mesh)
    _, loss, grads, params, _, hlo = run_steps(Trainer.build(config))
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    assert_trees_close(grads, ref_grads)
    assert_trees_close(params, ref_params)
    # Attention moves keys and values by collective-permute only: no all-gather of the whole sequence.
    tensor = mesh.get("tensor", 1)
    kv_block = (16 // mesh.get("fsdp", 1) // mesh.get("data", 1), 32 // mesh["context"], 4 // tensor, 8)
    permutes = [shapes for kind, shapes in collectives(hlo) if kind == "collective-permute"]
    assert sum(kv_block in shapes for shapes in permutes) == 8  # k, v forward; k, v, dk, dv backward (+ last hop)
    assert full_kv_gathers(hlo, 32, 4 // tensor) == []
    if rules == "cp":  # parameters replicated: the ring and the gradient all-reduce are the only traffic
        assert {kind for kind, _ in collectives(hlo)} == {"collective-permute", "all-reduce"}
        assert all(shapes == [kv_block] for shapes in permutes)


def test_kv_gather_check_sees_dot_attention():
    """The same check finds the all-gather that XLA emits for plain attention over a context-sharded sequence."""
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    q, k, v, _ = inputs(2)

    def attend(q, k, v):
        with use_rules(mesh, Rules.load("cp")):
            q, k, v = constrain(q, Q_AXES), constrain(k, KV_AXES), constrain(v, KV_AXES)
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    hlo = jax.jit(attend).lower(q, k, v).compile().as_text()
    assert full_kv_gathers(hlo, SEQ, 2)


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, rules, mesh, match",
    [
        (["model.attention=flash"], "dp", {"data": 8}, r"model\.attention: 'flash' is not one of dot, blockwise"),
        (["model.attention_block=0"], "dp", {"data": 8}, r"model\.attention_block must be positive"),
        (["model.attention=ring", "train.seq_len=36"], "cp", {"fsdp": 2, "context": 4},
         r"train\.seq_len \(36\) is not divisible by 8: causal ring attention over context cuts it into 2 x 4"),
        (["model.attention=ring", "model.attention_block=3"], "cp", {"fsdp": 4, "context": 2},
         r"model\.attention_block \(3\) does not divide the 8-token chunks of train\.seq_len \(32\)"),
        (["model.attention=cudnn"], "dp", {"data": 8}, r"model\.attention: 'cudnn' needs model\.dtype bfloat16"),
        (["model.attention=cudnn", "model.dtype=bfloat16"], "dp", {"data": 8},
         r"model\.attention: 'cudnn' needs GPU devices, these are cpu"),
    ],
)
def test_bad_attention_config_fails_before_compiling(overrides, rules, mesh, match):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=match) as info:
        Trainer.build(tiny_config(*overrides, rules=rules, mesh=mesh))
    assert "\n" not in str(info.value)
    assert time.perf_counter() - start < 10


def test_sequence_parallel_axes_must_follow_the_context_axes(tmp_path):
    """norm_length [tensor, context] would hand attention the wrong tokens: an error, not a silent mix-up."""
    path = tmp_path / "swapped.yaml"
    preset = (CONFIG_DIR / "rules" / "fsdp_tp_cp.yaml").read_text()
    path.write_text(preset.replace("norm_length: [context, tensor]", "norm_length: [tensor, context]"))
    with pytest.raises(ConfigError, match=r"norm_length \['tensor', 'context'\] must start with the mesh axes of"):
        Trainer.build(tiny_config(rules=str(path), mesh={"fsdp": 2, "context": 2, "tensor": 2}))


@pytest.mark.parametrize("kind, width", [("dot", 8), ("dot", 16), ("ring", 8)])
def test_values_of_another_width_than_queries_and_keys(kind, width):
    """Multi-head latent attention's shapes: queries and keys 12 wide, values narrower or wider; the kernels give
    the textbook attention's output and gradients (the ring on context=4, fed the zig-zag order; its per-device
    kernel is blockwise attention's)."""
    q, k, _, _ = inputs(2)
    q, k = jnp.concatenate([q, q[..., :4]], -1), jnp.concatenate([k, k[..., :4]], -1)
    v = jax.random.normal(jax.random.PRNGKey(width), (*k.shape[:3], width))
    ct = jax.random.normal(jax.random.PRNGKey(1), (*q.shape[:3], width))
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    order = ring_schedule.sequence_order(SEQ, 4) if kind == "ring" else np.arange(SEQ)

    def attend(q, k, v):
        if kind != "ring":
            return attention(q, k, v, None, Q_AXES, KV_AXES, ModelConfig(attention=kind))
        with use_rules(mesh, Rules.load("cp")):
            return ring_attention.attention(q, k, v, Q_AXES, KV_AXES, block=TILE)

    want = jax.jit(value_and_grads, static_argnums=0)(partial(softmax_attention, causal=True), q, k, v, ct)
    out, grads = jax.jit(value_and_grads, static_argnums=0)(attend, *(x[:, order] for x in (q, k, v, ct)))
    inverse = np.argsort(order)
    assert_close((out[:, inverse], [g[:, inverse] for g in grads]), want, f"{kind}, values {width} wide")
