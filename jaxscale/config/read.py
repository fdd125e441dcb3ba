"""Typed experiment configuration: YAML files, dotted overrides, validation.

An experiment file composes a model (a name from ``configs/models/`` or an
inline mapping), a mesh, a rules table (a name from ``configs/rules/`` or a
path) and training settings. ``--set train.steps=10`` style overrides are
applied on top. Every key is checked against the dataclasses of
:mod:`jaxscale.config.schema` (all importable from here): an unknown key or a value of
the wrong type raises :class:`ConfigError` naming the key, before anything is
compiled. Every choice among names is a ``Literal`` type there, checked from the
type. The checks that need the rules table and the mesh run when the trainer is
built (:meth:`jaxscale.layout.rules.Layout.validate`). This module never imports jax,
so the command line can read a config before the backend starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import socket
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxscale.config import bounds, interleave, refusals, strict
from jaxscale.config.axes import LOGICAL_AXES
from jaxscale.config.mesh_size import mesh_shape, requested_devices
from jaxscale.config.model_checks import validate_deepseek, validate_moe, validate_rope
from jaxscale.config.schema import (  # the schema, importable from here
    DEFAULT_SCHEDULE,
    INTERLEAVED,
    MESH_AXES,
    Attention,
    AxisSizes,
    CheckpointConfig,
    Config,
    ConfigError,
    CopyDType,
    DataConfig,
    DataSource,
    DcnConfig,
    DeepSeekConfig,
    DistributedConfig,
    DType,
    Fp8Mode,
    MeshConfig,
    MixturePart,
    ModelConfig,
    MoEConfig,
    MoEDispatch,
    MoEImpl,
    MoERouter,
    NonFinite,
    Packing,
    PipelineConfig,
    PrecisionConfig,
    ReduceDType,
    Remat,
    Resume,
    RopeScaling,
    RopeType,
    Schedule,
    TrainConfig,
    XlaConfig,
    XlaPreset,
)

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_SCHEDULE",
    "INTERLEAVED",
    "MESH_AXES",
    "Attention",
    "AxisSizes",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CopyDType",
    "DType",
    "DataConfig",
    "DataSource",
    "DcnConfig",
    "DeepSeekConfig",
    "DistributedConfig",
    "Fp8Mode",
    "MeshConfig",
    "MixturePart",
    "MoEConfig",
    "MoEDispatch",
    "MoEImpl",
    "MoERouter",
    "ModelConfig",
    "NonFinite",
    "Packing",
    "PipelineConfig",
    "PrecisionConfig",
    "ReduceDType",
    "Remat",
    "Resume",
    "RopeScaling",
    "RopeType",
    "Schedule",
    "TrainConfig",
    "XlaConfig",
    "XlaPreset",
    "check_writable",
    "checkpoint_dir",
    "load_config",
    "mesh_shape",
    "parse_override",
    "read_yaml",
    "requested_devices",
    "resolve_named",
    "validate",
    "validate_deepseek",
    "validate_moe",
    "validate_pipeline",
    "validate_precision",
    "validate_stage_layers",
    "validate_xla"
]



def config_dir() -> Path:
    """The YAML configs (models, rules, clusters, experiments, bench suites): ``jaxscale/configs`` in an
    installed wheel (setup.py installs the top-level ``configs/`` there), else a source checkout's ``configs/``."""
    package = Path(importlib.util.find_spec("jaxscale").origin).parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = config_dir()

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it, converted where lossless."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value is False and "off" in choices:
            return "off"  # YAML reads the word off as false (precision.fp8: off, checkpoint.resume: off)
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: wrong type")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in names:
            raise ConfigError(f"unknown config key '{key}' (known: {', '.join(sorted(names))})")
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping (safe load; empty: {}), or a one-line :class:`ConfigError`."""
    try:
        data = strict.load_yaml(path.read_bytes())
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def resolve_named(value: str, kind: str) -> Path:
    """A name of a file in ``configs/<kind>/`` (without .yaml) or a path to one."""
    path = Path(value)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    named = CONFIG_DIR / kind / f"{value}.yaml"
    if named.exists():
        return named
    known = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))
    raise ConfigError(f"no {kind[:-1]} named '{value}' (a path, or one of: {', '.join(known)})")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=3`` -> (['a', 'b'], 3); the value is read as YAML (safe load)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not KEY=VALUE")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = strict.load_yaml(raw) if raw else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{item}': value is not valid YAML") from e
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read an experiment (a YAML path, or a name in ``configs/experiments/``; none: the defaults), apply
    ``KEY=VALUE`` overrides, validate."""
    if path is not None and not Path(path).exists() and Path(path).suffix not in (".yaml", ".yml"):
        path = resolve_named(str(path), "experiments")
    raw: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    for key in ("rules", "model"):  # a relative path in an experiment file is relative to that file
        value = raw.get(key)
        if isinstance(value, str) and Path(value).suffix in (".yaml", ".yml") and not Path(value).is_absolute():
            beside = Path(path).parent / value
            if beside.exists():
                raw[key] = str(beside)
    model = raw.get("model")
    if isinstance(model, str):
        raw["model"] = read_yaml(resolve_named(model, "models"))
    for item in overrides or []:
        keys, value = parse_override(item)
        if keys[0] == "model" and len(keys) == 1 and isinstance(value, str):
            value = read_yaml(resolve_named(value, "models"))
        off = strict.check_switched_on(raw, keys)
        if off:
            raise ConfigError(off)
        _set_dotted(raw, keys, value)
    config = _build(Config, raw)
    validate(config)
    return config








