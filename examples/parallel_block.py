"""A research twist, in the richer form of the model contract (docs/models.md): parallel attention and MLP
branches (GPT-J, PaLM) with QK-norm, the layers stacked so that pipeline parallelism can split them.

Built from jaxscale.nn: RMSNorm and SwiGLU with their lean backward, rotary embeddings, and the attention
kernel the config and the rules pick (ring attention where the rules split the sequence).
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxscale
from jaxscale import nn


def param(rngs, c, shape, names):
    return nnx.Param(c.init_std * jax.random.normal(rngs.params(), shape, c.param_dtype), out_sharding=names)


class ParallelBlock(nnx.Module):
    """``x + attention(norm(x)) + mlp(norm(x))``; queries and keys RMS-normed per head before the rotation."""

    def __init__(self, config, rngs):
        c = self.c = config.model
        self.norm = nn.RMSNorm(c.embed, eps=c.norm_eps)
        self.q_norm, self.k_norm = (nn.RMSNorm(c.head_dim, eps=c.norm_eps, axis="head_dim") for _ in range(2))
        self.wq = param(rngs, c, (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, c, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, c, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, c, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"))
        self.w_gate = param(rngs, c, (c.embed, c.mlp), ("embed", "mlp"))
        self.w_up = param(rngs, c, (c.embed, c.mlp), ("embed", "mlp"))
        self.w_down = param(rngs, c, (c.mlp, c.embed), ("mlp", "embed"))

    def __call__(self, x, positions):
        """One layer of the stack: its output and its metrics (none)."""
        c, h = self.c, self.norm(x)
        q = nn.rope(self.q_norm(jnp.einsum("bse,ehd->bshd", h, self.wq[...])), positions, c.rope_theta)
        k = nn.rope(self.k_norm(jnp.einsum("bse,ehd->bshd", h, self.wk[...])), positions, c.rope_theta)
        v = jnp.einsum("bse,ehd->bshd", h, self.wv[...])
        q, k, v = nn.constrain(q, nn.Q_AXES), nn.constrain(k, nn.KV_AXES), nn.constrain(v, nn.KV_AXES)
        attn = jnp.einsum("bshd,hde->bse", nn.constrain(nn.attention(q, k, v, c), nn.Q_AXES), self.wo[...])
        gate, up = (nn.constrain(h @ w[...], nn.MLP_AXES) for w in (self.w_gate, self.w_up))
        return nn.constrain(x + attn + nn.swiglu(gate, up) @ self.w_down[...], nn.RESIDUAL), {}


class ParallelLM(nnx.Module):
    """The richer form: ``embedding``/``embed``, the stacked ``blocks``, ``final_norm``, the head."""

    def __init__(self, config, rngs):
        c = self.config = config.model
        self.embedding = param(rngs, c, (c.vocab_size, c.embed), ("vocab", "embed"))

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):
            return ParallelBlock(config, rngs)

        self.blocks = stack(rngs)
        self.final_norm = nn.RMSNorm(c.embed, eps=c.norm_eps)
        self.lm_head = param(rngs, c, (c.embed, c.vocab_size), ("embed", "vocab"))

    def embed(self, tokens):
        return nn.constrain(jnp.take(self.embedding[...], tokens, axis=0), nn.RESIDUAL)

    def hidden(self, tokens, positions):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(x, block):
            return block(x, positions)

        x, metrics = run(self.embed(tokens), self.blocks)
        return self.final_norm(x), metrics

    def head_weight(self):
        return self.lm_head[...]

    def logits(self, x):
        return nn.constrain(x @ self.head_weight(), nn.LOGITS)

    def aux_loss(self, metrics):
        return 0.0

    def __call__(self, tokens, positions):
        return self.logits(self.hidden(tokens, positions)[0])


if __name__ == "__main__":
    jaxscale.simulate_devices(8)  # before jax's first computation
    overrides = ["rules=pp_fsdp_tp", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.schedule=1f1b",
                 "train.steps=20", "run_dir=/tmp/jaxscale-parallel"]
    config = jaxscale.load_config("tiny", overrides)
    trainer = jaxscale.Trainer.build(config, model=ParallelLM)  # 2 pipeline stages x FSDP x TP
    print("losses", [round(r["loss"], 3) for r in trainer.fit(progress=False)[1] if "loss" in r])
