"""``jaxscale generate``: text from a run's latest checkpoint or a converted checkpoint, on one device.

``PATH`` is a run directory (its ``checkpoints/``), a checkpoint directory (``checkpoint.dir``: its latest
complete step) or a parameters checkpoint (``params/`` and ``model.yaml``, as ``jaxscale convert
hf-to-jaxscale`` writes it). The model is built on one device from the checkpoint's own model and precision
settings (``model.attention: auto``: the kernel this device runs), and reads the parameters straight
from the checkpoint (a pipeline's layer stack into the model's order; a run's full-precision weights, cast to the
compute dtype), with a run's fp8 amax histories and MoE routing biases; no optimizer state is read.

The tokenizer (``--tokenizer`` wins): a run's own, from its ``data`` settings (``builtin`` and ``stdlib``: bytes;
a ``prepare-data`` directory: the one it was written with; a raw source: ``data.tokenizer``); for a
parameters checkpoint, a ``tokenizer.json`` beside its ``model.yaml``, else ``--tokenizer`` is needed.
The tokens are drawn by :func:`jaxscale.inference.sampling.generate` (a key/value cache for the built-in Llama-style
models, the recomputed forward for others), stopping at the tokenizer's end of document; the prompt and
its continuation are printed.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxscale.checkpoint import params as checkpoint_params
from jaxscale.checkpoint import store as checkpoint
from jaxscale.checkpoint.restack import convert_params, read_as
from jaxscale.config.read import Config, ConfigError, _build, validate
from jaxscale.config.schema import MESH_AXES
from jaxscale.data.prepare import ByteTokenizer, TokenDir, Tokenizer, make_tokenizer
from jaxscale.data.tokencache import is_prepared
from jaxscale.inference import sampling
from jaxscale.training.trainer import Trainer

TOKENIZER_JSON = "tokenizer.json"


def saved_settings(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None, Path]:
    """The model and precision settings at ``path`` (the module docstring), a run's ``data`` settings (None for
    a parameters checkpoint), and the directory holding the parameters."""
    root = Path(path).absolute()
    if not root.exists():
        raise ConfigError(f"generate: {root} does not exist (a run directory, a checkpoint directory or a "
                          "converted checkpoint)")
    if (root / checkpoint_params.PARAMS_DIR).is_dir():
        return {"model": checkpoint_params.params_source(root).model}, None, root
    directory = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    checkpointer = checkpoint.Checkpointer(directory, async_save=False)
    try:
        step = checkpointer.latest_step()
        if step is None:
            raise ConfigError(
                f"generate: no complete checkpoint in {directory} (a run saves them with checkpoint.every > 0; "
                f"a converted checkpoint holds {checkpoint_params.PARAMS_DIR}/ and {checkpoint_params.MODEL_FILE})"
            )
        saved = checkpointer.read_json(step).config
    finally:
        checkpointer.close()
    return {"model": saved["model"], "precision": saved.get("precision", {})}, saved.get("data", {}), directory


def one_device_config(settings: dict[str, Any]) -> Config:
    """An experiment of one device around the saved model and precision settings."""
    model = {**settings["model"], "attention": "auto", "remat": "none"}  # no backward: nothing recomputed
    config = _build(Config, {**settings, "model": model, "rules": "dp", "mesh": dict.fromkeys(MESH_AXES, 1)})
    validate(config)
    return config


class _NoStateMetadata(logging.Filter):
    """Drop orbax's warning that a run's ``state`` item, read as a tree of its own, has no metadata file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Metadata file does not exist")


def restored(trainer: Trainer, directory: Path) -> Any:
    """A run's parameters, fp8 histories and routing biases (a ``TrainState``'s fields, as
    :meth:`~jaxscale.training.trainer.Trainer.logits` takes them), or a parameters checkpoint's parameters."""
    quiet = _NoStateMetadata()
    logging.getLogger("absl").addFilter(quiet)
    try:
        return _restored(trainer, directory)
    finally:
        logging.getLogger("absl").removeFilter(quiet)


def _restored(trainer: Trainer, directory: Path) -> Any:
    source = checkpoint_params.params_source(directory)
    abstract = trainer.abstract_state()
    in_source = read_as(abstract.params, source.storage, trainer.mesh)
    checkpoint_params.check_params(source, "generate", trainer.config, in_source)

    def read(prefix: tuple[str, ...], target: Any) -> Any:
        saved = read_as(target, source.storage, trainer.mesh)
        found = checkpoint_params.restore_params(dataclasses.replace(source, prefix=prefix), saved)
        return convert_params(found, source.storage, trainer.storage, jax.tree.map(lambda a: a.sharding, target))

    params = read(source.prefix, abstract.params)
    if not source.prefix:  # a parameters checkpoint: bare parameters
        return params
    fp8_state = read(("fp8",), abstract.fp8) if abstract.fp8 else {}
    bias = read(("balance",), abstract.balance) if abstract.balance else {}
    return abstract._replace(params=params, fp8=fp8_state, balance=bias)


def tokenizer_of(spec: str | None, data: dict[str, Any] | None, directory: Path) -> Tokenizer:
    """``--tokenizer`` ``spec``, else the run's (``data``), else a ``tokenizer.json`` beside the parameters."""
    if spec:
        return make_tokenizer(spec)
    if data is None:
        if (directory / TOKENIZER_JSON).is_file():
            return make_tokenizer(str(directory / TOKENIZER_JSON))
        raise ConfigError(f"generate: {directory} names no tokenizer: give --tokenizer byte or a tokenizer.json")
    if data.get("source", "builtin") in ("builtin", "stdlib"):
        return ByteTokenizer()
    path = data.get("path") or (data.get("mixture") or [{}])[0].get("path")
    if path and is_prepared(Path(path)):
        return TokenDir.open(path).tokenizer()
    return make_tokenizer(data.get("tokenizer") or "byte")


def text(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    """The text of ``ids``, up to the first end-of-document; bytes that are not UTF-8 shown as U+FFFD."""
    ids = [int(i) for i in ids]
    if tokenizer.eod_id in ids:
        ids = ids[: ids.index(tokenizer.eod_id)]
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(ids).decode("utf-8", errors="replace")
    return tokenizer.decode(ids)


def main(path: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
         tokenizer: str | None) -> str:
    """The prompt and its continuation by the model at ``path`` (the module docstring)."""
    if not prompt:
        raise ConfigError("generate: --prompt is empty: give the text to continue")
    settings, data, directory = saved_settings(path)
    tok = tokenizer_of(tokenizer, data, directory)
    ids = tok.encode_batch([prompt])[0].astype(np.int32)[None]
    trainer = Trainer.build(one_device_config(settings), jax.devices()[:1])
    sampling.check(ids, trainer.config.model.vocab_size, max_new_tokens, temperature, top_k)
    state = restored(trainer, directory)
    out = sampling.generate(trainer, state, ids, max_new_tokens, temperature, top_k, seed, stop=tok.eod_id)
    return prompt + text(tok, out.tokens[0])
