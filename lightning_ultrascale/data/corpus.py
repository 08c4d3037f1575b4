"""The bundled corpus: CPython's own documentation, so the default job needs no download.

Every CPython ships ``pydoc_data.topics.topics`` (the text behind ``help("for")``): 79 topics and
~466 KB on Python 3.11, plain English prose with code — enough for a tiny Llama's loss to fall
visibly in a few hundred steps. The exact text differs between Python versions, so the corpus is
deterministic for one interpreter, not across them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from lightning_ultrascale.data.tokenizer import ByteTokenizer


def load_default_corpus_tokens() -> torch.Tensor:
    """All pydoc topics in sorted key order, each one document ``bos + bytes + eos``, as int64 ids.

    Example:
        >>> tokens = load_default_corpus_tokens()
        >>> tokens.dtype, tokens.ndim, int(tokens[0]) == ByteTokenizer.bos_id
        (torch.int64, 1, True)
    """
    return load_default_corpus_documents()[0]


def load_default_corpus_documents() -> tuple[torch.Tensor, np.ndarray]:
    """:func:`load_default_corpus_tokens` and its documents' start offsets (int64, the end last, as ``docs.npy``).

    Example:
        >>> tokens, starts = load_default_corpus_documents()
        >>> int(starts[0]), int(starts[-1]) == len(tokens), bool((tokens[starts[:-1]] == ByteTokenizer.bos_id).all())
        (0, True, True)
    """
    tokens, starts = _encoded_corpus()
    return torch.from_numpy(tokens.copy()), starts.copy()  # the caller's to change


@functools.cache
def _encoded_corpus() -> tuple[np.ndarray, np.ndarray]:
    """The corpus encoded once per process (~0.03 s; a forked process inherits it), read-only."""
    from pydoc_data.topics import topics

    tok = ByteTokenizer()
    documents = [np.asarray(tok.encode(topics[key]), dtype=np.int64) for key in sorted(topics)]
    starts = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    tokens = np.concatenate(documents)
    tokens.flags.writeable = starts.flags.writeable = False
    return tokens, starts