def validate_mixture(d: DataConfig) -> None:
    """``data.mixture``: with ``data.source=tokens`` in place of ``data.path``, positive weights, distinct names."""
    if d.mixture is None:
        return
    if not d.mixture:
        raise ConfigError("data.mixture: an empty list (null: one source)")
    for i, part in enumerate(d.mixture):
        if not (part.weight > 0 and math.isfinite(part.weight)):
            raise ConfigError(f"data.mixture[{i}].weight must be positive, got {part.weight}")
    period = interleave.shares([part.weight for part in d.mixture])[1]
    if period > interleave.MAX_PERIOD:
        raise ConfigError(f"data.mixture: the weights' exact ratio repeats every {period} rows, over "
                          f"{interleave.MAX_PERIOD}: write them with fewer digits")
    names = [part.name or Path(part.path).name for part in d.mixture]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"data.mixture: the name {repeated[0]!r} is given twice (set data.mixture[i].name)")


def validate(config: Config) -> None:
    """Checks that need no devices: each setting's values here, then the rules that name two or more settings
    (:mod:`jaxscale.config.refusals`)."""
    m, t = config.model, config.train
    for key in ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive")
    if m.attention_block <= 0:
        raise ConfigError("model.attention_block must be positive")
    if m.loss_chunk < 0:
        raise ConfigError(f"model.loss_chunk must be at least 0 (0: the plain loss), got {m.loss_chunk}")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim ({m.head_dim}) must be even for rotary embeddings")
    validate_moe(m)
    validate_deepseek(m)
    validate_rope(m.rope_scaling)
    validate_mixture(config.data)
    _validate_loop(config)
    for key in ("steps", "global_batch", "seq_len", "microbatches", "log_every"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be at least 1, got {getattr(t, key)}")
    if t.schedule_steps is not None and t.schedule_steps < 1:
        raise ConfigError(f"train.schedule_steps must be at least 1 (or null: the run's steps), got {t.schedule_steps}")
    if t.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("train.tensorboard: needs tensorboardX (pip install 'jaxscale[plot]')")
    unknown = [a for a in t.muon.adamw_axes if a not in LOGICAL_AXES]
    if unknown:
        raise ConfigError(f"train.muon.adamw_axes: '{unknown[0]}' is not a logical axis ({', '.join(LOGICAL_AXES)})")
    validate_pipeline(config.pipeline)
    validate_stage_layers(config)
    validate_xla(config.xla)
    validate_precision(config.precision)
    sizes = config.mesh.sizes()
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {', '.join(f'mesh.{a}' for a in fill)}")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}: size must be positive or -1, got {size}")
    for axis, size in (config.mesh.dcn.sizes() if config.mesh.dcn else {}).items():
        if size < 1:
            raise ConfigError(f"mesh.dcn.{axis}: size must be positive, got {size}")
    outside = bounds.out_of_range(config) or strict.unread(config)
    if outside:
        raise ConfigError(outside)
    refusals.check(refusals.Context(config))  # the rules naming two or more settings


