"""The train step of a :class:`~jaxscale.training.trainer.Trainer`: the objective, gradients accumulated over
``train.microbatches``, the update (and its guarded form, which keeps the old state where the loss or gradient
is not finite), and their jitted forms.

:class:`TrainStep` is the trainer's part that builds them; the trainer gives it its config, model graph,
optimizer, precision policy, shardings and ``_jit``.
"""

from __future__ import annotations

import functools
import time
from functools import cached_property
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxscale.config.read import ConfigError
from jaxscale.layout import collectives, offload
from jaxscale.layout.sharding import constrain
from jaxscale.models import balance, builtin, moe
from jaxscale.ops.loss import microbatch_weights, model_objective, stage_head_loss
from jaxscale.parallel import pipeline
from jaxscale.parallel.logit_max import QK_LOGITS
from jaxscale.precision import fp8
from jaxscale.precision import policy as precision
from jaxscale.training import qk_clip
from jaxscale.training.optim import schedule

BATCH_AXES = ("batch", "length")
QK_CLIP_MODELS = ("QK-clip scales the built-in models' attention weights by the heads' largest logits they report; "
                  "a model of Trainer.build(model=...) or a custom objective has neither")


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    fp8: Any = {}  # noqa: RUF012  fp8 amax histories (jaxscale/precision/fp8/state.py); empty with precision.fp8=off
    master: Any = {}  # noqa: RUF012  the master weights (jaxscale/precision/policy.py); empty when params are the only copy
    balance: Any = {}  # noqa: RUF012  MoE routing biases (jaxscale/models/balance.py); empty with model.moe.balance=off


