"""The lowered train step with FP8 on (tiny 2-layer model): what XLA is handed, counted from its StableHLO.

The layer scan's body is lowered once for both layers, so the counts below are per layer: 7 projections
(q, k, v, o, gate, up, down), each one forward dot (e4m3 x e4m3), one input-gradient dot (e5m2 x e4m3)
and one weight-gradient dot (e4m3 x e5m2). The other dots: attention's two forward and four backward,
and the LM head's three (bf16 unless ``precision.fp8_head``).
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_config

from jaxscale.training.trainer import Trainer

E4M3, E5M2 = "f8E4M3FN", "f8E5M2"
PROJECTIONS = 7
ATTENTION_DOTS, HEAD_DOTS = 6, 3
STACKED_WEIGHTS = {(2, 64, 8, 8), (2, 64, 4, 8), (2, 8, 8, 64), (2, 64, 128), (2, 128, 64)}  # wk, wv share a shape
LAYER_WEIGHTS = {shape[1:] for shape in STACKED_WEIGHTS}
_TENSOR = r"tensor<([0-9x]*)x?(\w+)>"


def lowered(*overrides: str) -> tuple[Trainer, str]:
    trainer = Trainer.build(tiny_config(*overrides), jax.devices()[:1])
    return trainer, trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()


@pytest.fixture(scope="module")
def delayed_bf16():
    return lowered("precision.fp8=delayed", "model.dtype=bfloat16")


@pytest.fixture(scope="module")
def full_remat_head():
    return lowered("precision.fp8=current", "precision.fp8_head=true", "model.remat=full")


def dot_types(text: str) -> collections.Counter:
    """(lhs element type, rhs element type) of every ``dot_general``."""
    found = collections.Counter()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            (_, lhs), (_, rhs) = re.findall(_TENSOR, line.split(" : ")[-1])[:2]
            found[lhs, rhs] += 1
    return found


def e4m3_conversions(text: str) -> collections.Counter:
    """The shapes converted to float8 e4m3, with how often."""
    found = collections.Counter()
    for line in text.splitlines():
        if "stablehlo.convert" in line and line.rstrip().endswith(f"x{E4M3}>"):
            dims = re.findall(_TENSOR, line.split("->")[-1])[0][0]
            found[tuple(int(d) for d in dims.split("x") if d)] += 1
    return found


def conditionals(text: str) -> int:
    return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_every_projection_dot_has_fp8_operands(delayed_bf16):
    """Before (main, precision.fp8=delayed): 0 of 30 dots had f8 operands, 18 conditionals in the step."""
    _, text = delayed_bf16
    dots = dot_types(text)
    assert dots[E4M3, E4M3] == PROJECTIONS  # forward
    assert dots[E5M2, E4M3] == PROJECTIONS  # input gradients: output gradient e5m2 x weight e4m3
    assert dots[E4M3, E5M2] == PROJECTIONS  # weight gradients: input e4m3 x output gradient e5m2
    assert dots[E5M2, E5M2] == 0
    others = sum(n for (a, b), n in dots.items() if not (a.startswith("f8") or b.startswith("f8")))
    assert others == ATTENTION_DOTS + HEAD_DOTS
    assert conditionals(text) == 0


@pytest.mark.parametrize("mode", [("precision.fp8=delayed",), ("precision.fp8=blockwise", "precision.fp8_block=16")],
                         ids=["delayed", "blockwise"])
def test_collective_matmul_dots_have_fp8_operands(mode):
    """``model.tp_overlap`` under ``tp_sp`` (t = 2): each projection's forward and input-gradient dots are the
    ring's t steps, all on f8 operands, its weight gradient one e4m3 x e5m2 dot of the gathered input and the
    whole output gradient (one scale each: :mod:`jaxscale.precision.fp8.collective`; blockwise, the chunks'
    tiles and their scales: :mod:`jaxscale.precision.fp8.blockwise_collective`); the LM head's three dots
    are rings of bf16 dots. Before: a ConfigError (blockwise, until the blockwise ring)."""
    t = 2
    config = tiny_config(*mode, "model.dtype=bfloat16", "model.tp_overlap=true", rules="tp_sp", mesh={"tensor": t})
    trainer = Trainer.build(config, jax.devices()[:t])
    text = trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    dots = dot_types(text)
    assert dots[E4M3, E4M3] == t * PROJECTIONS  # forward
    assert dots[E5M2, E4M3] == t * PROJECTIONS  # input gradients
    assert dots[E4M3, E5M2] == PROJECTIONS  # weight gradients
    assert dots[E5M2, E5M2] == 0
    others = sum(n for (a, b), n in dots.items() if not (a.startswith("f8") or b.startswith("f8")))
    assert others == ATTENTION_DOTS + t * HEAD_DOTS
    assert "collective_permute" in text
    assert conditionals(text) == 0


def e4m3_residuals(trainer: Trainer) -> collections.Counter:
    """The shapes of the e4m3 arrays the step's VJP keeps for the backward, with how many of each."""
    state, batch = trainer.abstract_state(), trainer.abstract_batch()

    def residuals(params, fp8_state, batch):
        with trainer.scope():
            return jax.vjp(lambda p, f: trainer.loss(p, batch, f), params, fp8_state)[1]

    kept = jax.tree.leaves(jax.eval_shape(residuals, state.params, state.fp8, batch))
    return collections.Counter(a.shape for a in kept if a.dtype == jnp.float8_e4m3fn)


