"""Parameters checkpoints (``checkpoint.init_from``): a directory holding
``params/`` (the model's parameters alone, one orbax pytree, as
``jaxscale convert hf-to-jaxscale`` writes it) and ``model.yaml`` (the model
they belong to), or a run's checkpoint directory (the parameters of its latest
step's ``state``). A new run reads them straight into its own shardings, each
device only its slices, after the saved shapes were checked against the
config; the optimizer state is fresh and the step 0. The MoE routing biases (``TrainState.balance``, not
parameters) come with them: ``balance/`` beside ``params/`` (a converted DeepSeek-V3's), or the run's state's.

Such a checkpoint is written by :func:`save_params` (``jaxscale convert``) and read parameter by parameter
(:func:`read_param`) or into a new run's state (:func:`init_state_from`); run checkpoints:
:mod:`jaxscale.checkpoint.store`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from jaxscale.checkpoint.restack import convert_params, placed, read_as, saved_storage
from jaxscale.checkpoint.store import SHAPE_KEYS, Checkpointer
from jaxscale.config.read import Config, ConfigError, read_yaml
from jaxscale.config.stage_layers import Storage, written_before
from jaxscale.layout.sharding import param_name
from jaxscale.models import fusion
from jaxscale.precision import policy as precision

PARAMS_DIR = "params"
BALANCE_DIR = "balance"  # a parameters checkpoint's routing biases (TrainState.balance)
MODEL_FILE = "model.yaml"
MOE_SHAPE_KEYS = ("experts", "mlp", "every_n_layers", "shared_experts")


@dataclasses.dataclass(frozen=True)
class ParamsSource:
    """Where a checkpoint keeps a model's parameters: an orbax pytree directory, the keys of the
    parameters within it, the model config (a mapping) they belong to, and the storage of its layer stack."""

    item: Path
    prefix: tuple[str, ...]
    model: dict[str, Any]
    storage: Storage


def params_source(path: str | Path) -> ParamsSource:
    """The parameters of a parameters checkpoint (``params/`` + ``model.yaml``) or of a run's latest checkpoint."""
    root = Path(path).absolute()
    if (root / PARAMS_DIR).is_dir():
        if not (root / MODEL_FILE).exists():
            raise ConfigError(f"{root}: has {PARAMS_DIR}/ but no {MODEL_FILE} naming its model")
        model = read_yaml(root / MODEL_FILE)
        return ParamsSource(root / PARAMS_DIR, (), model, written_before(model, {}))
    step = None
    if root.is_dir():
        checkpointer = Checkpointer(root, async_save=False)
        try:
            step = checkpointer.latest_step()
            items = checkpointer.read_json(step) if step is not None else None
        finally:
            checkpointer.close()
    if step is None:
        raise ConfigError(
            f"{root}: not a parameters checkpoint ({PARAMS_DIR}/ and {MODEL_FILE}) nor a run's checkpoint directory"
        )
    saved = items.config
    # The full-precision weights: the master where the run kept one apart from its compute copy.
    kept = saved.get("precision", {})
    field = "master" if "params" in kept and precision.resolve(saved["model"], kept).two_copies else "params"
    return ParamsSource(root / str(step) / "state", (field,), saved["model"], saved_storage(items.loop, saved))


