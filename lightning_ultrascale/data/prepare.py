"""``ultrascale-tokenize``: a corpus -> a flat token ``.bin`` with its index, in parallel, in bounded memory.

::

    ultrascale-tokenize corpus/*.jsonl.gz corpus.bin --tokenizer /models/Llama-3.1-8B --workers 8
    ultrascale-train data=tokens data.source=corpus.bin model.vocab_size=128256

Each document (see :mod:`.documents` for the inputs) becomes ``bos + tokenizer.encode(text,
add_special_tokens=False) + eos``, documents back to back in input order. Beside the ``.bin``
(the nanoGPT/Megatron layout) go its index, its document offsets and the tokenizer's files
(:mod:`.index`). The dtype follows the vocabulary.

Parallelism and memory: the main process reads documents and cuts them into pieces of about
``min(chunk_bytes / (2 (workers + 1)), 1 MB)`` of text; ``workers`` processes encode pieces, at most
``workers + 1`` in flight, and the main process writes their tokens in input order, so the output
is byte-identical for any ``workers`` and the memory held is a few pieces (a chunk), whatever the
corpus size.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_ultrascale.data.documents import corpus_files, read_documents
from lightning_ultrascale.data.index import TokenIndex, documents_path, dtype_for_vocabulary, tokenizer_dir
from lightning_ultrascale.data.tokenizer import TextTokenizer, load_tokenizer, tokenizer_hash
from lightning_ultrascale.errors import ConfigError, reported

DEFAULT_CHUNK_BYTES = 64 << 20
_PIECE_BYTES = 1 << 20

_worker_tokenizer: TextTokenizer | None = None


def _init_worker(tokenizer: TextTokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode(piece: list[str], tokenizer: TextTokenizer | None = None, dtype: str = "uint32") -> tuple[Any, Any]:
    """A piece's documents framed by bos/eos: all tokens ``[n]`` and each document's length ``[documents]``."""
    tok = tokenizer or _worker_tokenizer
    assert tok is not None
    arrays = [np.asarray([tok.bos_id, *tok.encode_text(text), tok.eos_id], dtype=dtype) for text in piece]
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype), lengths


def _pieces(documents: Iterator[str], piece_bytes: int) -> Iterator[list[str]]:
    piece: list[str] = []
    size = 0
    for text in documents:
        piece.append(text)
        size += len(text)
        if size >= piece_bytes:
            yield piece
            piece, size = [], 0
    if piece:
        yield piece


def tokenize_corpus(
    inputs: Sequence[str | Path],
    output: str | Path,
    tokenizer: TextTokenizer,
    text_key: str = "text",
    workers: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = False,
    encoder: Encoder | None = None,
) -> TokenIndex:
    """Tokenize ``inputs`` into ``output`` (``.bin``) and its index; return the index.

    ``encoder``: a running :class:`Encoder` to use (its workers), else one of ``workers`` for this call.

    Example:
        >>> tokenize_corpus(["docs/"], "docs.bin", load_tokenizer("byte"))  # doctest: +SKIP
    """
    if encoder is None:
        with Encoder(tokenizer, workers) as own:
            return tokenize_corpus(inputs, output, tokenizer, text_key, chunk_bytes=chunk_bytes, progress=progress,
                                   encoder=own)  # fmt: skip
    if encoder.tokenizer is not tokenizer:
        raise ValueError("tokenize_corpus: the encoder runs another tokenizer than the one the index would record")
    output, files, dtype = Path(output), corpus_files(inputs), dtype_for_vocabulary(tokenizer.vocab_size)
    # Pieces of at most 1 MB of text: enough to amortise a worker's round trip, small enough to keep
    # both workers busy on a corpus of a few MB.
    piece_bytes = max(1, min(chunk_bytes // (2 * (encoder.workers + 1)), _PIECE_BYTES))
    pieces = _pieces(read_documents(files, text_key), piece_bytes)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        lengths_file = Path(tmp) / "lengths.bin"
        n_tokens, n_documents = _write_tokens(encoder.map(pieces, dtype), output, lengths_file, progress)
        if n_documents == 0:
            output.unlink()
            raise ConfigError(f"inputs {', '.join(map(str, inputs))} hold no document: nothing to tokenize")
        _write_offsets(lengths_file, n_documents, documents_path(output))
    index = TokenIndex(
        dtype=dtype,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.name,
        tokenizer_hash=tokenizer_hash(tokenizer.files),
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        n_tokens=n_tokens,
        n_documents=n_documents,
        tokenizer_files=[f.name for f in tokenizer.files],
        inputs=[str(f) for f in files],
    )
    _copy_tokenizer(tokenizer, tokenizer_dir(output))
    index.write(output)
    return index


def _write_tokens(
    encoded: Iterable[tuple[np.ndarray, np.ndarray]], output: Path, lengths_file: Path, progress: bool
) -> tuple[int, int]:
    """Append each piece's tokens to ``output`` and its document lengths to ``lengths_file``: (tokens, documents)."""
    n_tokens = n_documents = 0
    start = time.monotonic()
    bar = _bar(progress)
    with output.open("wb") as out, lengths_file.open("wb") as lengths_out:
        for tokens, lengths in encoded:
            tokens.tofile(out)
            lengths.tofile(lengths_out)
            n_tokens += tokens.size
            n_documents += lengths.size
            if bar is not None:
                seconds = max(time.monotonic() - start, 1e-9)
                bar.update(lengths.size)
                bar.set_postfix_str(f"{n_documents / seconds:,.0f} docs/s, {n_tokens / seconds:,.0f} tokens/s")
    if bar is not None:
        bar.close()
    return n_tokens, n_documents


