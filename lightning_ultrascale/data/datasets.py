"""Token streams cut into fixed-length training sequences.

Sequences are packed: consecutive, non-overlapping windows of ``seq_len`` tokens over the whole
stream, documents separated only by their bos/eos ids (as nanoGPT and Megatron do), so no token is
padding and every batch has exactly ``batch * seq_len`` target tokens — which keeps the global
token count, the loss normaliser (utils/loss.py), independent of the data.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_ultrascale.data.index import TOKEN_DTYPES, TokenIndex, check_token_dtype
from lightning_ultrascale.errors import ConfigError


class PackedDataset(Dataset[dict[str, torch.Tensor]]):
    """Item ``i`` is the window ``tokens[i*L : i*L+L]`` and its next-token labels, shifted by one.

    ``len`` is ``(n_tokens - 1) // seq_len``: the last window needs one more token for its labels.

    Example:
        >>> ds = PackedDataset(torch.arange(10), seq_len=3)
        >>> len(ds), ds[1]["input_ids"].tolist(), ds[1]["labels"].tolist()
        (3, [3, 4, 5], [4, 5, 6])
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int) -> None:
        if seq_len <= 0:
            raise ConfigError(f"data.seq_len={seq_len} must be > 0")
        # numpy throughout: a memmap stays on disk and is read one window at a time.
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        start = index * self.seq_len
        # astype copies: the batch must not alias a read-only memmap.
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


def _open_token_file(path: Path, dtype: str | None) -> np.memmap:
    """The tokens of ``path`` in the dtype its index records (or ``dtype``, checked), memory-mapped."""
    if not path.is_file():
        raise ConfigError(
            f"data.source={path} does not exist; create it with `ultrascale-tokenize INPUT {path}` "
            "or use data.source=pydoc (the bundled corpus)"
        )
    dtype = resolve_dtype(path, dtype)
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ConfigError(
            f"data.source={path} has {size} bytes, not a multiple of {itemsize} as data.dtype={dtype} needs; "
            f"set data.dtype to the one the file was written with (valid: {', '.join(TOKEN_DTYPES)})"
        )
    if size == 0:
        raise ConfigError(f"data.source={path} is empty; write tokens into it with `ultrascale-tokenize`")
    return np.memmap(path, dtype=dtype, mode="r")


def resolve_dtype(path: Path, dtype: str | None) -> str:
    """The dtype to read ``path`` with: its index's (``dtype`` must agree), else ``dtype`` (uint16 by default), checked.

    Example:
        >>> resolve_dtype(Path("corpus.bin"), "uint8")  # doctest: +SKIP
        ConfigError: data.dtype=uint8 is not supported; valid: uint16, uint32
    """
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.dtype={dtype} is not supported; valid: {', '.join(TOKEN_DTYPES)}")
    index = TokenIndex.read(path)
    if index is not None:
        if dtype is not None and dtype != index.dtype:
            raise ConfigError(
                f"data.dtype={dtype}, but data.source={path} holds {index.dtype} tokens (its index says so, for "
                f"{index.tokenizer}'s {index.vocab_size} ids); drop data.dtype: the index tells"
            )
        return index.dtype
    dtype = dtype or "uint16"
    check_token_dtype(path, dtype)
    return dtype


class MemmapTokenDataset(PackedDataset):
    """:class:`PackedDataset` over a flat token file (no header, native byte order), read lazily.

    The nanoGPT/Megatron ``.bin`` format, as written by ``ultrascale-tokenize``.

    Example:
        >>> ds = MemmapTokenDataset("corpus.bin", seq_len=256)  # doctest: +SKIP
        >>> ds[0]["input_ids"].shape  # doctest: +SKIP
        torch.Size([256])

    ``dtype``: None reads the file's index (``ultrascale-tokenize`` writes one); without an index,
    uint16 unless told otherwise.

    Raises:
        ConfigError: the file is missing, ``dtype`` is not uint16/uint32 or disagrees with the index,
            the file's bytes say another dtype, the file size is not a multiple of the dtype size, or
            it is empty.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | None = None) -> None:
        self.path = Path(path)
        tokens = _open_token_file(self.path, dtype)
        self.dtype = str(tokens.dtype)
        super().__init__(tokens, seq_len)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling a memmap copies its data; DataLoader workers started by spawn would each get the
        # whole file. Reopen it by path instead.
        return (type(self), (self.path, self.seq_len, self.dtype))


def max_token_id(path: str | Path, dtype: str | None = None) -> int:
    """The largest token id in a token file, cached beside it (``<file>.maxid.json``) for the next run.

    Every rank of every run checks it against the model's vocabulary before any process group
    exists; a max over a large file costs one read, so it is remembered by size and modification
    time (where the file's directory is not writable, it is computed each time).
    """
    path = Path(path)
    dtype = resolve_dtype(path, dtype)
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype}
    cache = path.with_name(path.name + ".maxid.json")
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return int(cached["max_token_id"])
    except (OSError, ValueError):
        pass
    value = int(np.max(_open_token_file(path, dtype)))
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"key": key, "max_token_id": value}))
    return value