class TrainStep:
    """The step's methods of :class:`~jaxscale.training.trainer.Trainer` (a base of it: ``self`` is the trainer)."""

    def loss_and_metrics(
        self, params: Any, batch: dict[str, jax.Array], fp8_state: Any = None, bias: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The objective on one batch (the default: mean cross-entropy + the model's auxiliary losses) and its
        metrics; under pipeline parallelism the pipeline's loop computes it (:mod:`jaxscale.parallel.pipeline`).
        ``bias``: the MoE routing biases (``TrainState.balance``; None: a fresh start's)."""
        fp8_state = self.fresh_fp8() if fp8_state is None else fp8_state
        if self.config.precision.offload_params:  # the stack's layers stay in host memory for the layer scan
            params = offload.fetch_outside(params, self.axes)
        model = nnx.merge(self.graphdef, params, fp8_state, self.fresh_balance() if bias is None else bias)
        chunk = self.config.model.loss_chunk
        if self.custom_objective is not None:
            return self.custom_objective(model, batch)
        if self.pipelined:
            return pipeline.objective(model, batch, functools.partial(stage_head_loss, chunk=chunk))
        return model_objective(model, batch, chunk)

    def loss(self, params: Any, batch: dict[str, jax.Array], fp8_state: Any = None, bias: Any = None) -> jax.Array:
        """The objective on one batch: mean cross-entropy, plus the MoE auxiliary losses if any."""
        return self.loss_and_metrics(params, batch, fp8_state, bias)[0]

    def _grads(
        self, params: Any, batch: dict[str, jax.Array], fp8_state: Any = None, bias: Any = None
    ) -> tuple[jax.Array, Any, dict[str, jax.Array], Any]:
        """Loss, gradients, model metrics and the updated fp8 state, accumulated over ``train.microbatches``
        with ``lax.scan`` (the fp8 histories' "gradients" are their updates: :mod:`jaxscale.precision.fp8`); each
        microbatch's loss and gradients weighed by its share of the trained targets (:mod:`jaxscale.ops.loss`)."""
        m = self.config.train.microbatches
        fp8_state = self.fresh_fp8() if fp8_state is None else fp8_state
        grad_shardings = self.param_shardings("gradients")
        value_and_grad = self._on_device(jax.value_and_grad(self.loss_and_metrics, argnums=(0, 2), has_aux=True))
        if self.wide_grads:  # differentiated at fp32 weights (the master; given the compute copy, its exact cast)
            params = precision.cast(params, self.policy.reduce)
        if m == 1:
            # No accumulator: the gradients go straight to the optimizer's layout (a reduce-scatter
            # under ZeRO-1/2/3, an all-reduce under DP), never through a replicated copy.
            (loss, aux), (grads, new_fp8) = value_and_grad(params, batch, fp8_state, bias)
            return loss, grads, aux, new_fp8

        def split(x: jax.Array) -> jax.Array:
            # Row r of microbatch i is global row r * m + i: every device keeps its own rows.
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            return constrain(x, (None, *BATCH_AXES))

        def weighed(params: Any, micro: dict[str, jax.Array], fp8_state: Any, weight: jax.Array) -> tuple:
            # Weighed before it is differentiated: every activation's gradient is then the whole batch's (and
            # the fp8 output gradients' amaxes those of one batch, not m times them), as in a pipeline.
            loss, aux = self.loss_and_metrics(params, micro, fp8_state, bias)
            return loss * weight, aux

        weighed_grad = self._on_device(jax.value_and_grad(weighed, argnums=(0, 2), has_aux=True))

        def body(carry: tuple[Any, ...], xs: tuple[dict[str, jax.Array], jax.Array]) -> tuple[tuple[Any, ...], None]:
            loss_sum, grad_sum, aux_sum, fp8_max = carry
            micro, weight = xs  # its trained targets' share of the batch's (jaxscale/ops/loss.py: loss masks)
            (loss, aux), (grads, new_fp8) = weighed_grad(params, micro, fp8_state, weight)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
            aux_sum = qk_clip.accumulate(aux_sum, aux)
            fp8_max = fp8.combine(fp8_max, new_fp8)
            return (loss_sum + loss, collectives.lay_out(grad_sum, grad_shardings), aux_sum, fp8_max), None

        # The accumulator: precision.grads_reduce, in the gradients' layout (a shard per device under ZeRO-2/3;
        # the loop's carry compiles in the optimizer's layout, a shard under ZeRO-1 too: analysis/memory.py).
        zeros = collectives.lay_out(
            jax.tree.map(lambda p: jnp.zeros(p.shape, self.policy.reduce), params), grad_shardings
        )
        micro = jax.tree.map(split, batch)
        aux_shapes = jax.eval_shape(self.loss_and_metrics, params, jax.tree.map(lambda x: x[0], micro), fp8_state,
                                    bias)[1]
        aux_zeros = qk_clip.start(aux_shapes)
        init = (jnp.zeros((), jnp.float32), zeros, aux_zeros, jax.tree.map(jnp.zeros_like, fp8_state))
        xs = (micro, microbatch_weights(micro["targets"]))
        (loss_sum, grads, aux_sum, fp8_max), _ = jax.lax.scan(body, init, xs)
        return loss_sum, grads, qk_clip.mean(aux_sum, m), fp8_max

    def _on_device(self, value_and_grad: Any) -> Any:
        """``value_and_grad`` with its gradients on the device: under ``precision.offload_params`` the gradient of
        a parameter in host memory is written there (a fetch's transpose), and comes back for the update."""
        if not self.config.precision.offload_params:
            return value_and_grad
        params = self.param_shardings("params")

        def fetched(*args: Any) -> Any:
            out, (grads, new_fp8) = value_and_grad(*args)
            return out, (offload.fetch(grads, params), new_fp8)

        return fetched

    def _train_step(
        self, state: TrainState, batch: dict[str, jax.Array], guard: bool = False
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One step; ``guard``: the master and optimizer state kept where the loss or gradient is not finite
        (``finite`` in the metrics), decided on the device, before an offloaded state goes back to the host."""
        weights = state.master if self.wide_grads else state.params  # the compute copy is the master's cast
        loss, grads, aux, fp8_state = self._grads(weights, batch, state.fp8, state.balance)
        held = (state.params, state.master, state.opt_state)
        host = self.param_shardings("params"), self.state_shardings.master, self.state_shardings.opt_state
        p = self.config.precision
        held = tuple(offload.fetch(x, h) if on else x  # from host memory to the device, after the backward
                     for x, h, on in zip(held, host, (p.offload_params, p.offload_state, p.offload_state), strict=True))
        logits, tau = aux.pop(QK_LOGITS, None), self.config.train.qk_clip
        if tau is not None and (logits is None or self.factory is not builtin.build):
            raise ConfigError(f"train.qk_clip: {QK_CLIP_MODELS}")
        clip = None if logits is None else functools.partial(qk_clip.clip, logits=logits, tau=tau,
                                                             model=self.config.model)
        # The update runs where the optimizer state lives (ZeRO-1/2/3: a shard per device), then QK-clip.
        params, master, opt_state, grads_o = precision.update(
            self.policy, self.optimizer, grads, *held, self.param_shardings("optimizer"), clip,
        )
        grad_norm = optax.tree.norm(grads_o)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if guard:
            params, master, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), (params, master, opt_state),
                                                     held)
        if self.config.mesh.axis_types == "explicit":  # the new compute copy in its layout (auto: by out_shardings)
            params = collectives.lay_out(params, self.param_shardings("params"))
        if p.offload_state:
            master, opt_state = offload.store((master, opt_state), host[1:])
        if p.offload_params:
            params = offload.store(params, host[0])
        layers = aux.pop("moe_layers", {})
        bias = balance.updated(state.balance, layers, self.config.model.moe) if state.balance else state.balance
        load = moe.load_metrics(layers) if layers else {}
        out = {"loss": loss, "grad_norm": grad_norm, **aux, **load}
        if logits is not None:
            out["max_logit"] = qk_clip.layer_max(logits)
        if not self.custom_optimizer:  # the rate of train.*'s schedule (a custom optimizer's is its own)
            out["lr"] = schedule(self.config.train)(state.step)
        if guard:
            out["finite"] = finite
        return TrainState(state.step + 1, params, opt_state, fp8_state, master, bias), out

    def _guarded_step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        """The train step, keeping the old parameters and optimizer state where the loss or gradient is not finite."""
        new, out = self._train_step(state, batch, guard=True)

        def keep(n: jax.Array, o: jax.Array) -> jax.Array:
            return jnp.where(out["finite"], n, o)

        fp8_state = jax.tree.map(keep, new.fp8, state.fp8)  # the parameters kept by the step (before a store)
        bias = jax.tree.map(keep, new.balance, state.balance)
        return TrainState(new.step, new.params, new.opt_state, fp8_state, new.master, bias), out

    @cached_property
    def jit_step(self) -> Any:
        """The jitted train step: explicit shardings, the state donated."""
        return self._jit(self._train_step, step=True)

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step; the metrics' loss is that of the parameters before the update."""
        return self.jit_step(state, batch)

    @cached_property
    def compiled_guarded_step(self) -> tuple[Any, float]:
        """The step :func:`jaxscale.training.loop.fit` runs: an update is applied only where the loss and gradient
        norm are finite (``finite`` in its metrics). Jitted like :attr:`jit_step`, compiled once; with its
        compile time in seconds."""
        jitted = self._jit(self._guarded_step, step=True)
        start = time.perf_counter()
        compiled = jitted.lower(self.abstract_state(), self.abstract_batch()).compile()
        return compiled, time.perf_counter() - start

    @cached_property
    def jit_loss_and_grads(self) -> Any:
        """Jitted loss and (accumulated) gradients under this layout, built once per trainer."""

        def loss_and_grads(
            params: Any, batch: dict[str, jax.Array], fp8_state: Any = None, bias: Any = None
        ) -> tuple[jax.Array, Any]:
            return self._grads(params, batch, fp8_state, bias)[:2]

        return self._jit(loss_and_grads, out_shardings=(None, self.param_shardings("gradients")))

    def loss_and_grads(
        self, params: Any, batch: dict[str, jax.Array], fp8_state: Any = None, bias: Any = None
    ) -> tuple[jax.Array, Any]:
        """Loss and (accumulated) gradients under this layout, for tests and research code.

        ``fp8_state``: the fp8 histories to scale with, ``bias`` the routing biases (None: a fresh start's)."""
        return self.jit_loss_and_grads(params, batch, fp8_state, bias)

    @cached_property
    def jit_eval_loss(self) -> Any:
        """Jitted loss of a batch under this layout, the parameters not donated;
        ``(params, batch, fp8_state=None, bias=None)``."""
        return self._jit(self.loss)
