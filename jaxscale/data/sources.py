"""Records from the forms corpora are distributed in: Parquet, Arrow, a saved ``datasets`` dataset, JSONL, text.

A source is one path:

- ``*.parquet``: read a row group at a time (``pyarrow.parquet``), only the named columns;
- ``*.arrow``: an Arrow IPC file or stream;
- a directory written by Hugging Face ``datasets``' ``save_to_disk`` (a ``Dataset``: ``state.json`` lists
  its Arrow stream files, read here with pyarrow: ``datasets`` itself is not needed, and nothing is
  downloaded); a ``DatasetDict``'s directory is refused, naming its splits;
- ``*.jsonl``: one JSON object per line;
- any other file: one plain-text document, its whole text in the one field asked for.

:func:`records` yields each record as a mapping of the named fields, checked before the first one is
read where the format has a schema (a Parquet file without the named column is one line) and per record
otherwise (a JSONL record without a field is one line naming its line). pyarrow is the ``data`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxscale.config.read import ConfigError

TABLE_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 1024


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as e:
        raise ConfigError("Parquet, Arrow and datasets sources need pyarrow: pip install 'jaxscale[data]'") from e
    return pyarrow


def is_table(path: Path) -> bool:
    """Whether ``path`` is read through pyarrow (a Parquet or Arrow file, or a saved ``datasets`` directory)."""
    return path.suffix in TABLE_SUFFIXES or path.is_dir()


def dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in order."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(f"{path}: a DatasetDict; name one split's directory ({', '.join(splits)})")
    try:
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state["_data_files"]]
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: a directory that is not a saved datasets dataset (no state.json)") from e
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}/state.json: not written by datasets' save_to_disk ({e})") from e


def _arrow_reader(path: Path) -> Any:
    """An Arrow IPC file or stream reader of ``path`` (memory-mapped)."""
    pa = _pyarrow()
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise ConfigError(f"{path}: not an Arrow file or stream ({e})") from e


def _check_columns(path: Path, names: Sequence[str], fields: Sequence[str]) -> None:
    missing = [f for f in fields if f not in names]
    if missing:
        raise ConfigError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")


def _table_batches(path: Path, fields: Sequence[str]) -> Iterator[Any]:
    """Record batches of ``fields`` of one Parquet or Arrow file, the columns checked first."""
    pa = _pyarrow()
    if path.suffix == ".parquet":
        try:
            parquet = pa.parquet.ParquetFile(str(path))
        except pa.ArrowInvalid as e:
            raise ConfigError(f"{path}: not a Parquet file ({e})") from e
        _check_columns(path, parquet.schema_arrow.names, fields)
        yield from parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=list(fields))
        return
    reader = _arrow_reader(path)
    _check_columns(path, reader.schema.names, fields)
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if hasattr(reader, "get_batch") \
        else reader
    for batch in batches:
        yield batch.select(list(fields))


def _table_records(path: Path, fields: Sequence[str]) -> Iterator[dict[str, Any]]:
    files = dataset_files(path) if path.is_dir() else [path]
    row = 0
    for file in files:
        for batch in _table_batches(file, fields):
            columns = {name: batch.column(name).to_pylist() for name in fields}
            for i in range(batch.num_rows):
                record = {name: columns[name][i] for name in fields}
                for name, value in record.items():
                    if not isinstance(value, str):
                        raise ConfigError(f"{path}: row {row + i}: field '{name}' is {value!r}, not a string")
                yield record
            row += batch.num_rows


def _jsonl_records(path: Path, fields: Sequence[str]) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            for name in fields:
                if not isinstance(record, dict) or not isinstance(record.get(name), str):
                    raise ConfigError(f"{path}:{lineno}: no string field '{name}'")
            yield {name: record[name] for name in fields}


def records(paths: Sequence[str | Path], fields: Sequence[str]) -> Iterator[dict[str, str]]:
    """The records of ``paths`` in order, each a mapping of ``fields`` to strings (a plain-text file is one
    record, its text under the one field asked for)."""
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"input file not found: {path}")
        try:
            if is_table(path):
                yield from _table_records(path, fields)
            elif path.suffix == ".jsonl":
                yield from _jsonl_records(path, fields)
            elif len(fields) == 1:
                yield {fields[0]: path.read_text(encoding="utf-8")}
            else:
                raise ConfigError(f"{path}: a plain-text file has no fields {', '.join(fields)} (JSONL or Parquet has)")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
