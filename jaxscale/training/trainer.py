"""The train state and the jitted train step.

config -> mesh + rules -> abstract model (``nnx.eval_shape`` of the model factory:
the built-in models, or any model of the contract in docs/models.md) -> shardings from
the logical axes (Flax's ``out_sharding`` metadata) -> jitted init straight into those shardings -> per-process
global batch -> jitted, donated train step -> metrics (the loop around it, with
resume, evaluation, checkpoints and fault handling, is :mod:`jaxscale.training.loop`).

:class:`Trainer` is the programmatic API: build it from a config (and optionally a model
factory, an objective and an optax optimizer), then call
:meth:`Trainer.init_state`, :meth:`Trainer.batch` and :meth:`Trainer.step`
(or :func:`jaxscale.training.loop.fit`). Every jitted function of the trainer is traced
inside :meth:`Trainer.scope`, which puts the rules table and the pipeline
settings in effect for the model's activation constraints.
Every check of the layout (unknown logical axes, a dimension not divisible
by its mesh axes, a mesh that does not match the devices, a part of the model
contract the config asks for and the model lacks) runs in
:meth:`Trainer.build`, by tracing the step abstractly, before anything compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, use_abstract_mesh

from jaxscale.config import flops, refusals, selections, stage_layers
from jaxscale.config.read import Config, ConfigError
from jaxscale.data.batches import Loader, check_data, make_loader
from jaxscale.layout import offload, stage_plan
from jaxscale.layout.mesh import make_mesh
from jaxscale.layout.sharding import (
    Layout,
    Rules,
    check_divisible,
    is_axes,
    layout_of,
    logical_axes,
    name_stacked_scalars,
    named_params,
    use_rules,
)
from jaxscale.models import balance, builtin, contract
from jaxscale.models.attention import resolved, ring_tiles, sequence_order
from jaxscale.parallel import ring_balance
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision
from jaxscale.runtime import xla_flags
from jaxscale.training import forward, loop, muon_layout, remat_names
from jaxscale.training.optim import make_optimizer
from jaxscale.training.step import BATCH_AXES, TrainState, TrainStep

BATCH_KEYS = ("inputs", "targets", "positions")

ModelFactory = Callable[[Config, nnx.Rngs], nnx.Module]  # (config, rngs) -> the model (docs/models.md)
Objective = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def make_model(config: Config, factory: ModelFactory = builtin.build) -> nnx.Module:
    """``factory(config, rngs)``, the rngs seeded by ``train.seed``; whatever it raises, a one-line ConfigError."""
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        model = factory(config, nnx.Rngs(config.train.seed))
    except ConfigError:
        raise
    except Exception as e:  # a user's code: any error it raises is reported as the factory's
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"model factory {name} raised {type(e).__name__}: {first}") from e
    contract.check_module(model, name)
    name_stacked_scalars(model)
    return model


def abstract_model(
    config: Config, factory: ModelFactory = builtin.build
) -> tuple[nnx.GraphDef, Any, Any, frozenset[str]]:
    """The model's graph, its parameters as ShapeDtypeStructs, their logical axes, and the parts of the
    richer form it has (:func:`jaxscale.models.contract.parts`)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: make_model(config, factory))
    graphdef, state, _, _, rest = nnx.split(model, nnx.Param, fp8.Fp8Meta, balance.RouterBias, ...)
    for path, variable in nnx.to_flat_state(rest):
        raise ConfigError(
            f"model state {'.'.join(map(str, path))} is a {type(variable).__name__}: the trainer keeps "
            "nnx.Param variables only (no rngs or batch statistics held in the model)"
        )
    return graphdef, nnx.to_pure_dict(state), logical_axes(state), contract.parts(model)


