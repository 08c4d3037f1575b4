"""``ultrascale-tokenize``: text files -> a flat token ``.bin`` for :class:`MemmapTokenDataset`.

Each input file is ONE document (``bos + UTF-8 bytes + eos``), in the order given; split a corpus
into files to get document boundaries. Blank lines are not boundaries, because prose uses them
between paragraphs of one document. The output is the nanoGPT/Megatron flat format: token ids
back to back, no header, native byte order::

    ultrascale-tokenize book.txt essays.txt corpus.bin --dtype uint16
    ultrascale-train data.source=corpus.bin
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lightning_ultrascale.data.datasets import TOKEN_DTYPES
from lightning_ultrascale.data.tokenizer import ByteTokenizer


def main(argv: Sequence[str] | None = None) -> None:
    """Tokenize ``INPUT...`` into ``OUTPUT`` and print the token count.

    Returns None: the console script passes the return value to ``sys.exit``.

    Example:
        >>> main(["notes.txt", "notes.bin"])  # doctest: +SKIP
        wrote 1234 tokens (uint16) to notes.bin
    """
    parser = argparse.ArgumentParser(
        prog="ultrascale-tokenize",
        description="Byte-tokenize text files (one document per file) into a flat token .bin file.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="UTF-8 text file, one document")
    parser.add_argument("output", type=Path, metavar="OUTPUT", help="flat token file to write")
    parser.add_argument("--dtype", choices=TOKEN_DTYPES, default="uint16", help="token id type")
    args = parser.parse_args(argv)

    for path in args.inputs:
        if not path.is_file():
            parser.error(f"input {path} does not exist")
    tok = ByteTokenizer()
    if tok.vocab_size > np.iinfo(args.dtype).max + 1:
        parser.error(f"--dtype {args.dtype} cannot hold vocab_size={tok.vocab_size}; use uint32")

    n_tokens = 0
    with args.output.open("wb") as out:
        # One document in memory at a time: the output may be far larger than RAM.
        for path in args.inputs:
            ids = np.asarray(tok.encode(path.read_text(encoding="utf-8")), dtype=args.dtype)
            ids.tofile(out)
            n_tokens += ids.size
    print(f"wrote {n_tokens} tokens ({args.dtype}) to {args.output}")
