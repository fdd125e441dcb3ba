"""What the Hugging Face tests share: tiny random transformers models, their logits, and our parameters drawn
and read back by a conversion table's paths (torch and transformers imported by the caller's importorskip)."""

from __future__ import annotations

import jax
import numpy as np

from jaxscale.config.read import Config, ModelConfig
from jaxscale.training.trainer import abstract_model


def drawn(model):
    """``model`` (a transformers model, built after the caller's ``torch.manual_seed``) with every weight drawn
    from torch's generator, the norm scales around 1 (so swapping two is seen), in eval mode."""
    import torch

    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max())


def random_params(model: ModelConfig, seed: int, scale: float = 0.08) -> dict:
    """Parameters of ``model`` drawn at random on the host (norm scales included), N(0, ``scale``)."""
    rng = np.random.default_rng(seed)
    shapes = abstract_model(Config(model=model))[1]
    return jax.tree.map(lambda a: rng.normal(0, scale, a.shape).astype(np.float32), shapes)


def at(params: dict, path: tuple) -> np.ndarray:
    """The parameter at a conversion table's ``path`` (:class:`jaxscale.hf.weights.Weight`)."""
    for key in path:
        params = params[key]
    return params