@dataclasses.dataclass
class Trainer(TrainStep):
    """Everything one experiment needs: mesh, rules, model graph, shardings, data and the jitted step."""

    config: Config
    mesh: Mesh
    rules: Rules
    graphdef: nnx.GraphDef
    abstract_params: Any
    axes: Any
    optimizer: optax.GradientTransformation
    factory: ModelFactory = builtin.build
    parts: frozenset[str] = frozenset()  # of the richer form (jaxscale.models.contract)
    custom_objective: Objective | None = None
    custom_optimizer: bool = False

    @classmethod
    def build(
        cls,
        config: Config,
        devices: Sequence[jax.Device] | None = None,
        *,
        model: ModelFactory | None = None,
        objective: Objective | None = None,
        optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation] | None = None,
    ) -> Trainer:
        """Validate the layout against the devices and build the trainer; compiles nothing.

        ``model``: ``factory(config, rngs) -> nnx.Module`` (docs/models.md; default: the built-in models).
        ``objective``: ``(model, batch) -> (loss, metrics)`` (default: :func:`jaxscale.ops.loss.model_objective`,
        or the pipeline's). ``optimizer``: any optax transformation (default: AdamW of ``train.*``), or a function
        of the parameters' logical axes that returns one (``functools.partial(jaxscale.training.muon.muon, 3e-3)``); its
        state is laid out by the rules' ``optimizer`` section.
        """
        if config.model.remat == "auto":
            raise ConfigError("model.remat: auto is chosen before the trainer is built, by the predicted memory "
                              "(jaxscale.analysis.remat.resolved; the jaxscale command applies it)")
        mesh = make_mesh(config.mesh, devices)
        xla_flags.warn(config.xla, mesh.devices.flat[0].platform)
        rules = Rules.load(config.rules)
        config = resolved(config, mesh, rules)  # model.attention: auto -> the kernel these devices run
        factory = model or builtin.build
        layout = layout_of(mesh, rules)
        layout.validate(config)  # every layout error and refusal, before the stack's storage is laid out
        storage = stage_layers.storage(config, layout.stages)
        # No context mesh here: nnx.eval_shape would read the logical names as mesh axes (Trainer.scope sets it).
        graphdef, canonical, axes, parts = abstract_model(config, factory)
        abstract_params = jax.eval_shape(storage.place_params, canonical)
        if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
            optimizer = optimizer(axes)
        trainer = cls(
            config, mesh, rules, graphdef, abstract_params, axes, optimizer or make_optimizer(config.train, axes),
            factory, parts, objective, optimizer is not None,
        )
        trainer.validate()
        return trainer

    def validate(self) -> None:
        """Check every parameter and activation layout by tracing the step abstractly."""
        for path, leaf, axes in named_params(self.abstract_params, self.axes):
            name = "param " + path
            for kind in ("params", "optimizer", "gradients"):
                where = name if kind == "params" else f"{name} ({kind} layout)"
                try:
                    part = self.rules.spec(axes, kind)
                except ConfigError as e:
                    raise ConfigError(f"{where}: {e}") from None
                check_divisible(where, leaf.shape, axes, part, self.mesh)
        self._check_contract()
        if self.rules.muon:  # Muon's owner layouts named by the rules (jaxscale/training/muon_layout.py)
            muon_layout.check(self.layout, named_params(self.abstract_params, self.axes))
        t = self.config.train
        micro = t.global_batch // t.microbatches
        for what, rows in (("train.global_batch", t.global_batch), ("train.global_batch / train.microbatches", micro)):
            check_divisible(what, (rows, t.seq_len), BATCH_AXES, self.rules.spec(BATCH_AXES), self.mesh)
        check_data(self.config)
        self.layout.validate(self.config, self.blocks)  # again, for this model's own blocks (a stage's plan)
        traced = jax.make_jaxpr(self.jit_step)(self.abstract_state(), self.abstract_batch())
        remat_names.check(traced, self.config.model)  # names the traced step marks

    def _check_contract(self) -> None:
        """What the config asks of the model that its form lacks: one line, before anything compiles."""
        name = getattr(self.factory, "__qualname__", repr(self.factory))
        chunk = self.config.model.loss_chunk
        if chunk and self.custom_objective is None:
            contract.require(self.parts, contract.CHUNKED_LOSS, name, f"model.loss_chunk={chunk}")
        if "ahead" in self.parts:
            contract.require(self.parts, contract.AHEAD, name, "its ahead")
        if self.pipelined:
            why = f"rules '{self.rules.name}' (layers on stage: {self.layout.stages} pipeline stages)"
            if self.custom_objective is not None:
                raise ConfigError(
                    f"{why}: a custom objective cannot run in the pipeline's loop, which computes the "
                    "cross-entropy on the last stage"
                )
            contract.require(self.parts, contract.PIPELINE, name, why)
        if self.config.precision.offload_params and self.factory is not builtin.build:
            raise ConfigError(f"precision.offload_params: model {name} is not a built-in one; the built-in models "
                              "fetch each layer from host memory in their layer scan (jaxscale/layout/offload.py)")
        context = refusals.Context(self.config, self.layout, parts=frozenset(self.parts), model_name=name)
        refusals.check(context, needs=("model",))

    @property
    def blocks(self) -> stage_plan.Blocks:
        """The model's parts a pipeline stage's plan reads (:mod:`jaxscale.layout.stage_plan`): its blocks'
        parameters' logical axes, its experts, its ``explicit_tp``."""
        axes = jax.tree.leaves(self.axes.get("blocks", {}), is_leaf=is_axes)
        return stage_plan.Blocks.of(self.config.model, axes or None, "explicit_tp" in self.parts)

    @property
    def layout(self) -> Layout:
        """The rules table on this mesh (:class:`jaxscale.layout.rules.Layout`)."""
        return layout_of(self.mesh, self.rules)

    @cached_property
    def storage(self) -> stage_layers.Storage:
        """Where the parameters keep the model's stacked blocks (:mod:`jaxscale.config.stage_layers`)."""
        return stage_layers.storage(self.config, self.layout.stages)

    @property
    def builtin_model(self) -> bool:
        """Whether the model is the built-in Llama-style one of ``model.*`` (the analytic model and formulas describe
        it; not the DeepSeek-V3-style one of ``model.deepseek``, which counts its own FLOPs)."""
        return self.factory is builtin.build and self.config.model.deepseek is None

    @property
    def pipelined(self) -> bool:
        """Whether the rules run the pipeline (``layers`` on ``stage`` of size > 1)."""
        return self.layout.stages > 1

    @cached_property
    def wide_grads(self) -> bool:
        """Whether the step differentiates the fp32 master (``precision.grads_reduce`` wide, bf16 compute), not
        the bf16 compute copy (its cast): the weight-gradient matmuls' fp32 output
        (:func:`jaxscale.precision.policy.einsum` casts the weight inside) then reaches the optimizer as it is,
        where the compute copy's gradient would round it to bf16 and the update widen it again. The layers read
        fp32 weights (their bf16 cast fused into each use) and no bf16 gradient is held. A silent selection of
        five conditions (:func:`jaxscale.config.selections.wide_grads`): no cross-device sum touches a gradient
        and the master is whole, for the built-in model without fp8 (its projections cast inside that einsum)."""
        return selections.wide_grads(self.config, self.layout, self.builtin_model)

    @cached_property
    def flops_per_step(self) -> float:
        """Training FLOPs of one step: the model's formula (``flops_per_token``, docs/models.md) when it has
        one, else the compiled step's own count (:func:`jaxscale.config.flops.compiled_flops`)."""
        t = self.config.train
        if "flops_per_token" in self.parts:
            model = nnx.merge(self.graphdef, self.abstract_params, self._shapes.fp8, self._shapes.balance)
            return model.flops_per_token(t.seq_len) * t.global_batch * t.seq_len
        return flops.compiled_flops(self.compiled_guarded_step[0]) * self.mesh.size

    # -- shardings -----------------------------------------------------------------

    def sharding(self, axes: tuple, kind: str = "params") -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(axes, kind))

    def param_shardings(self, kind: str = "params") -> Any:
        return jax.tree.map(lambda a: self.sharding(a, kind), self.axes, is_leaf=is_axes)

    @cached_property
    def state_shardings(self) -> TrainState:
        replicated = NamedSharding(self.mesh, PartitionSpec())
        found = {}

        def map_state() -> None:
            # Traced, so that optax's placeholder init runs no eager op (nothing compiles here).
            # A leaf masked by optax.partition or optax.masked (Muon's AdamW share) holds no state.
            found["opt"] = optax.tree_map_params(
                self.optimizer,
                lambda v, s: v if isinstance(v, optax.MaskedNode) else s,
                self._shapes.opt_state,
                self.param_shardings("optimizer"),
                transform_non_params=lambda _: replicated,
                is_leaf=lambda v: isinstance(v, optax.MaskedNode),
            )

        jax.eval_shape(map_state)
        fp8_state = jax.tree.map(lambda _: replicated, self._shapes.fp8)
        master = self.param_shardings("optimizer") if self.policy.two_copies else {}
        opt = found["opt"]
        if self.config.precision.offload_state:  # in host memory between steps (jaxscale/layout/offload.py)
            opt, master = offload.on_host((opt, master))
        bias = jax.tree.map(lambda _: replicated, self._shapes.balance)
        params = self.param_shardings("params")
        if self.config.precision.offload_params:  # the compute copy in host memory between steps (offload.py)
            params = offload.on_host(params)
        return TrainState(replicated, params, opt, fp8_state, master, bias)

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return self.sharding(BATCH_AXES)

    def abstract_state(self) -> TrainState:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self._shapes, self.state_shardings
        )

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        t = self.config.train
        spec = jax.ShapeDtypeStruct((t.global_batch, t.seq_len), jnp.int32, sharding=self.batch_sharding)
        return dict.fromkeys(BATCH_KEYS, spec)

    # -- jit -------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The rules table on this mesh and the pipeline settings, in effect for the model's code traced here; the
        mesh is JAX's context mesh (``get_abstract_mesh()``, bare ``PartitionSpec``s, ``reshard``)."""
        with use_rules(self.mesh, self.rules, self.config.pipeline), use_abstract_mesh(self.mesh.abstract_mesh):
            yield

    def _jit(self, fn: Callable[..., Any], step: bool = False, **jit_kwargs: Any) -> Any:
        """``jax.jit`` of ``fn`` traced inside :meth:`scope`; ``step``: a train step's shardings (state and
        batch in, state and replicated metrics out), the state donated."""
        if step:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            batch = dict.fromkeys(BATCH_KEYS, self.batch_sharding)
            jit_kwargs = dict(
                in_shardings=(self.state_shardings, batch),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
            )

        @functools.wraps(fn)
        def scoped(*args: Any) -> Any:
            with self.scope():
                return fn(*args)

        return jax.jit(scoped, **jit_kwargs)

    # -- state -----------------------------------------------------------------------

    @cached_property
    def policy(self) -> precision.Policy:
        """The mixed-precision policy: compute copy, master, gradient reduction (:mod:`jaxscale.precision.policy`)."""
        return precision.policy(self.config)

    def _init(self, weights: Any = None) -> TrainState:
        """A fresh state; with ``weights`` (the master's, or the parameters' with one copy), around those
        weights: the compute copy cast from them, a fresh optimizer, step 0."""
        with nnx.use_eager_sharding(False):
            model = make_model(self.config, self.factory)
        _, fresh, fp8_state, bias = nnx.split(model, nnx.Param, fp8.Fp8Meta, balance.RouterBias)
        # The canonical stack in the pipeline's storage: parameters, fp8 histories and routing biases alike.
        fresh, fp8_state, bias = (self.storage.place_params(nnx.to_pure_dict(t)) for t in (fresh, fp8_state, bias))
        params, master = precision.split(self.policy, fresh if weights is None else weights)
        opt_state = self.optimizer.init(precision.updated(params, master))
        step = jnp.zeros((), jnp.int32)
        return TrainState(step, params, opt_state, fp8_state, master, bias)

    @cached_property
    def _shapes(self) -> TrainState:
        """The state's shapes and dtypes, without shardings."""
        with self.scope():
            return jax.eval_shape(self._init)

    @cached_property
    def jit_init(self) -> Any:
        return self._jit(self._init, out_shardings=self.state_shardings)

    def init_state(self, weights: Any = None) -> TrainState:
        """A fresh state, created on the devices directly in its shardings; with ``weights`` (laid out and typed
        as the master of :attr:`state_shardings`, or its params with one copy; donated), a new run's state
        around them: step 0, a fresh optimizer."""
        if weights is None:
            return self.jit_init()
        return self._jit(self._init, out_shardings=self.state_shardings, donate_argnums=0)(weights)

    def fresh_fp8(self) -> Any:
        """The fp8 state of a fresh start (empty histories): what ``fp8_state=None`` stands for below."""
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._shapes.fp8)

    def fresh_balance(self) -> Any:
        """The routing biases of a fresh start (zeros): what ``bias=None`` stands for below."""
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._shapes.balance)

    @cached_property
    def jit_logits(self) -> Any:
        """Jitted forward: ``(params, tokens, positions, fp8_state, bias)`` -> float32 logits."""
        return self._jit(functools.partial(forward.model_logits, self))

    def logits(self, state_or_params: Any, tokens: Any, positions: Any = None) -> jax.Array:
        """float32 logits ``[batch, length, vocab]`` of ``tokens`` ``[batch, length]`` at ``positions`` (default
        0, 1, ...), under this layout: of a ``TrainState`` (its fp8 state and routing biases with it) or of bare
        parameters (a fresh start's). Pipeline layouts run the plain forward (:mod:`jaxscale.training.forward`)."""
        return forward.logits(self, state_or_params, tokens, positions)

    # -- data ------------------------------------------------------------------------

    @cached_property
    def batches(self) -> Loader:
        return make_loader(self.config, "train", self.sequence_order, self.ring_balance)

    @cached_property
    def eval_batches(self) -> Loader:
        return make_loader(self.config, "eval", self.sequence_order, self.ring_balance)

    @property
    def ring_balance(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """``data.ring_balance``: each row's documents arranged for the ring's size and tile, or None."""
        tiles = ring_tiles(self.config, self.mesh, self.rules)
        return None if tiles is None else functools.partial(ring_balance.arranged, cp=tiles[0], block=tiles[1])

    @cached_property
    def sequence_order(self) -> np.ndarray | None:
        """The order of each sequence's tokens on the devices (zig-zag chunks under ring attention)."""
        return sequence_order(self.config.model, self.config.train.seq_len, self.mesh, self.rules)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch of ``step``, sharded by the rules' ``batch`` and ``length``."""
        return self.batches.global_batch_arrays(step, self.batch_sharding)

    # -- the loop ----------------------------------------------------------------------

    def fit(
        self, state: TrainState | None = None, progress: bool = True, stop_at: int | None = None
    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """Train to ``train.steps`` (or until ``stop_at`` updates): :func:`jaxscale.training.loop.fit` on this
        trainer."""
        return loop.fit(self, state, progress, stop_at)

    def evaluate(self, params: Any, fp8_state: Any = None, bias: Any = None) -> float:
        """Mean held-out loss of ``params``: :func:`jaxscale.training.loop.evaluate` on this trainer."""
        return loop.evaluate(self, params, fp8_state, bias)
