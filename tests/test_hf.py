"""Hugging Face weights in and out: logits of converted tiny Llama and Mixtral models against transformers'
own, bit-exact round trips, fine-tuning from a converted checkpoint, and the errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxscale.checkpoint import params as checkpoint
from jaxscale.cli import main
from jaxscale.config import flops
from jaxscale.config.read import Config, ConfigError, load_config
from jaxscale.hf import convert
from jaxscale.inference import generate, sampling
from jaxscale.models import fusion
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer, abstract_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_helpers import at, drawn, hf_logits, random_params, rel_err  # noqa: E402

RTOL = 1e-4
SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             head_dim=8, intermediate_size=128, rope_theta=5000.0, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# Llama: fsdp_tp on fsdp=4 x tensor=2. Mixtral: 4 experts of width 64, ep_fsdp_tp on expert=2 x fsdp=2 x
# tensor=2, dropless dispatch (the generated model's; capacity dispatch could drop tokens HF keeps).
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "fsdp_tp", {"fsdp": 4, "tensor": 2}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, "fsdp_tp",
                   {"fsdp": 4, "tensor": 2}),
    # Llama 3.1: llama3 rope scaling whose three bands (kept, smoothed, divided) all hold pairs of the
    # 16-wide heads at rope_theta 5000, and head_dim 16 where hidden_size / heads is 8.
    "llama31": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 16, "rope_scaling": LLAMA3}, "fsdp_tp",
                {"fsdp": 4, "tensor": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}, "ep_fsdp_tp",
                {"expert": 2, "fsdp": 2, "tensor": 2}),
    # Qwen3-MoE: q/k norms, head_dim 16 (hidden_size / heads is 8), 4 layers with an MoE one every 2nd
    # (decoder_sparse_step; dense ones of width 128 between), 4 experts of width 32, gates not renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_hidden_layers": 4, "decoder_sparse_step": 2, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False},
                  "ep_fsdp_tp", {"expert": 2, "fsdp": 2, "tensor": 2}),
}


def hf_model(case: str, seed: int = 0):
    """A tiny random HF model of ``case`` (:func:`hf_helpers.drawn`)."""
    config_cls, model_cls, extra, _, _ = CASES[case]
    config = getattr(transformers, config_cls)(**{**SIZES, **extra})
    torch.manual_seed(seed)
    return drawn(getattr(transformers, model_cls)(config))


def tokens(rows: int = 4, length: int = 16) -> np.ndarray:
    return np.random.default_rng(0).integers(0, SIZES["vocab_size"], (rows, length), dtype=np.int32)


def layout(case: str, ckpt: Path, *overrides: str) -> list[str]:
    _, _, _, rules, mesh = CASES[case]
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "ulysses": 1, "expert": 1, "tensor": 1, **mesh}
    return [f"model={ckpt / 'model.yaml'}", f"rules={rules}", *(f"mesh.{k}={v}" for k, v in sizes.items()),
            *overrides]


class Converted:
    """One case converted from HF: the HF model, the checkpoint, a trainer on the case's layout, a jitted forward."""

    def __init__(self, case: str, root: Path):
        self.case, self.hf = case, hf_model(case)
        self.hf_dir, self.ckpt = root / "hf", root / "ckpt"
        self.hf.save_pretrained(self.hf_dir, max_shard_size="100KB")
        convert.hf_to_jaxscale(self.hf_dir, self.ckpt)
        config = load_config(None, layout(case, self.ckpt, "train.global_batch=4", "train.seq_len=16"))
        self.trainer = Trainer.build(config)

    def params(self, ckpt: Path):
        return checkpoint.restore_params(checkpoint.params_source(ckpt), self.trainer.abstract_state().params)

    def logits(self, ckpt: Path, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.trainer.logits(self.params(ckpt), tokens))


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    return Converted(request.param, tmp_path_factory.mktemp(request.param))


