"""Expert parallelism on moe-tiny, measured from compiled steps: prints one JSON object.

* ``all_to_all``: for each expert-parallel size and both dispatch implementations
  (``shard_map``: jaxscale/parallel/expert.py; ``partitioner``: GShard einsum
  dispatch with the rules table alone), the wire bytes per device of the
  collectives over the ``expert`` axis per MoE layer per step, forward and
  backward, parsed from the compiled HLO (:mod:`jaxscale.analysis.hlo`), next to
  docs/formulas.md's ``2·k·b·s·h·bytes·(ep−1)/ep`` each way and to that formula
  times ``E·C / (k·s)``, the padding of fixed-size capacity buffers. Dropless
  dispatch (all-gather + reduce-scatter on XLA:CPU) is listed too, next to
  its own figure ``2·(ep−1)·b·s·h·bytes`` each way.
* ``dropless_exchange``: dropless dispatch's two exchanges under ``ep`` 4 and 8 for one
  moe-tiny MoE layer (forward and backward, the experiment's batch), its router scaled
  so that routing is uneven, and pulled further towards one expert for a second row:
  ``rows`` (jaxscale/parallel/exchange.py; its loop's all-to-alls from the compiled HLO
  times the trip count the routing gives) next to ``2·k·b·s·h·bytes·(ep−1)/ep`` times
  the measured imbalance (the largest count a device sends a shard over the mean), each
  way, and to the ``all_gather`` path's compiled bytes.
* ``memory``: compiled per-device memory (``memory_analysis``) and the train
  state's bytes per device versus ep, with the rest of the 8 devices as data.
* ``dropped``: the fraction of top-k choices dropped at capacity factors 1.0,
  1.25 and 2.0 at the start and after 50 steps of moe-tiny (its experiment:
  ep_fsdp, expert=4 x fsdp=2).

Usage: ``python benchmarks/moe_ep.py [--steps 50] [--tables dropless_exchange,...] > moe_ep.json``
(8 simulated CPU devices).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.analysis import hlo, xla
from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import Rules, use_rules
from jaxscale.models import moe
from jaxscale.ops import routing as kernels
from jaxscale.parallel import exchange
from jaxscale.training.loop import fit
from jaxscale.training.trainer import Trainer

EXPERIMENT = CONFIG_DIR / "experiments" / "moe-tiny.yaml"


def config(*overrides: str):
    return load_config(EXPERIMENT, list(overrides))


def ep_mesh(ep: int) -> list[str]:
    """Rules ``ep``: ``ep`` devices of experts, the rest of the 8 data parallel."""
    return ["rules=ep", "mesh.fsdp=1", f"mesh.expert={ep}", f"mesh.data={8 // ep}"]


def expert_collectives(trainer: Trainer) -> dict[str, dict[str, float]]:
    """Wire bytes per device per MoE layer per step of the collectives over ``expert``, by kind and phase."""
    compiled = xla.compile_step(trainer)
    c = trainer.config.model
    moe_layers = c.layers // c.moe.every_n_layers * trainer.config.train.microbatches
    out: dict[str, dict[str, float]] = {}
    for x in hlo.collectives(compiled.as_text(), trainer.mesh):
        if x.axes is None or "expert" not in x.axes:
            continue
        row = out.setdefault(x.kind, {"forward": 0.0, "backward": 0.0, "other": 0.0})
        phase = x.phase if x.phase in ("forward", "backward") else "other"
        row[phase] += x.wire_bytes / moe_layers
    return out


def all_to_all_table() -> list[dict]:
    rows = []
    for ep in (2, 4, 8):
        for impl, dispatch in (("shard_map", "capacity"), ("partitioner", "capacity"), ("shard_map", "dropless")):
            cfg = config(*ep_mesh(ep), f"model.moe.impl={impl}", f"model.moe.dispatch={dispatch}")
            trainer = Trainer.build(cfg)
            m, t, mesh = cfg.model, cfg.train, trainer.mesh
            b = t.global_batch // (t.microbatches * mesh.shape["data"] * mesh.shape["fsdp"] * ep)
            nbytes = np.dtype(m.dtype).itemsize
            formula = 2 * m.moe.top_k * b * t.seq_len * m.embed * nbytes * (ep - 1) / ep
            padding = m.moe.experts * kernels.capacity(m.moe, t.seq_len) / (m.moe.top_k * t.seq_len)
            measured = expert_collectives(trainer)
            row = {
                "ep": ep,
                "impl": impl,
                "dispatch": dispatch,
                "sequences_per_device": b,
                "formula_each_way": formula,
                "measured": measured,
            }
            if dispatch == "capacity":
                row["formula_x_capacity_padding_each_way"] = formula * padding
                row["all_to_all_each_way"] = {p: measured.get("all-to-all", {}).get(p, 0.0)
                                              for p in ("forward", "backward")}
            else:
                row["allgather_reducescatter_formula_each_way"] = 2 * (ep - 1) * b * t.seq_len * m.embed * nbytes
            rows.append(row)
            print(f"all_to_all: ep={ep} {impl} {dispatch} done", file=sys.stderr)
    return rows


def layer_bytes(cfg, params: dict, x: jax.Array) -> list[hlo.Collective]:
    """The collectives of one MoE layer's forward and backward (to its input too, as in a model) over the
    expert axis, inside its shard_map."""
    with nnx.use_eager_sharding(False):
        graphdef = nnx.split(moe.MoE(cfg, nnx.Rngs(0)))[0]
    mesh = make_mesh(cfg.mesh)

    probe = jax.random.normal(jax.random.key(2), x.shape)  # a loss whose gradient XLA cannot fold away

    def loss(params: dict, x: jax.Array) -> jax.Array:
        with use_rules(mesh, Rules.load(cfg.rules)):
            return jnp.sum(nnx.merge(graphdef, params)(x)[0] * probe)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exchange loop's trip count is the routing's
        found = hlo.collectives(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text(), mesh)
    return [c for c in found if c.axes == ("expert",) and "shard_map" in c.op_name]


def dropless_exchange_table() -> list[dict]:
    rows = []
    for ep in (4, 8):
        for pull in (0.0, 1.0):
            cfg = config(*ep_mesh(ep), "model.moe.dispatch=dropless")
            m, t = cfg.model, cfg.train
            with nnx.use_eager_sharding(False):
                params = nnx.to_pure_dict(nnx.split(moe.MoE(cfg, nnx.Rngs(0)))[1])
            params["router"] = params["router"] * 30
            toward = np.asarray(params["router"][:, 0]) / np.linalg.norm(params["router"][:, 0])
            x = np.asarray(jax.random.normal(jax.random.key(1), (t.global_batch, t.seq_len, m.embed)), np.float32)
            x = jnp.asarray(x + pull * toward, jnp.float32)
            # The routing decisions, counted per device (its rows of the batch) and destination shard.
            index = np.argsort(-np.einsum("bsd,de->bse", x, params["router"]), axis=-1, kind="stable")
            shard = index[..., : m.moe.top_k] // (m.moe.experts // ep)
            b = t.global_batch // 8
            most = max(np.bincount(shard[d * b:(d + 1) * b].ravel(), minlength=ep).max() for d in range(8))
            n = b * t.seq_len * m.moe.top_k
            trips = math.ceil(most / exchange.chunk_rows(n, ep))
            found = layer_bytes(cfg, params, x)
            looped = [c for c in found if c.kind == "all-to-all" and c.loops and c.loops[-1].trips is None]
            measured = sum(c.wire_bytes * trips for c in looped) + sum(c.wire_bytes for c in found if c not in looped)
            gathered = layer_bytes(config(*ep_mesh(ep), "model.moe.dispatch=dropless",
                                          "model.moe.dropless_exchange=all_gather"), params, x)
            formula = 2 * m.moe.top_k * b * t.seq_len * m.embed * 4 * (ep - 1) / ep
            rows.append({
                "ep": ep,
                "imbalance": most / (n / ep),
                "exchange_trips": trips,
                "rows_fwd_bwd": measured,
                "formula_x_imbalance_fwd_bwd": 2 * formula * most / (n / ep),
                "all_gather_fwd_bwd": sum(c.wire_bytes for c in gathered),
            })
            print(f"dropless_exchange: ep={ep} pull={pull} done", file=sys.stderr)
    return rows


def memory_table() -> list[dict]:
    rows = []
    for ep in (1, 2, 4, 8):
        trainer = Trainer.build(config(*ep_mesh(ep)))
        compiled = xla.compile_step(trainer)
        rows.append({"ep": ep, "compiled": xla.memory(compiled), "state": xla.state_bytes(trainer)})
        print(f"memory: ep={ep} done", file=sys.stderr)
    return rows


def dropped_table(steps: int) -> list[dict]:
    rows = []
    for factor in (1.0, 1.25, 2.0):
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = config(f"model.moe.capacity_factor={factor}", f"train.steps={steps}", "train.log_every=10",
                         f"run_dir={run_dir}")
            _, history = fit(Trainer.build(cfg), progress=False)
        first, last = history[0], history[-1]
        rows.append({
            "capacity_factor": factor,
            "capacity_per_sequence": kernels.capacity(cfg.model.moe, cfg.train.seq_len),
            "dropped_step_0": first["moe_dropped"],
            f"dropped_step_{last['step']}": last["moe_dropped"],
            "loss_step_0": first["loss"],
            f"loss_step_{last['step']}": last["loss"],
            "aux_loss_last": last["moe_aux_loss"],
        })
        print(f"dropped: capacity_factor={factor} done", file=sys.stderr)
    return rows


TABLES = {"all_to_all": all_to_all_table, "dropless_exchange": dropless_exchange_table, "memory": memory_table,
          "dropped": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tables", default=",".join(TABLES), help="comma-separated, of " + ", ".join(TABLES))
    args = parser.parse_args()
    c = config().model
    report = {
        "model": "moe-tiny",
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "moe": {k: getattr(c.moe, k) for k in ("experts", "top_k", "mlp", "capacity_factor")},
    }
    for name in args.tables.split(","):
        report[name] = dropped_table(args.steps) if name == "dropped" else TABLES[name]()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
