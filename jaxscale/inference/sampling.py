"""New tokens from a trained state: greedy or temperature / top-k sampling, with a key/value cache where
the model has one.

:func:`generate` continues prompts ``[batch, length]`` by ``max_new_tokens``:

* **The built-in Llama-style models** (Mixtral-style included) decode with a key/value cache
  (:mod:`jaxscale.models.decode`): the prompt in one step (the prefill), then one token at a time, each at its
  position; two compiled steps in all.
* **Any other model** (DeepSeek-V3, a user's) runs :meth:`~jaxscale.training.trainer.Trainer.logits` over a window of
  the prompt and every new token so far, the positions not yet generated padded with token 0, and reads the
  logits of the last token generated: a causal model's logits never see later positions, so this is the
  forward of the tokens so far, recomputed each step (one compiled forward). (A mixture of experts with
  capacity dispatch is the exception: the padding competes for its experts' capacity.)

Each step picks the next token of every row from its float32 logits: the largest (``temperature`` 0, greedy),
or drawn from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (0: all), the draws
seeded by ``seed`` (the same seed, the same tokens). With ``stop`` (an end-of-document id) generation ends
early once every row has produced it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.config.read import ConfigError
from jaxscale.models import decode
from jaxscale.training import forward


class Generated(NamedTuple):
    tokens: np.ndarray  # [batch, new] int32: the tokens generated (fewer than asked when every row stopped)
    logits: np.ndarray  # [batch, new, vocab] float32: the logits each was picked from


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"))
def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """The next token of each row of float32 ``logits`` ``[batch, vocab]`` (the module docstring)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def check(prompt: np.ndarray, vocab: int, max_new_tokens: int, temperature: float, top_k: int) -> None:
    """One line for what :func:`generate` cannot run."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ConfigError(f"generate: the prompt must be [batch, length] tokens, length >= 1; got {prompt.shape}")
    if max_new_tokens < 1:
        raise ConfigError(f"generate: --max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"generate: --temperature must be 0 (greedy) or more, got {temperature}")
    if not 0 <= top_k <= vocab:
        raise ConfigError(f"generate: --top-k must be between 0 (all) and the vocabulary ({vocab}), got {top_k}")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ConfigError(f"generate: the prompt holds token id {int(prompt.max())}, not below model.vocab_size "
                          f"({vocab}): a tokenizer of another model?")


class _Cached:
    """The built-in model's decode: the prompt's step, then a step per token, on a key/value cache."""

    def __init__(self, trainer: Any, state_or_params: Any, prompt: np.ndarray, total: int):
        self.weights, self.prompt, self.index = forward.unpack(trainer, state_or_params), prompt, 0
        self.cache = decode.empty(trainer.config.model, prompt.shape[0], total)
        self.step = jax.jit(functools.partial(_decode, trainer), donate_argnums=3)

    def start(self) -> jax.Array:
        return self._run(self.prompt)[:, -1]

    def advance(self, token: np.ndarray) -> jax.Array:
        return self._run(token[:, None])[:, 0]

    def _run(self, tokens: np.ndarray) -> jax.Array:
        positions = np.broadcast_to(np.arange(self.index, self.index + tokens.shape[1], dtype=np.int32), tokens.shape)
        logits, self.cache = self.step(self.weights, tokens, positions, self.cache, np.int32(self.index))
        self.index += tokens.shape[1]
        return logits


def _decode(trainer: Any, weights: tuple, tokens: jax.Array, positions: jax.Array, cache: decode.Cache,
            index: jax.Array) -> tuple[jax.Array, decode.Cache]:
    logits, cache = decode.step(forward.merged(trainer, *weights), tokens, positions, cache, index)
    return logits.astype(jnp.float32), cache


class _Recomputed:
    """Any model: :meth:`~jaxscale.training.trainer.Trainer.logits` of the tokens so far, padded to the whole window."""

    def __init__(self, trainer: Any, state_or_params: Any, prompt: np.ndarray, total: int):
        self.trainer, self.state, self.index = trainer, state_or_params, prompt.shape[1]
        self.window = np.zeros((prompt.shape[0], total), np.int32)
        self.window[:, : self.index] = prompt

    def start(self) -> jax.Array:
        return self.trainer.logits(self.state, self.window)[:, self.index - 1]

    def advance(self, token: np.ndarray) -> jax.Array:
        self.window[:, self.index] = token
        self.index += 1
        return self.start()


def generate(
    trainer: Any, state_or_params: Any, prompt: Any, max_new_tokens: int, temperature: float = 0.0,
    top_k: int = 0, seed: int = 0, stop: int | None = None, cache: bool = True,
) -> Generated:
    """``max_new_tokens`` new tokens after each row of ``prompt`` ``[batch, length]`` of ``trainer``'s model
    holding ``state_or_params`` (a ``TrainState`` or parameters, as :meth:`~jaxscale.training.trainer.Trainer.logits`
    takes them); the module docstring. ``cache=False``: the recomputed forward even for a built-in model."""
    prompt = np.asarray(prompt, np.int32)
    check(prompt, trainer.config.model.vocab_size, max_new_tokens, temperature, top_k)
    kind = _Cached if cache and trainer.builtin_model else _Recomputed
    runner = kind(trainer, state_or_params, prompt, prompt.shape[1] + max_new_tokens)
    key, last = jax.random.key(seed), runner.start()
    tokens, logits = [], []
    for i in range(max_new_tokens):
        logits.append(np.asarray(last))
        tokens.append(np.asarray(pick(last, jax.random.fold_in(key, i), float(temperature), int(top_k))))
        if i + 1 == max_new_tokens or (stop is not None and (tokens[-1] == stop).all()):
            break
        last = runner.advance(tokens[-1])
    return Generated(np.stack(tokens, 1), np.stack(logits, 1))