def test_converted_logits_match_transformers(converted):
    x = tokens()
    assert len(list(converted.hf_dir.glob("*.safetensors"))) > 1  # sharded, read through the index
    assert rel_err(converted.logits(converted.ckpt, x), hf_logits(converted.hf, x)) < RTOL
    model = load_config(None, layout(converted.case, converted.ckpt)).model
    assert model.kv_heads < model.heads
    assert model.rope_theta == SIZES["rope_theta"] and model.norm_eps == SIZES["rms_norm_eps"]
    assert model.tie_embeddings == (converted.case == "llama_tied")
    assert model.qk_norm == (converted.case == "qwen3_moe")
    if converted.case == "llama31":
        assert model.head_dim * model.heads != model.embed
        assert model.rope_scaling.factor == 8.0 and model.rope_scaling.original_max_position_embeddings == 64
        # The scaling shows in the logits: the same weights under plain RoPE are far from ours.
        plain = transformers.LlamaConfig(**{**SIZES, "head_dim": 16})
        unscaled = transformers.LlamaForCausalLM(plain).eval()
        unscaled.load_state_dict(converted.hf.state_dict())
        assert rel_err(converted.logits(converted.ckpt, x), hf_logits(unscaled, x)) > 100 * RTOL
    if converted.case == "qwen3_moe":
        assert model.head_dim * model.heads != model.embed and not model.moe.normalize_gates
        assert (model.moe.every_n_layers, model.moe.mlp, model.mlp) == (2, 32, 128)
    shapes = checkpoint.param_shapes(checkpoint.params_source(converted.ckpt))
    assert sum(math.prod(shape) for shape in shapes.values()) == converted.hf.num_parameters()


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(converted, tmp_path):
    model = load_config(None, layout(converted.case, converted.ckpt)).model
    params = random_params(model, seed=1)
    jax_ckpt = tmp_path / "jaxscale"
    checkpoint.save_params(jax_ckpt, params, dataclasses.asdict(model))
    files = convert.jaxscale_to_hf(jax_ckpt, tmp_path / "hf", max_shard_mb=0.1)
    assert len(files) > 1 and (tmp_path / "hf" / convert.INDEX).exists()
    convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "back")
    back = checkpoint.params_source(tmp_path / "back")
    for w in convert.weights(model):
        saved, again = at(params, w.path), checkpoint.read_param(back, w.path)
        assert again.dtype == saved.dtype and np.array_equal(again, saved), w.path
    exported = getattr(transformers, CASES[converted.case][1]).from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    assert rel_err(converted.logits(jax_ckpt, x), hf_logits(exported, x)) < RTOL


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> tuple[object, Path]:
    """The tiny HF Llama and its converted checkpoint."""
    root = tmp_path_factory.mktemp("finetune")
    model = hf_model("llama", seed=3)
    model.save_pretrained(root / "hf")
    convert.hf_to_jaxscale(root / "hf", root / "ckpt")
    return model, root / "ckpt"


def test_finetune_from_converted_checkpoint_starts_at_the_hf_loss(llama_ckpt, tmp_path):
    model, ckpt = llama_ckpt
    # Another layout than the conversion's: fsdp=2 x tensor=4.
    overrides = [f"model={ckpt / 'model.yaml'}", "rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4",
                 "train.global_batch=4", "train.seq_len=32", "train.steps=1", "train.log_every=1",
                 "data.max_bytes=200000", "checkpoint.every=1", f"checkpoint.init_from={ckpt}",
                 f"run_dir={tmp_path / 'run'}"]
    trainer = Trainer.build(load_config(None, overrides))
    state, history = fit(trainer, progress=False)
    batch = jax.device_get(trainer.batch(0))
    with torch.no_grad():
        logits = model(torch.tensor(batch["inputs"]).long()).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                    torch.tensor(batch["targets"]).long().reshape(-1))
    first = next(r for r in history if "loss" in r)
    assert first["step"] == 0 and int(state.step) == 1
    assert abs(first["loss"] - float(hf_loss)) < 1e-5 * float(hf_loss)

    # Resume wins over init_from: the run goes on from its own checkpoint of step 1 (on the schedule it
    # was built with: train.schedule_steps keeps the first run's length, as the optimizer was built).
    trainer.config.train.steps, trainer.config.train.schedule_steps, trainer.config.checkpoint.resume = 2, 1, "auto"
    state, history = fit(trainer, progress=False)
    assert [r["step"] for r in history if "loss" in r] == [1] and int(state.step) == 2

    # The run's checkpoint (step 2) exports to HF and back to exactly its parameters.
    convert.jaxscale_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "back")
    back = checkpoint.params_source(tmp_path / "back")
    trained = jax.device_get(state.params)
    for w in convert.weights(trainer.config.model):
        assert np.array_equal(checkpoint.read_param(back, w.path), at(trained, w.path)), w.path