class Encoder:
    """Encodes pieces of documents in order: in this process, or in ``workers`` processes.

    A context manager that keeps its worker pool for several corpora (``tokenize_corpus(...,
    encoder=...)``). At most ``workers + 1`` pieces are in flight (``Pool.imap`` would read the
    whole input ahead). Workers are forked: they start from this process's tokenizer, and the
    garbage collector is frozen while forking so that they leave the inherited objects' pages alone.

    Example:
        >>> with Encoder(load_tokenizer("byte"), workers=2) as encoder:  # doctest: +SKIP
        ...     tokenize_corpus(["a.jsonl"], "a.bin", encoder.tokenizer, encoder=encoder)
    """

    def __init__(self, tokenizer: TextTokenizer, workers: int = 1) -> None:
        if workers < 1:
            raise ConfigError(f"--workers {workers} must be >= 1")
        self.tokenizer, self.workers = tokenizer, workers
        self._pool: Any = None

    def __enter__(self) -> Encoder:
        if self.workers > 1:
            gc.freeze()
            try:
                self._pool = mp.get_context("fork").Pool(
                    self.workers, initializer=_init_worker, initargs=(self.tokenizer,)
                )
            finally:
                gc.unfreeze()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def map(self, pieces: Iterator[list[str]], dtype: str) -> Iterator[Any]:
        """Each piece's ``(tokens, document lengths)``, in order."""
        if self._pool is None:
            for piece in pieces:
                yield _encode(piece, self.tokenizer, dtype)
            return
        window: deque[Any] = deque()
        for piece in pieces:
            window.append(self._pool.apply_async(_encode, (piece, None, dtype)))
            if len(window) > self.workers:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


def _write_offsets(lengths_file: Path, n_documents: int, path: Path) -> None:
    """Document start offsets (and the end) as an ``.npy``, streamed from the lengths written so far."""
    lengths = np.memmap(lengths_file, dtype=np.int64, mode="r")
    offsets = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(n_documents + 1,))
    offsets[0] = 0
    step, total = 1 << 20, 0
    for begin in range(0, n_documents, step):
        part = np.cumsum(lengths[begin : begin + step]) + total
        offsets[begin + 1 : begin + 1 + part.size] = part
        total = int(part[-1])
    offsets.flush()
    del offsets


def _copy_tokenizer(tokenizer: TextTokenizer, where: Path) -> None:
    if where.exists():
        shutil.rmtree(where)
    if tokenizer.files:
        where.mkdir()
        for f in tokenizer.files:
            shutil.copy2(f, where / f.name)


def _bar(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``ultrascale-tokenize``; prints what it wrote.

    Returns None: the console script passes the return value to ``sys.exit``.

    Example:
        >>> main(["notes.txt", "notes.bin"])  # doctest: +SKIP
        wrote 1,234 tokens of 1 documents (uint16, byte: 258 ids) to notes.bin
    """
    parser = argparse.ArgumentParser(
        prog="ultrascale-tokenize",
        description="Tokenize a corpus (.txt: one document per file; .jsonl/.jsonl.gz: one per line; .parquet: one "
        "per row; directories and globs of them) into a flat token .bin with its index.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="file, directory or glob")
    parser.add_argument("output", type=Path, metavar="OUTPUT", help="token file to write (.bin)")
    parser.add_argument(
        "--tokenizer", default="byte", help="byte (default), a tokenizer.json or a directory holding one, or a "
        "SentencePiece model file",
    )  # fmt: skip
    parser.add_argument("--tokenizer-name", help="the name recorded in the index (default: the tokenizer's own)")
    parser.add_argument("--bos-token", help="the tokenizer's bos token, where it cannot tell")
    parser.add_argument("--eos-token", help="the tokenizer's eos token, where it cannot tell")
    parser.add_argument("--text-key", default="text", help="the text field of .jsonl records / .parquet column")
    parser.add_argument("--workers", type=int, default=1, help="processes that encode (any number: same output)")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="text held in flight")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    with reported("ultrascale-tokenize"):
        tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_name, args.bos_token, args.eos_token)
        index = tokenize_corpus(
            args.inputs, args.output, tokenizer, args.text_key, args.workers, int(args.chunk_mb * 2**20),
            progress=not args.no_progress,
        )  # fmt: skip
    print(
        f"wrote {index.n_tokens:,} tokens of {index.n_documents:,} documents ({index.dtype}, {index.tokenizer}: "
        f"{index.vocab_size:,} ids) to {args.output}"
    )


if __name__ == "__main__":
    main()