# Each projection's input, stacked over the 2 layers: attention's and the MLP's x, attention's output, the MLP's hidden.
INPUTS = {(2, 16, 32, 64): 2, (2, 16, 32, 8, 8): 1, (2, 16, 32, 128): 1}


def test_fp8_residuals_in_the_vjp(delayed_bf16):
    """What the VJP keeps for the backward (``model.remat: none``): each projection's input in e4m3 and the
    weights' e4m3 copies."""
    kept = e4m3_residuals(delayed_bf16[0])
    assert all(kept[shape] >= n for shape, n in INPUTS.items()), kept
    assert set(kept) >= STACKED_WEIGHTS, kept


@pytest.mark.parametrize(("remat", "inputs_kept"), [("full", False), ("save_named", True)])
def test_remat_policy_can_keep_the_fp8_inputs(remat, inputs_kept):
    """``model.remat: full`` keeps no e4m3 activation (the backward quantizes them again); ``save_named`` with
    ``fp8_input`` (:data:`jaxscale.precision.fp8.RESIDUAL`) keeps them, 1 byte an element."""
    names = ["model.remat_names=[fp8_input]"] if remat == "save_named" else []
    trainer = Trainer.build(tiny_config("precision.fp8=delayed", f"model.remat={remat}", *names), jax.devices()[:1])
    kept = e4m3_residuals(trainer)
    assert all((kept[shape] >= n) == inputs_kept for shape, n in INPUTS.items()), kept
    assert set(kept) >= STACKED_WEIGHTS, kept  # the step's weight copies, made before the layers


def test_weights_quantized_once_per_step(full_remat_head):
    """Under ``model.remat: full`` the backward recomputes the layer's forward: with the same e4m3 weights,
    made once before the layer scan (one conversion of each stacked weight, none of a layer's)."""
    _, text = full_remat_head
    converted = e4m3_conversions(text)
    assert {shape: converted[shape] for shape in STACKED_WEIGHTS} == {
        (2, 64, 8, 8): 1, (2, 64, 4, 8): 2, (2, 8, 8, 64): 1, (2, 64, 128): 2, (2, 128, 64): 1
    }
    assert not LAYER_WEIGHTS & set(converted), converted
    dots = dot_types(text)
    # The forward and its recomputation (all but the down projection, whose output the backward never reads).
    assert dots[E4M3, E4M3] == 2 * PROJECTIONS - 1 + 1  # + the LM head (precision.fp8_head)
    assert dots[E5M2, E4M3] == dots[E4M3, E5M2] == PROJECTIONS + 1
    assert conditionals(text) == 0


PIPELINE = ("pipeline.microbatches=2", "pipeline.schedule=1f1b")
ATTENTION_WEIGHTS = {(64, 8, 8): 1, (64, 4, 8): 2, (8, 8, 64): 1}
MOE = ("model.moe={}", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp=16", "model.moe.shared_experts=1",
       "model.moe.impl=partitioner")
# Per layer: the projections and each weight's shape with how many weights have it (the MoE layer: the shared
# expert's MLP and the routed experts' stacks [experts, ...]).
STAGE_MODELS = {
    "dense": ((), PROJECTIONS, {**ATTENTION_WEIGHTS, (64, 128): 2, (128, 64): 1}),
    "moe": (MOE, 10, {**ATTENTION_WEIGHTS, (64, 16): 2, (16, 64): 1, (8, 64, 16): 2, (8, 16, 64): 1}),
}


def lowered_pipeline(*overrides: str) -> str:
    trainer = Trainer.build(tiny_config(*PIPELINE, *overrides, rules="pp", mesh={"stage": 2}), jax.devices()[:2])
    return trainer.jit_step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()


@pytest.mark.parametrize("model", STAGE_MODELS)
def test_pipeline_stages_run_in_fp8_and_quantize_weights_once_per_step(model):
    """``pp``, 2 stages of one layer, 2 microbatches (1F1B): the forward slot's layer and the backward slot's
    (its recomputation, input and weight gradients) lowered once each inside the loop of ticks, every
    projection in fp8 there (an MoE layer's routed experts too); each stage's weights converted to e4m3 once,
    before the loop (a stage's stack [1 chunk, 1 slot, ...]), never a layer's inside it; no conditional beyond
    the pipeline's own (idle slots)."""
    overrides, projections, weights = STAGE_MODELS[model]
    text = lowered_pipeline("precision.fp8=delayed", "model.dtype=bfloat16", *overrides)
    dots = dot_types(text)
    assert dots[E4M3, E4M3] == 2 * projections  # the forward slot, the backward slot's recomputation
    assert dots[E5M2, E4M3] == dots[E4M3, E5M2] == projections
    assert dots[E5M2, E5M2] == 0
    converted = e4m3_conversions(text)
    stage_weights = {(1, 1, *shape): n for shape, n in weights.items()}
    assert {shape: converted[shape] for shape in stage_weights} == stage_weights
    assert not set(weights) & set(converted), converted
    assert conditionals(text) == conditionals(lowered_pipeline("model.dtype=bfloat16", *overrides))