def test_init_from_a_mismatched_model_is_a_config_error(llama_ckpt, tmp_path):
    _, ckpt = llama_ckpt
    base = [f"model={ckpt / 'model.yaml'}", "rules=dp", "mesh.data=8", "train.global_batch=8", "train.seq_len=16",
            f"checkpoint.init_from={ckpt}", f"run_dir={tmp_path / 'run'}"]
    trainer = Trainer.build(load_config(None, [*base, "model.mlp=96"]))
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from: .* has model\.mlp=128, the config has 96$"):
        fit(trainer, progress=False)
    assert "compiled_guarded_step" not in trainer.__dict__ and "jit_init" not in trainer.__dict__

    # A saved array whose shape the model file does not explain (the shape check behind the key check).
    config = load_config(None, base)
    params = random_params(config.model, seed=0)
    params["embedding"] = params["embedding"][:128]
    checkpoint.save_params(tmp_path / "bad", params, dataclasses.asdict(config.model))
    abstract = abstract_model(config)[1]
    with pytest.raises(ConfigError, match=r"parameter embedding of .* is \(128, 64\), the config needs \(256, 64\)$"):
        checkpoint.check_params(checkpoint.params_source(tmp_path / "bad"), "checkpoint.init_from", config, abstract)
    with pytest.raises(ConfigError, match=r"not a parameters checkpoint"):
        checkpoint.params_source(tmp_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         r"llama3 rope scaling without low_freq_factor, high_freq_factor$"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, r"0 < low_freq_factor \(4\.0\) < high_freq_factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope scaling 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, r"rope scaling 'yarn' is not supported"),
        ({"attention_bias": True}, r"attention_bias=true"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"model_type": "qwen2"}, r"model_type 'qwen2' is not one of llama, mixtral, qwen3_moe, deepseek_v3$"),
        ({"model_type": "qwen3_moe", "moe_intermediate_size": 32, "mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
        ({"model_type": "qwen3_moe", "moe_intermediate_size": 32, "decoder_sparse_step": 3},
         r"num_hidden_layers \(2\) is not a multiple of decoder_sparse_step \(3\)$"),
        ({"model_type": "qwen3_moe", "sliding_window": 64, "use_sliding_window": True}, r"sliding_window=64"),
        ({"model_type": "mixtral", "sliding_window": 4096}, r"sliding_window=4096"),
    ],
)
def test_unsupported_hf_config_is_a_config_error(tmp_path, change, match):
    hf = {"model_type": "llama", **SIZES, **change}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=match):
        convert.hf_to_jaxscale(tmp_path, tmp_path / "out")


