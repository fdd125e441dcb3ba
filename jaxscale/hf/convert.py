"""Hugging Face weights in and out: Llama, Mixtral, Qwen3-MoE and DeepSeek-V3 safetensors <-> jaxscale
parameters checkpoints.

``jaxscale convert hf-to-jaxscale --from HF_DIR --to CKPT_DIR`` reads a local
Hugging Face directory (``config.json`` and ``*.safetensors``, one file or
shards listed by ``model.safetensors.index.json``) of a ``LlamaForCausalLM``,
``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM`` (its table:
:mod:`jaxscale.hf.convert_deepseek`) and writes a parameters checkpoint
(:func:`jaxscale.checkpoint.params.save_params`): ``CKPT_DIR/params`` (orbax) and
``CKPT_DIR/model.yaml``, the jaxscale model generated from ``config.json`` (:mod:`jaxscale.hf.models`;
``--config`` layers a model YAML over it: compute dtype, remat, MoE dispatch), and ``CKPT_DIR/balance``
for DeepSeek-V3's routing biases.
``checkpoint.init_from: CKPT_DIR`` starts a run from it.
``jaxscale convert jaxscale-to-hf --from CKPT_DIR --to HF_DIR`` goes back,
from a converted checkpoint or a run's checkpoint directory (its latest step),
to safetensors shards of at most ``--max-shard-mb`` with their index and a
``config.json`` that ``from_pretrained`` reads.

The layouts (HF ``nn.Linear`` weights are ``[out, in]``; ours ``[in..., out...]``,
layers stacked on a leading axis, experts on the next):

=========================================  =========================================
Hugging Face, layer ``i``, expert ``e``     jaxscale
=========================================  =========================================
``model.embed_tokens.weight [V, D]``        ``embedding [V, D]``
``self_attn.q_proj.weight [H·Dh, D]``       ``blocks.attn.wq [L, D, H, Dh]`` (transpose)
``self_attn.k_proj/v_proj [K·Dh, D]``       ``blocks.attn.wk/wv [L, D, K, Dh]``
``self_attn.o_proj.weight [D, H·Dh]``       ``blocks.attn.wo [L, H, Dh, D]``
``mlp.gate_proj/up_proj [F, D]``            ``blocks.mlp.w_gate/w_up [L, D, F]``
``mlp.down_proj [D, F]``                    ``blocks.mlp.w_down [L, F, D]``
``block_sparse_moe.gate [E, D]``            ``blocks.blocks.0.mlp.router [L, D, E]``
``block_sparse_moe.experts.e.w1/w3 [F, D]`` ``blocks.blocks.0.mlp.w_gate/w_up [L, E, D, F]``
``block_sparse_moe.experts.e.w2 [D, F]``    ``blocks.blocks.0.mlp.w_down [L, E, F, D]``
``mlp.gate``, ``mlp.experts.e.*_proj``        the same, Qwen3-MoE's names (``gate_proj/up_proj/down_proj``)
``self_attn.q_norm/k_norm.weight [Dh]``     ``blocks.attn.q_norm/k_norm.scale [L, Dh]``
``input_layernorm / post_attention_...``    ``blocks.attn_norm / mlp_norm.scale [L, D]``
``model.norm.weight``, ``lm_head [V, D]``   ``final_norm.scale``, ``lm_head [D, V]``
=========================================  =========================================

RoPE: HF checkpoints already hold q/k in the rotate-half layout that
:func:`jaxscale.models.llama.rope` uses, so the heads need only a reshape (no
permutation); the tests check the logits. Tied embeddings: no ``lm_head`` either
way. Mixtral's router (softmax over all experts, top-k, gates renormalised) is
``router: softmax, normalize_gates: true``; Qwen3-MoE's is the same with ``normalize_gates`` its
``norm_topk_prob``, its q/k norms ``model.qk_norm``, its ``decoder_sparse_step`` ``every_n_layers``
(HF layer ``g·n + j`` is block ``j`` of group ``g``: ``blocks.blocks.j``; the last of each group is the MoE
one in both), its dense layers' width ``intermediate_size`` ``model.mlp``
(``mlp_only_layers`` is refused). Their routers are a weight and nothing else (transformers' Mixtral and
Qwen3-MoE hold no buffer or other state), so a checkpoint trained with ``model.moe.balance`` whose routing
biases are not zero is refused on export (its routing would differ); DeepSeek-V3's biases are exported.
The generated model uses dropless dispatch (capacity dispatch may drop tokens that HF keeps); HF's
``router_aux_loss_coef`` counts a loss ``top_k`` times ours. What has no
jaxscale equivalent (``rope_scaling``/``rope_parameters`` other than the default
and Llama 3.1's ``llama3``, biases, a sliding window, another activation) is a :class:`ConfigError`.
Fused projections (``model.fused_projections``, :mod:`jaxscale.models.fusion`): the import always
writes the separate layout (``checkpoint.init_from`` fuses it for a fused run); the export of a fused
checkpoint splits ``w_qkv`` and ``w_gate_up`` into the same HF tensors, bit for bit.
``head_dim`` may differ from ``hidden_size / num_attention_heads`` (``model.head_dim``). The export writes
a ``llama3`` scaling as Llama 3.1's own ``config.json`` does: ``rope_scaling`` with a top-level ``rope_theta``.

Streaming: safetensors files are read tensor by tensor (``safe_open``, numpy;
bf16 comes as ``ml_dtypes.bfloat16``) into one stacked array per parameter
at a time, so host memory holds the model once (the arrays orbax writes) plus
one HF tensor; the export reads one parameter at a time (orbax partial restore)
and holds at most one parameter and one shard. We write the mapping ourselves:
it is a table of names and transposes, and neither ``transformers`` nor
``torch`` is needed to run it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxscale.checkpoint.params import (
    PARAMS_DIR,
    ParamsSource,
    balance_source,
    by_name,
    param_shapes,
    params_source,
    read_all,
    read_param,
    save_params,
)
from jaxscale.config.read import (
    Config,
    ConfigError,
    ModelConfig,
    _build,
    read_yaml,
    resolve_named,
)
from jaxscale.hf import convert_deepseek as deepseek
from jaxscale.hf.models import ARCHITECTURES, architecture, check_model, hf_config, layer_over, model_from_hf, read_json
from jaxscale.hf.weights import Weight, bias_shape, hf_shape, put, slices, to_hf, to_ours
from jaxscale.models.fusion import separate_reader
from jaxscale.training.trainer import abstract_model

INDEX = "model.safetensors.index.json"
HF_CONFIG = "hf_config.json"  # the imported config.json, kept next to the checkpoint for the way back
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def weights(model: ModelConfig) -> list[Weight]:
    """The table of every parameter of ``model``: a Llama, a Mixtral (an MoE block every layer), a
    Qwen3-MoE (qk-norm; an MoE block every ``every_n_layers``, dense ones between), or a DeepSeek-V3
    (:mod:`jaxscale.hf.convert_deepseek`)."""
    if model.deepseek is not None:
        return deepseek.weights(model)
    table = [
        Weight(("embedding",), "model.embed_tokens.weight", None),
        Weight(("final_norm", "scale"), "model.norm.weight", None),
    ]
    n = model.moe.every_n_layers if model.moe else 1
    for j in range(n):
        table += _block(model, ("blocks", "blocks", j) if model.moe else ("blocks",), j, n)
    if not model.tie_embeddings:
        table.append(Weight(("lm_head",), "lm_head.weight"))
    return table


def _block(model: ModelConfig, block: tuple[str | int, ...], j: int, n: int) -> list[Weight]:
    """The weights of block ``j`` of each stacked group of ``n`` (HF layers ``g·n + j``); the last is MoE."""
    layer = functools.partial(Weight, first=j, every=n)
    at = "model.layers.{i}."
    table = [
        layer((*block, "attn", "wq"), at + "self_attn.q_proj.weight"),
        layer((*block, "attn", "wk"), at + "self_attn.k_proj.weight"),
        layer((*block, "attn", "wv"), at + "self_attn.v_proj.weight"),
        layer((*block, "attn", "wo"), at + "self_attn.o_proj.weight", 2),
        layer((*block, "attn_norm", "scale"), at + "input_layernorm.weight", None),
        layer((*block, "mlp_norm", "scale"), at + "post_attention_layernorm.weight", None),
    ]
    if model.qk_norm:
        table += [layer((*block, "attn", f"{x}_norm", "scale"), at + f"self_attn.{x}_norm.weight", None) for x in "qk"]
    if model.moe and j == n - 1:
        mixtral = architecture(model) == "mixtral"
        moe = at + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        table.append(layer((*block, "mlp", "router"), moe + "gate.weight"))
        return table + [layer((*block, "mlp", ours), moe + f"experts.{{e}}.{hf}.weight")
                        for ours, hf in zip(("w_gate", "w_up", "w_down"), names, strict=True)]
    return table + [layer((*block, "mlp", ours), at + f"mlp.{hf}_proj.weight")
                    for ours, hf in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))]


# -- Hugging Face -> jaxscale -----------------------------------------------------------------------------


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor: from the index json, or from the one file's header."""
    index = hf_dir / INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"{index}: no 'weight_map' of tensor names to files")
        absent = sorted({f for f in weight_map.values() if not (hf_dir / f).is_file()})
        if absent:
            raise ConfigError(f"{index}: names {absent[0]}, which is not in {hf_dir}")
        return {name: hf_dir / file for name, file in weight_map.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{hf_dir}: no *.safetensors file (PyTorch .bin checkpoints are not read)")
    where = {}
    with ExitStack() as stack:
        for file in files:
            where.update(dict.fromkeys(_open_tensors(stack, file).keys(), file))
    return where


def _open_tensors(stack: ExitStack, file: Path) -> Any:
    """A safetensors file opened inside ``stack``; a one-line :class:`ConfigError` if it is not one."""
    try:
        return stack.enter_context(_safetensors().safe_open(file, framework="numpy"))
    except ConfigError:
        raise
    except Exception as e:  # safetensors' own error, or the OS's
        raise ConfigError(f"{file}: not a readable safetensors file ({_reason(e)})") from e


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _safetensors() -> Any:
    """The safetensors package (the ``hf`` extra), or a one-line error saying how to install it."""
    try:
        import safetensors.numpy
    except ImportError as e:
        raise ConfigError("converting Hugging Face weights needs safetensors: pip install 'jaxscale[hf]'") from e
    return safetensors


def hf_to_jaxscale(hf_dir: str | Path, out_dir: str | Path, override: str | None = None) -> ModelConfig:
    """Convert the HF directory ``hf_dir`` into a parameters checkpoint in ``out_dir``; returns its model."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").exists():
        raise ConfigError(f"{hf_dir}: no config.json (a local Hugging Face model directory is needed)")
    _check_target(out_dir)
    if (out_dir / PARAMS_DIR).exists():
        raise ConfigError(f"{out_dir / PARAMS_DIR} already exists: choose another directory")
    hf = read_json(hf_dir / "config.json")
    # The separate projections' layout whatever --config says: a fused run converts it at checkpoint.init_from.
    model = dataclasses.replace(layer_over(model_from_hf(hf), override), fused_projections=False)
    check_model(model)
    where = _tensor_files(hf_dir)
    table = weights(model)
    expected = {tensor for w in table for _, tensor in slices(w, model)}
    # A routing bias absent from the files is zero, as transformers initialises it.
    missing = sorted(expected - set(where) - {t for w in table if w.balance for _, t in slices(w, model)})
    if missing:
        raise ConfigError(f"{hf_dir}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")
    left_out = {t for t in where if model.deepseek is not None and deepseek.left_out(model, t)}
    unused = sorted(set(where) - expected - left_out - ({"lm_head.weight"} if model.tie_embeddings else set()))
    if unused:
        raise ConfigError(f"{hf_dir}: tensors with no place in the jaxscale model: {', '.join(unused[:5])}")
    shapes = by_name(abstract_model(Config(model=model))[1])
    params: dict[str, Any] = {}
    biases: dict[str, Any] = {}
    with ExitStack() as stack:
        handles = {file: _open_tensors(stack, file) for file in set(where.values())}
        for w in table:
            if not w.balance:
                value = _read_weight(handles, where, w, model, shapes[".".join(map(str, w.path))].shape)
                put(params, w.path, value)
                continue
            value = _read_weight(handles, where, w, model, bias_shape(w, model))
            if model.moe.balance != "off":
                put(biases, w.path, value)
            elif value.any():
                raise ConfigError(f"{hf_dir}: non-zero {w.hf.format(i='*')} (routing biases, which choose the "
                                  "experts) and model.moe.balance is off: keep it on to import them")
    save_params(out_dir, params, dataclasses.asdict(model), biases)
    (out_dir / HF_CONFIG).write_text(json.dumps(hf, indent=2))
    return model


def _read_weight(handles: dict[Path, Any], where: dict[str, Path], w: Weight, model: ModelConfig,
                 full: tuple[int, ...]) -> np.ndarray:
    """Our stacked array of ``full`` shape for ``w``, read tensor by tensor from the open files ``handles``
    (a routing bias float32, zero where the files have none; a parameter in ``model.param_dtype``)."""
    value = np.zeros(full, np.float32 if w.balance else NUMPY_DTYPES[model.param_dtype])
    inner = full[w.layered + w.expert :]
    for index, tensor in slices(w, model):
        if w.balance and tensor not in where:
            continue
        try:
            hf_value = handles[where[tensor]].get_tensor(tensor)
        except Exception as e:  # a file cut short after its header
            raise ConfigError(f"{where[tensor]}: tensor {tensor} does not read ({_reason(e)})") from e
        if hf_value.shape != hf_shape(w, inner):
            implied = hf_shape(w, inner)
            raise ConfigError(f"{where[tensor]}: tensor {tensor} is {hf_value.shape}, config.json implies {implied}")
        value[index] = to_ours(w, hf_value, inner)
        if not np.isfinite(value[index]).all():
            raise ConfigError(f"{where[tensor]}: tensor {tensor} holds NaN or infinite values")
    return value


# -- jaxscale -> Hugging Face -----------------------------------------------------------------------------


def _check_target(out_dir: Path) -> None:
    """``--to`` must be a directory, or not exist yet."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--to {out_dir} is a file, not a directory")


