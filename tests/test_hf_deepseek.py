"""DeepSeek-V3 weights in and out (jaxscale/hf/convert_deepseek.py): the logits of a converted tiny random
``DeepseekV3ForCausalLM`` against transformers' own (MLA with interleaved rotary columns, group-limited sigmoid
routing, shared experts, a dense first layer), and a bit-exact round trip with the MTP layer."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxscale.checkpoint import params as checkpoint
from jaxscale.config.read import load_config
from jaxscale.hf import convert
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_helpers import at, drawn, hf_logits, random_params, rel_err  # noqa: E402

RTOL = 1e-4
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=5000.0)
MESH = {"data": 1, "stage": 1, "fsdp": 2, "context": 1, "expert": 2, "tensor": 2}


def hf_model(**extra):
    """A tiny random HF DeepSeek-V3 (:func:`hf_helpers.drawn`)."""
    config = transformers.DeepseekV3Config(**{**SIZES, **extra})
    torch.manual_seed(0)
    return drawn(transformers.DeepseekV3ForCausalLM(config))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, SIZES["vocab_size"], (4, 16), dtype=np.int32)


class Forward:
    """The model of ``model_yaml`` under ep_fsdp_tp (expert 2 x fsdp 2 x tensor 2): logits of a checkpoint's weights."""

    def __init__(self, model_yaml: Path):
        overrides = [f"model={model_yaml}", "rules=ep_fsdp_tp", *(f"mesh.{k}={v}" for k, v in MESH.items()),
                     "train.global_batch=4", "train.seq_len=16"]
        self.trainer = Trainer.build(load_config(None, overrides))

    def logits(self, ckpt: Path, x: np.ndarray) -> np.ndarray:
        params = checkpoint.restore_params(checkpoint.params_source(ckpt), self.trainer.abstract_state().params)
        return np.asarray(self.trainer.logits(params, x))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    hf = hf_model()
    hf.save_pretrained(root / "hf", max_shard_size="100KB")
    convert.hf_to_jaxscale(root / "hf", root / "ckpt")
    return hf, root / "ckpt", Forward(root / "ckpt" / "model.yaml")


def test_converted_deepseek_logits_match_transformers(converted):
    hf, ckpt, forward = converted
    x = tokens()
    ours = forward.logits(ckpt, x)
    assert rel_err(ours, hf_logits(hf, x)) < RTOL
    model = load_config(None, [f"model={ckpt / 'model.yaml'}"]).model
    d, moe = model.deepseek, model.moe
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (32, 16, 16, 8, 16)
    assert (d.dense_layers, d.routed_scale, d.mtp_depth) == (1, 2.5, 0)  # transformers' model has no MTP layer
    assert (moe.router, moe.groups, moe.top_groups, moe.shared_experts, moe.mlp) == ("sigmoid", 4, 2, 1, 32)
    shapes = checkpoint.param_shapes(checkpoint.params_source(ckpt))
    assert sum(math.prod(shape) for shape in shapes.values()) == hf.num_parameters()
    # The rotary columns' order shows: the same weights read as rotate-half pairs give other logits.
    halves = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SIZES, rope_interleave=False)).eval()
    halves.load_state_dict(hf.state_dict())
    assert rel_err(ours, hf_logits(halves, x)) > 100 * RTOL


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory):
    """The converted model with one MTP depth, random parameters, exported to HF (the MTP layer as layer 3)."""
    root = tmp_path_factory.mktemp("exported")
    base = load_config(None, [f"model={converted[1] / 'model.yaml'}"]).model
    model = dataclasses.replace(base, deepseek=dataclasses.replace(base.deepseek, mtp_depth=1))
    # Drawn wide enough (0.25) that the logits, and so the losses, tell the weights' roles apart.
    params = random_params(model, seed=1, scale=0.25)
    checkpoint.save_params(root / "ours", params, dataclasses.asdict(model))
    files = convert.jaxscale_to_hf(root / "ours", root / "hf", max_shard_mb=0.1)
    assert len(files) > 1
    return model, params, root