def test_bf16_checkpoint_and_the_command_line(llama_ckpt, tmp_path, capsys):
    model, ckpt = llama_ckpt
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf16")
    model.float()
    assert main(["convert", "hf-to-jaxscale", "--from", str(tmp_path / "hf16"), "--to", str(tmp_path / "ckpt16"),
                 "--config", str(write_yaml(tmp_path / "over.yaml", "dtype: bfloat16\nremat: full\n"))]) == 0
    assert "ckpt16: Llama, 2 layers" in capsys.readouterr().out
    wide, narrow = checkpoint.params_source(ckpt), checkpoint.params_source(tmp_path / "ckpt16")
    assert narrow.model["dtype"] == "bfloat16" and narrow.model["remat"] == "full"
    for w in convert.weights(load_config(None, [f"model={ckpt / 'model.yaml'}"]).model):
        exact = checkpoint.read_param(wide, w.path).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(checkpoint.read_param(narrow, w.path), exact), w.path
    assert main(["convert", "jaxscale-to-hf", "--from", str(tmp_path / "ckpt16"), "--to", str(tmp_path / "out"),
                 "--dtype", "bfloat16"]) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.dtype == torch.bfloat16
    for name, p in model.to(torch.bfloat16).state_dict().items():
        assert torch.equal(exported.state_dict()[name], p), name
    model.float()
    assert main(["convert", "hf-to-jaxscale", "--from", str(tmp_path / "hf16"), "--to", str(tmp_path / "x"),
                 "--config", str(write_yaml(tmp_path / "bad.yaml", "mlp: 96\n"))]) == 2
    assert capsys.readouterr().err.strip().endswith("model.mlp=96, config.json has 128")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file({"model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)},
                                tmp_path / "hf16" / "extra.safetensors")
    with pytest.raises(ConfigError, match=r"no place in the jaxscale model: model\.layers\.0\.mlp\.up_proj\.bias"):
        convert.hf_to_jaxscale(tmp_path / "hf16", tmp_path / "y")


def test_qwen3_moe_config_and_its_export_refusals():
    hf = {"model_type": "qwen3_moe", **SIZES, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
          "norm_topk_prob": True,
          "sliding_window": 4096, "use_sliding_window": False, "router_aux_loss_coef": 0.001}
    model = convert.model_from_hf(hf)
    assert model.qk_norm and model.moe.normalize_gates and model.moe.dispatch == "dropless"
    assert (model.moe.experts, model.moe.top_k, model.moe.mlp, model.moe.every_n_layers) == (4, 2, 32, 1)
    assert model.moe.aux_loss_weight == pytest.approx(0.002)  # HF's loss counts top_k times ours
    shapes = abstract_model(Config(model=model))[1]
    assert flops.param_count(model)["total"] == sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
    with pytest.raises(ConfigError, match=r"^model\.moe\.shared_experts=1: Qwen3MoeForCausalLM needs 0$"):
        convert.hf_config(dataclasses.replace(model, moe=dataclasses.replace(model.moe, shared_experts=1)), "float32")
    with pytest.raises(ConfigError, match=r"^model\.qk_norm without model\.moe: only Qwen3-MoE"):
        convert.hf_config(dataclasses.replace(model, moe=None), "float32")


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_fused_projections_restore_from_and_export_to_the_separate_layout(llama_ckpt, tmp_path):
    """``model.fused_projections``: an HF-converted (separate) checkpoint restores into a fused model as
    ``fusion.fuse`` of its parameters, a fused checkpoint back into a separate model, and the fused run's
    export is the same HF tensors, bit for bit."""
    _, ckpt = llama_ckpt
    source = checkpoint.params_source(ckpt)
    model = load_config(None, [f"model={ckpt / 'model.yaml'}"]).model
    shapes = abstract_model(Config(model=model))[1]
    separate = jax.tree_util.tree_map_with_path(
        lambda path, _: checkpoint.read_param(source, tuple(k.key for k in path)), shapes
    )
    base = [f"model={ckpt / 'model.yaml'}", "rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4",
            "train.global_batch=4", "train.seq_len=32"]
    fused_trainer = Trainer.build(load_config(None, [*base, "model.fused_projections=true"]))
    fused = jax.device_get(checkpoint.init_state_from(fused_trainer, ckpt).params)
    jax.tree.map(np.testing.assert_array_equal, fused, fusion.fuse(separate))
    fused_model = dataclasses.replace(model, fused_projections=True)
    checkpoint.save_params(tmp_path / "fused", fused, dataclasses.asdict(fused_model))
    back = jax.device_get(checkpoint.init_state_from(Trainer.build(load_config(None, base)), tmp_path / "fused").params)
    jax.tree.map(np.testing.assert_array_equal, back, separate)
    convert.jaxscale_to_hf(tmp_path / "fused", tmp_path / "hf")
    convert.hf_to_jaxscale(tmp_path / "hf", tmp_path / "again")
    again = checkpoint.params_source(tmp_path / "again")
    for w in convert.weights(model):
        assert np.array_equal(checkpoint.read_param(again, w.path), at(separate, w.path)), w.path


def test_the_tiny_qwen3_moe_config_converts_and_trains_a_step(tmp_path):
    """configs/models/qwen3-moe-tiny.yaml: random weights exported to HF load in transformers, and a run started
    from them under ep_fsdp_tp (expert 2 x fsdp 2 x tensor 2) trains a step whose loss is transformers' loss."""
    model = load_config(None, ["model=qwen3-moe-tiny"]).model
    assert (model.qk_norm, model.head_dim * model.heads != model.embed, model.moe.every_n_layers) == (True, True, 1)
    checkpoint.save_params(tmp_path / "ours", random_params(model, seed=2, scale=0.25), dataclasses.asdict(model))
    convert.jaxscale_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (hf.config.num_experts, hf.config.num_experts_per_tok, hf.config.norm_topk_prob) == (8, 2, True)
    overrides = ["model=qwen3-moe-tiny", "model.moe.aux_loss_weight=0", "rules=ep_fsdp_tp", "mesh.data=1",
                 "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch=4", "train.seq_len=16",
                 "train.steps=1", "train.log_every=1", f"checkpoint.init_from={tmp_path / 'ours'}",
                 f"run_dir={tmp_path / 'run'}"]
    trainer = Trainer.build(load_config(None, overrides))
    state, history = fit(trainer, progress=False)
    batch = jax.device_get(trainer.batch(0))
    logits = torch.from_numpy(hf_logits(hf, np.array(batch["inputs"])))
    hf_loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                      torch.tensor(batch["targets"]).long().reshape(-1)))
    first = next(r for r in history if "loss" in r)
    assert int(state.step) == 1 and abs(first["loss"] - hf_loss) < 1e-5 * hf_loss


