"""The documents of a corpus, one text at a time: text files, JSON lines (gzipped too), Parquet.

=====================  ===========================================================================
``.txt``               the whole file is one document (split a corpus into files for boundaries)
``.jsonl``,            one document per line, its text under ``text_key``
``.jsonl.gz``
``.parquet``           one document per row of the ``text_key`` column (``pyarrow``, read in batches)
a directory or glob    every file above in it, in sorted order (a directory is read recursively)
=====================  ===========================================================================

Nothing is read ahead of the document being handed out, so a corpus larger than memory streams.
A bad line or file fails with its path and line number.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from lightning_ultrascale.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
#: Parquet rows read at a time (a batch's texts are in memory together).
_PARQUET_ROWS = 1024


def _kind(path: Path) -> str | None:
    name = path.name
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def corpus_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files of ``inputs`` (files, directories, globs), in order; each input must yield at least one.

    Example:
        >>> corpus_files(["/nonexistent/*.jsonl"])
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ConfigError: input /nonexistent/*.jsonl matches no .txt, .jsonl, ... file
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
        elif any(c in str(item) for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(str(item), recursive=True) if _kind(Path(p)))
        elif path.is_file():
            if _kind(path) is None:
                raise ConfigError(f"input {path} is not a .txt, .jsonl, .jsonl.gz or .parquet file")
            found = [path]
        else:
            found = []
        if not found:
            raise ConfigError(f"input {item} matches no .txt, .jsonl, .jsonl.gz or .parquet file")
        files += found
    return files


def read_documents(files: Sequence[Path], text_key: str = "text") -> Iterator[str]:
    """Every document of ``files``, in order."""
    for path in files:
        kind = _kind(path)
        try:
            if kind == ".txt":
                yield path.read_text(encoding="utf-8")
            elif kind == ".parquet":
                yield from _parquet(path, text_key)
            else:
                yield from _json_lines(path, text_key, kind == ".jsonl.gz")
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise ConfigError(f"input {path} cannot be read: {e}") from None


def _json_lines(path: Path, text_key: str, compressed: bool) -> Iterator[str]:
    with gzip.open(path, "rt", encoding="utf-8") if compressed else path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"input {path} line {number} is not JSON ({e})") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"input {path} line {number} has no text under --text-key {text_key!r}; it has: {keys}"
                )
            yield text


def _parquet(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"input {path}: reading Parquet needs pyarrow: pip install 'lightning-ultrascale[data]'"
        ) from None
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise ConfigError(
            f"input {path} has no column {text_key!r} (--text-key); its columns: {', '.join(table.schema_arrow.names)}"
        )
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ConfigError(f"input {path} row {row}: column {text_key!r} holds {text!r}, not text")
            yield text