def test_deepseek_round_trip_with_mtp_is_bit_exact_and_transformers_loads_the_export(converted, exported, tmp_path):
    forward = converted[2]
    model, params, root = exported
    (tmp_path / "mtp.yaml").write_text("deepseek:\n  mtp_depth: 1\n")
    convert.hf_to_jaxscale(root / "hf", tmp_path / "back", override=str(tmp_path / "mtp.yaml"))
    back = checkpoint.params_source(tmp_path / "back")
    table = convert.weights(model)
    assert any(w.path[0] == "mtp" for w in table)
    for w in table:
        if w.balance:  # the routing biases: none saved, so exported as zeros and read back as zeros
            assert not checkpoint.read_param(checkpoint.balance_source(back), w.path).any()
            continue
        saved, again = at(params, w.path), checkpoint.read_param(back, w.path)
        assert again.dtype == saved.dtype and np.array_equal(again, saved), w.path
    # transformers reads the main model and skips the MTP layer; its logits are ours.
    exported_hf = transformers.DeepseekV3ForCausalLM.from_pretrained(root / "hf").eval()
    plain = dataclasses.replace(model, deepseek=dataclasses.replace(model.deepseek, mtp_depth=0))
    main_params = {k: v for k, v in params.items() if k != "mtp"}
    checkpoint.save_params(tmp_path / "main", main_params, dataclasses.asdict(plain))
    x = tokens()
    assert rel_err(forward.logits(tmp_path / "main", x), hf_logits(exported_hf, x)) < RTOL


def mtp_reference(hf_dir: Path, x: np.ndarray) -> float:
    """DeepSeek-V3's MTP loss of depth 1 written here with transformers' modules, from the exported tensors: the
    main model's last layer output h (before the final norm), then eh_proj([enorm(emb(t[i+1])); hnorm(h[i])]),
    transformers' decoder layer (MoE) under a causal mask, shared_head.norm, the shared head; the mean
    cross-entropy against t[i+2]."""
    from safetensors.numpy import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_modules

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    cfg, layers = hf.config, hf.config.num_hidden_layers
    prefix = f"model.layers.{layers}."
    tensors = {}
    for file in hf_dir.glob("*.safetensors"):
        found = load_file(file)
        tensors.update({k[len(prefix):]: torch.from_numpy(v) for k, v in found.items() if k.startswith(prefix)})
    layer = hf_modules.DeepseekV3DecoderLayer(cfg, layer_idx=layers).eval()
    experts = range(cfg.n_routed_experts)
    state = {k: v for k, v in tensors.items() if k.split(".")[0] in ("self_attn", "input_layernorm",
                                                                     "post_attention_layernorm")}
    state.update({k: v for k, v in tensors.items() if k.startswith(("mlp.gate.", "mlp.shared_experts."))})
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
         for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    state["mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.n_routed_experts)
    layer.load_state_dict(state)

    def norm(name: str):
        module = hf_modules.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        module.weight.data = tensors[f"{name}.weight"]
        return module

    captured = {}
    hf.model.layers[-1].register_forward_hook(lambda m, args, out: captured.setdefault("h", out))
    ids = torch.from_numpy(x).long()
    with torch.no_grad():
        hf.model(ids)
        h = captured["h"][:, :-1]
        emb = hf.model.embed_tokens(ids[:, 1:])
        joined = torch.cat([norm("enorm")(emb), norm("hnorm")(h)], -1) @ tensors["eh_proj.weight"].T
        s = joined.shape[1]
        positions = torch.arange(s)[None].expand(x.shape[0], s)
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = layer(joined, attention_mask=mask, position_embeddings=hf.model.rotary_emb(joined, positions))
        logits = hf.lm_head(norm("shared_head.norm")(out))[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1)))


def test_mtp_loss_is_deepseek_v3s(exported):
    _, params, root = exported
    overrides = [f"model={root / 'ours' / 'model.yaml'}", "rules=dp", "mesh.data=1", "train.global_batch=4",
                 "train.seq_len=16"]
    trainer = Trainer.build(load_config(None, overrides), jax.devices()[:1])
    x = tokens()
    # The next tokens as targets, the row's last untrained: depth 1 then trains t + 2 < length, as the reference.
    targets = np.concatenate([x[:, 1:], np.full_like(x[:, :1], -1)], axis=1)
    batch = {"inputs": x, "targets": targets,
             "positions": np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape)}
    _, metrics = jax.jit(trainer.loss_and_metrics)(params, batch)
    assert rel_err(metrics["mtp_loss"], mtp_reference(root / "hf", x)) < RTOL


