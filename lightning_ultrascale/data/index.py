"""A token file that describes itself: the index beside a flat ``.bin``, and the checks that read it.

``corpus.bin`` keeps the nanoGPT/Megatron layout (ids back to back, native byte order, no
header), so their readers keep working. ``ultrascale-tokenize`` writes beside it:

==========================  ==================================================================
``corpus.index.json``       dtype, vocabulary size, tokenizer (name, content hash, files), bos
                            and eos ids, token and document counts, the inputs
``corpus.docs.npy``         document start offsets, int64, ``n_documents + 1`` (Megatron's
                            ``.idx`` keeps the same)
``corpus.tokenizer/``       the tokenizer's files (export copies them into the HF directory)
==========================  ==================================================================

The dtype follows the vocabulary (uint16 up to 65,536 ids, uint32 beyond), so it can never be
misread through the index. A ``.bin`` without an index is read with ``data.dtype``, and a uint32
file read as uint16 is refused: its odd 16-bit words, the high halves of the ids, all stay below
``ceil(vocab / 65,536)`` (0 or 1 for every vocabulary of today), which real uint16 text never does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from lightning_ultrascale.errors import ConfigError

INDEX_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")


def dtype_for_vocabulary(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a vocabulary.

    Example:
        >>> dtype_for_vocabulary(32000), dtype_for_vocabulary(65536), dtype_for_vocabulary(129280)
        ('uint16', 'uint16', 'uint32')
    """
    return "uint16" if vocab_size <= 2**16 else "uint32"


def index_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".index.json")


def documents_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".docs.npy")


def tokenizer_dir(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".tokenizer")


@dataclass(frozen=True)
class TokenIndex:
    """What a token file holds (``corpus.index.json``); see the module docstring."""

    dtype: str
    vocab_size: int
    tokenizer: str
    tokenizer_hash: str
    bos_id: int
    eos_id: int
    n_tokens: int
    n_documents: int
    tokenizer_files: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    version: int = INDEX_VERSION

    def write(self, bin_path: Path) -> None:
        index_path(bin_path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, bin_path: str | Path, option: str = "data.source") -> TokenIndex | None:
        """The index of ``bin_path``, checked against the file; None if it has none."""
        path = index_path(bin_path)
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{option}={bin_path}: its index {path} cannot be read ({e})") from None
        unset = dataclasses.MISSING
        required = [f.name for f in fields(cls) if f.default is unset and f.default_factory is unset]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ConfigError(
                f"{option}={bin_path}: its index {path} lacks {', '.join(missing)}; write it again with "
                "ultrascale-tokenize"
            )
        index = cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        if index.dtype not in TOKEN_DTYPES:
            valid = ", ".join(TOKEN_DTYPES)
            raise ConfigError(f"{option}={bin_path}: its index says dtype={index.dtype!r}; valid: {valid}")
        size = Path(bin_path).stat().st_size
        expected = index.n_tokens * np.dtype(index.dtype).itemsize
        if size != expected:
            raise ConfigError(
                f"{option}={bin_path} has {size} bytes, but its index says {index.n_tokens} {index.dtype} tokens "
                f"({expected} bytes): the file was changed or cut after tokenizing; tokenize it again"
            )
        return index

    def document_offsets(self, bin_path: str | Path) -> np.ndarray:
        """Start offsets of the documents and the end, ``[n_documents + 1]`` int64."""
        return np.load(documents_path(bin_path), mmap_mode="r")


def check_token_dtype(path: Path, dtype: str, option: str = "data.source") -> None:
    """Refuse a uint32 (or int32) file read as uint16: the odd 16-bit words would be the ids' high halves."""
    if dtype != "uint16" or path.stat().st_size % 4:
        return
    words = np.memmap(path, dtype=np.uint16, mode="r")
    sample = np.asarray(words[: min(len(words), 1 << 21) // 2 * 2])
    if sample.size < 2048:
        return
    high, low = sample[1::2], sample[0::2]
    # ceil(vocab / 65,536) - 1 <= 3 for every vocabulary below 262,144 ids.
    if int(high.max()) <= 3 and int(low.max()) > 3:
        raise ConfigError(
            f"{option}={path} looks like 32-bit token ids read as data.dtype=uint16 (every second 16-bit word is "
            f"at most {int(high.max())}: the high halves of 32-bit ids); set data.dtype=uint32, or tokenize it with "
            "ultrascale-tokenize, which writes an index that says its dtype"
        )
