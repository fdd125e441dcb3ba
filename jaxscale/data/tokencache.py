"""Raw sources as ``data.path``: tokenized once by ``prepare-data`` into the user's cache, never beside the data.

``data.path`` names either a ``prepare-data`` directory (it has ``meta.json``) or a raw source of
:mod:`jaxscale.data.sources` (Parquet, Arrow, JSONL, a saved ``datasets`` directory). A raw source is prepared
(:func:`jaxscale.data.prepare.prepare_data`, with ``data.tokenizer`` and the ``data.*_field`` keys) into
``<cache>/<name>-<key>``: ``<cache>`` is ``data.cache_dir`` (default ``$XDG_CACHE_HOME/jaxscale/tokens``,
``~/.cache/jaxscale/tokens`` without it, as Hugging Face's ``datasets`` keeps its caches), ``<name>`` the
source's file or directory name, and ``key`` hashes those settings, the source's absolute path and its
files' names, sizes and modification times: the next run with the same settings finds it and reads it as
it is; a changed file or setting prepares a new one. A source's own directory is never written into, nor
the directory holding it (which may be read-only, or shared). A preparation that fails leaves nothing
(:func:`jaxscale.data.prepare.prepare_data`). Nothing is downloaded. Preparation runs before anything compiles,
in one process: a multi-process run asks for the directory prepared beforehand.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from jaxscale.config.read import ConfigError, DataConfig
from jaxscale.data.prepare import prepare_data
from jaxscale.data.sources import dataset_files

META = "meta.json"


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a ``prepare-data`` directory."""
    return (path / META).is_file()


def _files(source: Path) -> list[Path]:
    if source.is_dir():
        return [source / "state.json", *dataset_files(source)]
    return [source]


def cache_root(data: DataConfig) -> Path:
    """Where raw sources are prepared: ``data.cache_dir``, else ``$XDG_CACHE_HOME/jaxscale/tokens``, else
    ``~/.cache/jaxscale/tokens``."""
    if data.cache_dir:
        return Path(data.cache_dir).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxscale" / "tokens"


def cache_key(source: Path, data: DataConfig) -> str:
    """A hash of the preparation settings, the source's absolute path and its files' names, sizes and
    modification times."""
    settings = {"tokenizer": data.tokenizer, "text_field": data.text_field, "prompt_field": data.prompt_field,
                "response_field": data.response_field, "source": str(source.absolute())}
    tokenizer = Path(data.tokenizer)
    if data.tokenizer != "byte" and tokenizer.is_file():
        settings["tokenizer_sha256"] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in _files(source)]
    return hashlib.sha256(json.dumps([settings, stats], sort_keys=True).encode()).hexdigest()[:16]


def token_dir(path: str | Path, data: DataConfig, processes: int = 1, key: str = "data.path") -> Path:
    """The ``prepare-data`` directory of ``path`` (the config key ``key``): itself, or its cache (prepared here
    if absent)."""
    source = Path(path)
    if not source.exists():
        raise ConfigError(f"{key}: {source} does not exist")
    saved = (source / "state.json").is_file() or (source / "dataset_dict.json").is_file()
    if source.is_dir() and (is_prepared(source) or not saved):
        return source  # a prepare-data directory (TokenDir.open says what a directory without meta.json lacks)
    out = cache_root(data) / f"{source.name}-{cache_key(source, data)}"
    if is_prepared(out):
        return out
    if processes > 1:
        raise ConfigError(f"{key}: {source} is not prepared; run one process first, or prepare-data it into "
                          f"{out}")
    prepare_data([source], out, data.tokenizer, data.text_field, prompt_field=data.prompt_field,
                 response_field=data.response_field)
    return out