def save_params(directory: str | Path, params: Any, model: dict[str, Any], balance: Any = None) -> None:
    """Write ``params`` (a pure dict of numpy arrays) and its model config as a parameters checkpoint, with
    the routing biases ``balance`` (the same, as ``TrainState.balance`` holds them) in ``balance/`` if any.

    The arrays are written from where they lie: no defensive copy, no compression buffers (orbax's
    defaults hold about twice the model in host memory while writing; uncompressed, the files are larger).
    """
    root = Path(directory).absolute()
    if (root / PARAMS_DIR).exists():
        raise ConfigError(f"{root / PARAMS_DIR} already exists: choose another directory")
    root.mkdir(parents=True, exist_ok=True)
    in_place = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, in_place), (jax.Array, ocp.type_handlers.ArrayHandler())
    )
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(root / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
        if balance:
            checkpointer.save(root / BALANCE_DIR, args=ocp.args.PyTreeSave(balance))
    (root / MODEL_FILE).write_text(yaml.safe_dump(model, sort_keys=False))


def _nest(prefix: tuple[str, ...], tree: Any) -> Any:
    for key in reversed(prefix):
        tree = {key: tree}
    return tree


def _unnest(prefix: tuple[str, ...], tree: Any) -> Any:
    for key in prefix:
        tree = tree[key]
    return tree


def by_name(tree: Any) -> dict[str, Any]:
    """``{"blocks.attn.wq": leaf, ...}`` of a nested mapping."""
    return {param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def balance_source(source: ParamsSource) -> ParamsSource | None:
    """The routing biases kept with ``source``'s parameters (``balance/`` beside a parameters checkpoint's
    ``params/``, a run's state's ``balance``) as a source of their own, or None where there are none."""
    if not source.prefix:
        item = source.item.parent / BALANCE_DIR
        return dataclasses.replace(source, item=item) if item.is_dir() else None
    with ocp.PyTreeCheckpointer() as checkpointer:
        saved = checkpointer.metadata(source.item).item_metadata.tree
    return dataclasses.replace(source, prefix=("balance",)) if "balance" in saved else None


def read_all(source: ParamsSource) -> dict[str, np.ndarray]:
    """Every array of ``source`` read whole into host memory, by dotted name (small trees: the routing biases)."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = _unnest(source.prefix, checkpointer.metadata(source.item).item_metadata.tree)
        args = ocp.args.PyTreeRestore(
            item=_nest(source.prefix, jax.tree.map(lambda _: np.zeros(0), tree)),
            restore_args=_nest(source.prefix, jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)),
            partial_restore=True,
        )
        return by_name(_unnest(source.prefix, checkpointer.restore(source.item, args=args)))


def param_shapes(source: ParamsSource) -> dict[str, tuple[int, ...]]:
    """The saved shape of every parameter, by dotted name (metadata only: no array is read)."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(source.item).item_metadata.tree
    return {name: tuple(leaf.shape) for name, leaf in by_name(_unnest(source.prefix, tree)).items()}


def read_param(source: ParamsSource, path: tuple[str | int, ...]) -> np.ndarray:
    """One parameter (``path`` in the params tree) read whole into host memory, and nothing else; a block's
    with its layer stack in the canonical order."""
    item = _nest((*source.prefix, *path), np.zeros(0))
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=_nest((*source.prefix, *path), ocp.RestoreArgs(restore_type=np.ndarray)),
        partial_restore=True,
    )
    with ocp.PyTreeCheckpointer() as checkpointer:
        value = _unnest((*source.prefix, *path), checkpointer.restore(source.item, args=args))
    return source.storage.canonical(value) if path[0] == "blocks" else value


def check_params(source: ParamsSource, where: str, config: Config, abstract_params: Any) -> None:
    """Raise a :class:`ConfigError` naming the key or parameter if ``source`` would not restore into the config."""
    saved, current = source.model, config.to_dict()["model"]
    keys = [((k,), k) for k in SHAPE_KEYS if k != "param_dtype"]
    if (saved.get("moe") is None) != (current["moe"] is None):
        keys.append((("moe",), "moe"))
    elif current["moe"] is not None:
        keys += [(("moe", k), f"moe.{k}") for k in MOE_SHAPE_KEYS]
    for path, name in keys:
        have, want = _unnest(path[:-1], saved).get(path[-1]), _unnest(path[:-1], current).get(path[-1])
        if have != want:
            raise ConfigError(f"{where}: {source.item.parent} has model.{name}={have!r}, the config has {want!r}")
    shapes, wanted = param_shapes(source), by_name(abstract_params)
    for name, leaf in wanted.items():
        if name not in shapes:
            raise ConfigError(f"{where}: {source.item.parent} has no parameter {name}")
        if shapes[name] != leaf.shape:
            raise ConfigError(
                f"{where}: parameter {name} of {source.item.parent} is {shapes[name]}, the config needs {leaf.shape}"
            )
    extra = sorted(set(shapes) - set(wanted))
    if extra:
        raise ConfigError(f"{where}: {source.item.parent} has parameters the config does not: {', '.join(extra)}")


def restore_params(source: ParamsSource, abstract_params: Any) -> Any:
    """The parameters read straight into the shardings and dtypes of ``abstract_params`` (ShapeDtypeStructs)."""
    item = _nest(source.prefix, abstract_params)
    restore_args = jax.tree.map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), item
    )
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return _unnest(source.prefix, checkpointer.restore(source.item, args=args))


def init_state_from(trainer: Any, path: str | Path) -> Any:
    """A new run's state (step 0, fresh optimizer) from the parameters at ``path`` (``checkpoint.init_from``)
    and the routing biases kept with them, their layer stack moved into the trainer's storage."""
    source = params_source(path)
    abstract = trainer.abstract_state()
    # Read into the copy the optimizer updates (the master when apart), in its dtype and layout.
    target = precision.updated(abstract.params, abstract.master)
    in_source = read_as(target, source.storage, trainer.mesh)  # the shapes it holds (its own layer stack)
    fused = trainer.config.model.fused_projections
    if bool(source.model.get("fused_projections")) != fused:  # the other layout (models/fusion.py)
        saved = fusion.other_layout(target, fused)
        check_params(source, "checkpoint.init_from", trainer.config, fusion.other_layout(in_source, fused))
        read = placed(trainer.storage, lambda path: read_param(source, path))  # read_param: the model's order
        state = trainer.init_state(fusion.converted(read, saved, target, fused))
    else:
        check_params(source, "checkpoint.init_from", trainer.config, in_source)
        shardings = jax.tree.map(lambda a: a.sharding, target)
        params = restore_params(source, in_source)
        state = trainer.init_state(convert_params(params, source.storage, trainer.storage, shardings))
    return _with_balance(trainer, source, state)


def _with_balance(trainer: Any, source: ParamsSource, state: Any) -> Any:
    """``state`` with the routing biases kept with ``source`` (its zeros where none are kept); a one-line
    :class:`ConfigError` where non-zero ones would be dropped by a run without them (``model.moe.balance=off``)."""
    biases = balance_source(source)
    if biases is None:
        return state
    abstract = trainer.abstract_state().balance
    if not abstract:
        if any(np.any(b) for b in read_all(biases).values()):
            raise ConfigError(f"checkpoint.init_from: {source.item.parent} holds non-zero MoE routing biases, which "
                              "choose the experts, and model.moe.balance is off: set it to sign or quantile")
        return state
    in_source = read_as(abstract, biases.storage, trainer.mesh)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    bias = convert_params(restore_params(biases, in_source), biases.storage, trainer.storage, shardings)
    return state._replace(balance=bias)