def _validate_loop(config: Config) -> None:
    """Evaluation, non-finite policy and checkpoint settings."""
    t, ck = config.train, config.checkpoint
    for key, value, low in (
        ("train.eval_every", t.eval_every, 0),
        ("train.eval_steps", t.eval_steps, 1),
        ("train.max_consecutive_skips", t.max_consecutive_skips, 1),
        ("checkpoint.every", ck.every, 0),
        ("checkpoint.keep", ck.keep, 1),
        ("checkpoint.keep_every", ck.keep_every, 0),
        ("data.eval_bytes", config.data.eval_bytes, 1),
    ):
        if value < low:
            raise ConfigError(f"{key} must be at least {low}, got {value}")


def checkpoint_dir(config: Config) -> Path:
    """``checkpoint.dir``, or ``<run_dir>/checkpoints``."""
    return Path(config.checkpoint.dir or Path(config.run_dir) / "checkpoints").absolute()


def check_writable(directory: str | Path) -> None:
    """Raise a :class:`ConfigError` unless files can be created in ``directory`` (made if missing)."""
    path = Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint.dir {path} is a file, not a directory")
    probe = path / f".jaxscale-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"checkpoint.dir {path} is not writable: {e.strerror or e}") from e


def validate_pipeline(p: PipelineConfig) -> None:
    """The pipeline section on its own; what needs the mesh is checked at build
    (:meth:`jaxscale.layout.rules.Layout.validate`)."""
    if p.microbatches is not None and p.microbatches < 1:
        raise ConfigError(f"pipeline.microbatches must be at least 1, got {p.microbatches}")
    if p.repeats < 1:
        raise ConfigError(f"pipeline.repeats must be at least 1, got {p.repeats}")


def validate_stage_layers(config: Config) -> None:
    """``pipeline.layers_per_stage``: positive entries (their sum and unit against the model, and one entry per
    virtual stage on the resolved mesh, are rows of :mod:`jaxscale.config.refusals`)."""
    listed = config.pipeline.layers_per_stage
    if listed is None:
        return
    where = f"pipeline.layers_per_stage {listed}"
    if not listed or any(n < 1 for n in listed):
        raise ConfigError(f"{where}: every virtual stage needs at least one layer")


def validate_xla(xla: XlaConfig) -> None:
    """Flags of the form ``--name`` or ``--name=value`` (XLA checks the names); a compile cache that names something."""
    for i, flag in enumerate(xla.flags):
        if not flag.startswith("--") or len(flag) < 3 or any(c.isspace() for c in flag):
            raise ConfigError(f"xla.flags[{i}]: '{flag}' is not one flag of the form --name or --name=value")
    if not xla.compile_cache.strip():
        raise ConfigError("xla.compile_cache: give auto, off or a directory, not an empty string")


def validate_precision(p: PrecisionConfig) -> None:
    """The precision section on its own."""
    if p.amax_history < 1:
        raise ConfigError(f"precision.amax_history must be at least 1, got {p.amax_history}")
    if p.margin < 0:
        raise ConfigError(f"precision.margin must be at least 0, got {p.margin}")
    if p.fp8_block < 1:
        raise ConfigError(f"precision.fp8_block must be at least 1, got {p.fp8_block}")






