"""Token streams cut into fixed-length training sequences.

Sequences are packed: consecutive, non-overlapping windows of ``seq_len`` tokens over the whole
stream, so no token is padding and every batch has exactly ``batch * seq_len`` target tokens —
which keeps the global token count, the loss normaliser (utils/loss.py), independent of the data.

``documents`` says what a window knows of the documents in it:

* ``concat``: nothing; documents are separated only by their bos/eos ids (nanoGPT, Megatron's
  default, GPT and Llama 2 pretraining), and attention is plain causal.
* ``mask``: items also carry ``position_ids`` (restarting at 0 at each document start, and at the
  window's first token, as Megatron's ``reset_position_ids`` and torchtitan do) and
  ``document_ids`` (0 at the window's first token, +1 at each document start), from which the
  model keeps attention inside each document (models/common/documents.py).

``mask_eos_loss`` (either mode) ignores the label of each token whose next token starts another
document (eos predicting the next document's bos): documents are independent, so it is noise.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_ultrascale.data.index import TOKEN_DTYPES, TokenIndex, check_token_dtype, documents_path
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.utils.loss import IGNORE_INDEX

DOCUMENTS = ("concat", "mask")
#: Document starts checked for order at a time: a large corpus's docs.npy is never in memory whole.
_CHECK_CHUNK = 1 << 22


def check_documents(documents: str) -> None:
    """Refuse a ``data.documents`` value other than concat or mask."""
    if documents not in DOCUMENTS:
        raise ConfigError(f"data.documents={documents} is not supported; valid: {', '.join(DOCUMENTS)}")


def check_doc_starts(starts: torch.Tensor | np.ndarray, n_tokens: int, name: str = "doc_starts") -> np.ndarray:
    """``starts`` as a 1-D integer array, refused unless it starts at 0, never decreases and ends by ``n_tokens``.

    Example:
        >>> check_doc_starts(np.array([0, 5, 3]), n_tokens=10)
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ConfigError: doc_starts is not sorted; ...
    """
    starts = starts.numpy() if isinstance(starts, torch.Tensor) else np.asarray(starts)
    if starts.ndim != 1 or not starts.size or not np.issubdtype(starts.dtype, np.integer):
        problem = f"is not a 1-D integer array of document starts (shape {starts.shape}, dtype {starts.dtype})"
    elif starts[0] != 0:
        problem = f"starts at {int(starts[0])}, not 0"
    elif not all(np.all(np.diff(starts[i : i + _CHECK_CHUNK + 1]) >= 0) for i in range(0, starts.size, _CHECK_CHUNK)):
        problem = "is not sorted"
    elif starts[-1] > n_tokens:
        problem = f"ends at {int(starts[-1])}, past the {n_tokens} tokens"
    else:
        return starts
    raise ConfigError(f"{name} {problem}; tokenize the corpus again with ultrascale-tokenize")


class PackedDataset(Dataset[dict[str, torch.Tensor]]):
    """Item ``i`` is the window ``tokens[i*L : i*L+L]`` and its next-token labels, shifted by one.

    ``len`` is ``(n_tokens - 1) // seq_len``: the last window needs one more token for its labels.
    ``doc_starts``: the documents' start offsets into ``tokens`` (a ``docs.npy``: sorted, the first
    0, a last entry ``len(tokens)`` allowed), needed by ``documents="mask"`` and ``mask_eos_loss``;
    see the module docstring for both.

    Example:
        >>> ds = PackedDataset(torch.arange(10), seq_len=3)
        >>> len(ds), ds[1]["input_ids"].tolist(), ds[1]["labels"].tolist()
        (3, [3, 4, 5], [4, 5, 6])
        >>> ds = PackedDataset(torch.arange(10), 4, np.array([0, 2, 5]), documents="mask", mask_eos_loss=True)
        >>> item = ds[1]  # tokens 4..7 (labels 5..8); documents start at 5
        >>> item["position_ids"].tolist(), item["document_ids"].tolist(), item["labels"].tolist()
        ([0, 0, 1, 2], [0, 1, 1, 1], [-100, 6, 7, 8])
    """

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        doc_starts: torch.Tensor | np.ndarray | None = None,
        documents: str = "concat",
        mask_eos_loss: bool = False,
    ) -> None:
        if seq_len <= 0:
            raise ConfigError(f"data.seq_len={seq_len} must be > 0")
        check_documents(documents)
        # numpy throughout: a memmap stays on disk and is read one window at a time.
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        self.seq_len = seq_len
        self.documents, self.mask_eos_loss = documents, mask_eos_loss
        if doc_starts is None and (documents == "mask" or mask_eos_loss):
            raise ConfigError(
                f"data.documents={documents}, data.mask_eos_loss={mask_eos_loss} need the documents' starts "
                "(doc_starts); give them, or use data.documents=concat and data.mask_eos_loss=false"
            )
        self.doc_starts = None if doc_starts is None else check_doc_starts(doc_starts, len(self.tokens))

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        start = index * self.seq_len
        # astype copies: the batch must not alias a read-only memmap.
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        item = {"input_ids": window[:-1], "labels": window[1:]}
        if self.documents == "concat" and not self.mask_eos_loss:
            return item
        # Documents starting after the window's first token, up to the token its last label is.
        first, last = np.searchsorted(self.doc_starts, [start, start + self.seq_len], side="right")
        offsets = np.asarray(self.doc_starts[first:last], dtype=np.int64) - start  # in [1, seq_len]
        if self.mask_eos_loss:
            item["labels"] = item["labels"].clone()  # a view of input_ids until now
            item["labels"][torch.from_numpy(offsets - 1)] = IGNORE_INDEX
        if self.documents == "mask":
            item.update(document_positions(offsets[offsets < self.seq_len], self.seq_len))
        return item


def document_positions(starts: np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    """``position_ids`` and ``document_ids`` of a window whose documents start at ``starts`` (besides 0).

    Example:
        >>> {k: v.tolist() for k, v in document_positions(np.array([2, 3]), 5).items()}
        {'position_ids': [0, 1, 0, 0, 1], 'document_ids': [0, 0, 1, 2, 2]}
    """
    restart = np.zeros(seq_len, dtype=np.int64)
    restart[starts] = starts
    begins = np.zeros(seq_len, dtype=np.int64)
    begins[starts] = 1
    return {
        "position_ids": torch.from_numpy(np.arange(seq_len) - np.maximum.accumulate(restart)),
        "document_ids": torch.from_numpy(np.cumsum(begins)),
    }


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
    uint16 unless told otherwise. ``documents="mask"`` and ``mask_eos_loss`` read the document
    starts beside the file (``corpus.docs.npy``, memory-mapped too).

    Raises:
        ConfigError: the file is missing, ``dtype`` is not uint16/uint32 or disagrees with the index,
            the file's bytes say another dtype, the file size is not a multiple of the dtype size, or
            it is empty; the document starts are needed but missing or damaged.
    """

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        dtype: str | None = None,
        documents: str = "concat",
        mask_eos_loss: bool = False,
    ) -> None:
        self.path = Path(path)
        tokens = _open_token_file(self.path, dtype)
        self.dtype = str(tokens.dtype)
        starts = None
        if documents == "mask" or mask_eos_loss:
            starts = _open_doc_starts(self.path, len(tokens), documents, mask_eos_loss)
        super().__init__(tokens, seq_len, starts, documents, mask_eos_loss)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling a memmap copies its data; DataLoader workers started by spawn would each get the
        # whole file. Reopen it by path instead.
        return (type(self), (self.path, self.seq_len, self.dtype, self.documents, self.mask_eos_loss))


def _open_doc_starts(path: Path, n_tokens: int, documents: str, mask_eos_loss: bool) -> np.ndarray:
    """The document starts written beside ``path`` (memory-mapped), or a ConfigError saying how to get them."""
    docs = documents_path(path)
    # (what asked for the starts, the setting that does without them)
    options = [("data.documents=mask", "data.documents=concat")] if documents == "mask" else []
    options += [("data.mask_eos_loss=true", "data.mask_eos_loss=false")] if mask_eos_loss else []
    if not docs.is_file():
        raise ConfigError(
            f"{' and '.join(o for o, _ in options)} needs the document starts of data.source={path}, but it has no "
            f"{docs.name}; tokenize it again with `ultrascale-tokenize INPUT {path}` (which writes {docs.name}), "
            f"or set {' and '.join(i for _, i in options)}"
        )
    where = f"data.source={path}: its document starts {docs}"
    try:
        starts = np.load(docs, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} cannot be read ({e}); tokenize the corpus again with ultrascale-tokenize") from None
    return check_doc_starts(starts, n_tokens, where)


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