def test_routing_biases_are_imported_into_the_run_state_and_exported_bit_exact(converted, tmp_path):
    """DeepSeek-V3's ``e_score_correction_bias`` (a buffer, not a parameter: transformers' ``drawn`` leaves it
    zero) drawn non-zero: ``checkpoint.init_from``'s state holds it and gives transformers' logits; the export
    gives back every tensor of the original, bit for bit."""
    forward = converted[2]
    hf = hf_model()
    with torch.no_grad():
        for layer in hf.model.layers[SIZES["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(SIZES["n_routed_experts"]))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "ckpt")
    state = checkpoint.init_state_from(forward.trainer, tmp_path / "ckpt")
    biases = jax.device_get(state.balance["blocks"]["routed"]["bias"])
    want = [layer.mlp.gate.e_score_correction_bias.numpy() for layer in hf.model.layers[1:]]
    np.testing.assert_array_equal(biases, np.stack(want))

    trainer = forward.trainer
    x = tokens()
    ref = hf_logits(hf, x)
    assert rel_err(jax.device_get(trainer.logits(state, x)), ref) < RTOL
    # The biases choose the experts: without them (bare parameters: a fresh run's zeros) another model's logits.
    assert rel_err(jax.device_get(trainer.logits(state.params, x)), ref) > 100 * RTOL

    convert.jaxscale_to_hf(tmp_path / "ckpt", tmp_path / "back", max_shard_mb=0.1)
    original, back = (load_tensors(tmp_path / d) for d in ("hf", "back"))
    # 3 (embedding, final norm, head) + 12 (the dense layer: 9 of attention and norms, 3 of the MLP)
    # + 2 x 38 (each MoE layer: 9 of attention and norms, the router and its bias, 8 x 3 experts, 3 shared).
    assert len(original) == 3 + 12 + 2 * 38 == 91
    assert sorted(back) == sorted(original)
    for name, value in original.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name


def test_non_zero_routing_biases_into_a_model_without_them_are_one_line(converted, tmp_path):
    hf = hf_model()
    with torch.no_grad():
        hf.model.layers[2].mlp.gate.e_score_correction_bias[3] = 0.5
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "off.yaml").write_text("moe:\n  balance: 'off'\n")
    with pytest.raises(convert.ConfigError, match=r"hf: non-zero model\.layers\.\*\.mlp\.gate\.e_score_correction_bias "
                       r"\(routing biases, which choose the experts\) and model\.moe\.balance is off"):
        convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "ckpt", override=str(tmp_path / "off.yaml"))


def load_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory's safetensors files, by name."""
    from safetensors.numpy import load_file

    return {k: v for file in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(file).items()}


@pytest.mark.slow
def test_a_runs_trained_routing_biases_are_exported(converted, tmp_path):
    """A run started from a converted DeepSeek-V3 moves the biases it started from (sign balancing); its
    checkpoint's export holds the moved ones (float32)."""
    hf = hf_model()
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(SIZES["n_routed_experts"]))
    hf.save_pretrained(tmp_path / "hf")
    convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "ckpt")
    overrides = [f"model={tmp_path / 'ckpt' / 'model.yaml'}", "model.moe.bias_rate=0.01", "rules=dp", "mesh.data=1",
                 "train.global_batch=4", "train.seq_len=16", "train.steps=2", "checkpoint.every=2",
                 f"checkpoint.init_from={tmp_path / 'ckpt'}", f"run_dir={tmp_path / 'run'}"]
    state, _ = fit(Trainer.build(load_config(None, overrides), jax.devices()[:1]), progress=False)
    trained = jax.device_get(state.balance["blocks"]["routed"]["bias"])
    started = np.stack([layer.mlp.gate.e_score_correction_bias.numpy() for layer in hf.model.layers[1:]])
    # Two sign steps of 0.01 from where it started (not from zero): each bias moved by 0, 0.01 or 0.02, not all stayed.
    moved = np.abs(trained - started) * 100
    assert np.allclose(moved, np.round(moved), atol=1e-3) and moved.max() < 2.001 and moved.max() > 0.5
    convert.jaxscale_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "back")
    back = load_tensors(tmp_path / "back")
    exported = np.stack([back[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2)])
    assert exported.dtype == np.float32 and np.array_equal(exported, trained)