def _source(ckpt: str | Path, override: str | None) -> tuple[ParamsSource, ModelConfig]:
    source = params_source(ckpt)
    raw = source.model if override is None else read_yaml(resolve_named(override, "models"))
    model = _build(ModelConfig, raw, "model")
    check_model(model)
    return source, model


def _write_shard(out_dir: Path, number: int, tensors: dict[str, np.ndarray]) -> str:
    name = f"model-{number:05d}.safetensors.part"
    _safetensors().numpy.save_file(tensors, out_dir / name, metadata={"format": "pt"})
    mask = os.umask(0o022)  # the umask, read by setting it (and back): safetensors writes 0600 whatever it is
    os.umask(mask)
    os.chmod(out_dir / name, 0o666 & ~mask)
    return name


def jaxscale_to_hf(
    ckpt: str | Path, out_dir: str | Path, override: str | None = None, dtype: str | None = None,
    max_shard_mb: float = 2000.0,
) -> list[Path]:
    """Export the parameters at ``ckpt`` (converted or a run's) as an HF directory; returns the shard files
    (written with the user's umask, as the other files)."""
    if not max_shard_mb > 0:
        raise ConfigError(f"--max-shard-mb must be positive (MiB per safetensors file), got {max_shard_mb:g}")
    source, model = _source(ckpt, override)
    dtype = dtype or model.param_dtype
    if dtype not in NUMPY_DTYPES:
        raise ConfigError(f"--dtype: '{dtype}' is not one of {', '.join(NUMPY_DTYPES)}")
    config = hf_config(model, dtype, _imported_config(Path(ckpt)))
    read = _reader(source, model, ckpt)
    out_dir = Path(out_dir)
    _check_target(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if list(out_dir.glob("*.safetensors")):
        raise ConfigError(f"{out_dir} already holds safetensors files: choose an empty directory")
    limit = max_shard_mb * 2**20
    shards: list[str] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}
    size = total = 0
    for w in weights(model):
        value = read(w)
        for index, tensor in slices(w, model):
            kind = np.float32 if w.balance else NUMPY_DTYPES[dtype]
            hf_value = np.ascontiguousarray(to_hf(w, value[index]).astype(kind))
            if pending and size + hf_value.nbytes > limit:
                shards.append(_write_shard(out_dir, len(shards) + 1, pending))
                pending, size = {}, 0
            pending[tensor] = hf_value
            weight_map[tensor] = len(shards)
            size += hf_value.nbytes
            total += hf_value.nbytes
        del value
    shards.append(_write_shard(out_dir, len(shards) + 1, pending))
    if len(shards) == 1:
        final = ["model.safetensors"]
    else:
        final = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        index = {"metadata": {"total_size": total}, "weight_map": {t: final[k] for t, k in sorted(weight_map.items())}}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
    for part, name in zip(shards, final, strict=True):
        (out_dir / part).rename(out_dir / name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return [out_dir / name for name in final]


def _reader(source: ParamsSource, model: ModelConfig, ckpt: str | Path) -> Callable[[Weight], np.ndarray]:
    """Our stacked array of a table's weight read from ``source``: a parameter (in the separate layout from a
    fused run's), or the routing biases kept with it (zeros where it keeps none); non-zero biases of a model
    whose HF architecture has no place for them (Mixtral, Qwen3-MoE) are a one-line ConfigError."""
    read = functools.partial(read_param, source)
    if model.fused_projections:  # a fused run's parameters, exported as the separate HF tensors
        read = separate_reader(read, set(param_shapes(source)))
    biases = balance_source(source)
    if biases is not None and model.deepseek is None and any(np.any(b) for b in read_all(biases).values()):
        raise ConfigError(f"{ckpt}: non-zero MoE routing biases (model.moe.balance), which choose the experts and "
                          f"{ARCHITECTURES[architecture(model)]} has no place for: its routing would differ")

    def one(w: Weight) -> np.ndarray:
        if not w.balance:
            return read(w.path)
        return np.zeros(bias_shape(w, model), np.float32) if biases is None else read_param(biases, w.path)

    return one


def _imported_config(ckpt: Path) -> dict[str, Any] | None:
    path = ckpt / HF_CONFIG
    return read_json(path) if path.exists() else None


def main(direction: str, source: str, target: str, override: str | None, dtype: str | None, max_shard_mb: float) -> str:
    """The ``convert`` command; returns the line it prints."""
    if direction == "hf-to-jaxscale":
        model = hf_to_jaxscale(source, target, override)
        if model.deepseek is not None:
            kind = f"DeepSeek-V3 ({model.moe.experts} routed experts, MTP depth {model.deepseek.mtp_depth})"
        else:
            kind = {"llama": "Llama", "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[architecture(model)]
            kind = f"{model.moe.experts}-expert {kind}" if model.moe else kind
        return f"{target}: {kind}, {model.layers} layers; model config in {Path(target) / 'model.yaml'}"
    files = jaxscale_to_hf(source, target, override, dtype, max_shard_mb)
    return f"{target}: {len(files)} safetensors file{'s' * (len(files) > 1)} and config.json"