def test_non_zero_routing_biases_of_a_mixtral_are_refused_on_export(tmp_path):
    """transformers' Mixtral router is a weight alone: a checkpoint whose routing biases (model.moe.balance) are
    not zero would export another routing, and is refused in one line, nothing written."""
    model = load_config(None, ["model=moe-tiny", "model.moe.balance=sign"]).model
    assert convert.architecture(model) == "mixtral"
    bias = np.zeros((model.layers, model.moe.experts), np.float32)
    bias[1, 3] = 0.01
    balance = {"blocks": {"blocks": {0: {"mlp": {"bias": bias}}}}}
    checkpoint.save_params(tmp_path / "ours", random_params(model, seed=0), dataclasses.asdict(model), balance)
    with pytest.raises(ConfigError, match=r"ours: non-zero MoE routing biases \(model\.moe\.balance\), which choose "
                       r"the experts and MixtralForCausalLM has no place for: its routing would differ$"):
        convert.jaxscale_to_hf(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_generate_on_a_converted_llama_is_transformers_greedy(llama_ckpt, capsys):
    model, ckpt = llama_ckpt
    prompt = np.frombuffer(b"Hello", np.uint8).astype(np.int32)[None]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf = model.generate(torch.from_numpy(prompt).long(), generation_config=config).numpy()[0, prompt.shape[1]:]
    settings, _, directory = generate.saved_settings(ckpt)
    trainer = Trainer.build(generate.one_device_config(settings), jax.devices()[:1])
    ours = sampling.generate(trainer, generate.restored(trainer, directory), prompt, 8).tokens[0]
    np.testing.assert_array_equal(ours, hf)  # with the key/value cache (the model has GQA: kv_heads < heads)
    assert main(["generate", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "8", "--tokenizer", "byte"]) == 0
    assert capsys.readouterr().out == "Hello" + bytes(hf.tolist()).decode("utf-8", errors="replace") + "\n"
