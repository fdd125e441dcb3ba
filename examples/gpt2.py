"""GPT-2 brought to jaxscale: LayerNorm with bias, a GELU MLP, learned positions, the head tied to the embedding."""

from flax import nnx

import jaxscale
from jaxscale import nn

EMBED = {"out_sharding": ("embed",)}  # Flax's own metadata: the logical name of each dimension


def layer_norm(c, rngs):
    return nnx.LayerNorm(c.embed, scale_metadata=EMBED, bias_metadata=EMBED, rngs=rngs)


def dense(n_in, n_out, names_in, names_out, rngs, axis=-1):  # the logical names of the in and out dimensions
    meta = {"kernel_metadata": {"out_sharding": names_in + names_out}, "bias_metadata": {"out_sharding": names_out}}
    return nnx.LinearGeneral(n_in, n_out, axis=axis, **meta, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, config, rngs):
        c = self.c = config.model
        self.ln1, self.ln2 = layer_norm(c, rngs), layer_norm(c, rngs)
        heads, names = (c.heads, c.head_dim), ("heads", "head_dim")
        self.q, self.k, self.v = (dense(c.embed, heads, ("embed",), names, rngs) for _ in range(3))
        self.out = dense(heads, c.embed, names, ("embed",), rngs, axis=(-2, -1))
        self.up = dense(c.embed, c.mlp, ("embed",), ("mlp",), rngs)
        self.down = dense(c.mlp, c.embed, ("mlp",), ("embed",), rngs)

    def __call__(self, x):
        h = self.ln1(x)
        q, k, v = (nn.constrain(proj(h), nn.Q_AXES) for proj in (self.q, self.k, self.v))
        x = nn.constrain(x + self.out(nn.attention(q, k, v, self.c)), nn.RESIDUAL)
        h = nn.constrain(nnx.gelu(self.up(self.ln2(x))), nn.MLP_AXES)
        return nn.constrain(x + self.down(h), nn.RESIDUAL)


class GPT2(nnx.Module):
    def __init__(self, config, rngs):
        c = config.model
        self.wte = nnx.Embed(c.vocab_size, c.embed, embedding_metadata={"out_sharding": ("vocab", "embed")}, rngs=rngs)
        rows = {"out_sharding": (None, "embed")}  # learned positions (None: a dimension never split)
        self.wpe = nnx.Embed(config.train.seq_len, c.embed, embedding_metadata=rows, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(c.layers)])
        self.ln_f = layer_norm(c, rngs)

    def __call__(self, tokens, positions):
        x = nn.constrain(self.wte(tokens) + self.wpe(positions), nn.RESIDUAL)
        for block in self.blocks:
            x = block(x)
        return nn.constrain(self.wte.attend(self.ln_f(x)), nn.LOGITS)  # the tied head


if __name__ == "__main__":
    jaxscale.simulate_devices(8)  # before jax's first computation
    overrides = ["rules=fsdp_tp_sp", "train.steps=10", "run_dir=/tmp/jaxscale-gpt2"]  # tiny.yaml's model sizes
    config = jaxscale.load_config("tiny", overrides)
    trainer = jaxscale.Trainer.build(config, model=GPT2)  # FSDP x TP x SP on 8 devices, by the rules table
    print("losses", [round(r["loss"], 3) for r in trainer.fit(progress=False)[1] if "loss" in r])
