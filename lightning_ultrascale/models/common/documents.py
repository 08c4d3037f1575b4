"""Attention that never crosses a document: packed windows with ``document_ids``.

A packed window holds several documents back to back. With ``data.documents=mask`` each batch
carries ``document_ids [b, s]`` beside its ``position_ids``: the document each token belongs to,
counted from 0 at the window's first token and raised by one at each document start (so the ids
never decrease along the window, and every id between the first and the last is present). A query
attends to a key iff both are in the same document and the key is not after the query; positions
restart at each document (the data computes them), so RoPE sees each document from 0.

Under context parallelism the model still receives the WHOLE window's ``document_ids`` (every
``cp`` rank reads the same samples before its sequence is split), and the ring and all-to-all
attention cut out the parts they need (``parallel/context/attention.py``).

Kernels, one code path choosing by device (:func:`document_attention`):

* CUDA: FlashAttention's variable-length kernel (``torch.nn.attention.varlen``, the "THD"
  format of Megatron and TransformerEngine): the batch is flattened to one token stream and cut at
  every document start (``cu_seqlens``), so masked pairs are never computed. It needs a
  half-precision input; fp32 takes SDPA with a boolean mask (the memory-efficient kernel).
* inside a compiled block (``parallel.compile=true``), on any device: SDPA with the window's
  boolean mask, in one call (tiles and offsets are read on the host: no graph holds them).
* elsewhere: SDPA with a boolean mask, tile by tile (:func:`document_tiles`: tiles cut at document
  starts, so the pairs between tiles, all masked, are never computed; FlexAttention has no CPU
  backward in torch 2.13).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ultrascale.kernels import cuda


def document_mask(doc_q: Tensor, doc_k: Tensor, causal: bool, offset: int = 0) -> Tensor:
    """``[b, 1, sq, sk]`` booleans, True where query ``i`` may attend to key ``j``: same document (and causal).

    ``causal`` lets query ``i`` see key ``j`` when ``j <= i + offset``: ``offset`` is how many rows
    the keys start before the queries (0 for a block whose queries and keys are the same stretch of
    the window). An off-diagonal ring block, wholly after its keys, passes ``causal=False``.

    Example:
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> document_mask(docs, docs, causal=True)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    mask = doc_q[:, None, :, None] == doc_k[:, None, None, :]
    if causal:
        sq, sk = doc_q.shape[-1], doc_k.shape[-1]
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=doc_q.device).tril(offset)
    return mask


#: The fewest query rows a tile holds (:func:`document_tiles`): fewer, larger kernel calls.
MIN_TILE = 128


def document_tiles(document_ids: Tensor, min_rows: int | None = None) -> list[tuple[int, int, int]]:
    """``(start, stop, key_start)`` tiles of a window: query rows ``start:stop`` need keys ``key_start:stop`` only.

    Tiles are cut at document starts (of any row of the batch) once they hold ``min_rows`` rows
    (default :data:`MIN_TILE`);
    a tile's keys begin where the document of its first row begins (the earliest over the batch).
    Attention within documents is then block-diagonal: the pairs between documents of different
    tiles are never computed. Ids must not decrease along the window (as the data makes them).

    Example:
        >>> document_tiles(torch.tensor([[0] * 200 + [1] * 100 + [2] * 300]))
        [(0, 200, 0), (200, 600, 200)]
    """
    min_rows = MIN_TILE if min_rows is None else min_rows
    docs = document_ids.cpu().contiguous()
    seq = docs.shape[1]
    cuts = [*document_starts(docs).any(0).nonzero().flatten().tolist()[1:], seq]
    tiles, start = [], 0
    for cut in cuts:
        if cut - start >= min_rows or cut == seq:
            first = docs[:, start : start + 1].contiguous()
            key_start = int(torch.searchsorted(docs, first).min())
            tiles.append((start, cut, key_start))
            start = cut
    return tiles


def document_starts(document_ids: Tensor) -> Tensor:
    """``[b, s]`` booleans: True at each window's first token and wherever a new document begins."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


_MEMO: dict[tuple[int, str], tuple[Any, Any]] = {}


def memo(tensor: Tensor, key: str, compute: Callable[[Tensor], Any]) -> Any:
    """``compute(tensor)``, computed once per tensor object (every layer of a forward shares one).

    For values that need the host (cumulative lengths, the ring's plan): one device sync per
    micro-batch instead of one per layer. Held by a weak reference, so a new batch never reads
    an old batch's value, even at the same address.
    """
    slot = (id(tensor), key)
    found = _MEMO.get(slot)
    if found is not None and found[0]() is tensor:
        return found[1]
    value = compute(tensor)
    _MEMO[slot] = (weakref.ref(tensor, lambda _: _MEMO.pop(slot, None)), value)
    return value


def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return k, v


def _cu_seqlens(document_ids: Tensor) -> Tensor:
    starts = document_starts(document_ids).flatten().nonzero().flatten()
    end = torch.tensor([document_ids.numel()], device=starts.device)
    return torch.cat((starts, end)).to(torch.int32)


def _varlen_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> Tensor:
    """FlashAttention over the documents of the flattened batch (CUDA, half precision)."""
    b, h, s, _ = q.shape
    cu = memo(document_ids, "cu_seqlens", _cu_seqlens)
    k, v = _expand_kv(q, k, v)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[-1]) for t in (q, k, v)]
    # ``s`` bounds every document's length: no host read of the true maximum.
    return cuda.varlen_attention(*flat, cu, s).view(b, s, h, -1).transpose(1, 2)


def uses_varlen(q: Tensor) -> bool:
    """Whether :func:`document_attention` takes FlashAttention's variable-length kernel for ``q``."""
    return cuda.on_cuda(q) and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> Tensor:
    """Causal attention within documents: ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]``, ``document_ids [b, s]``.

    Example:
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> alone = F.scaled_dot_product_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], is_causal=True)
        >>> torch.allclose(document_attention(q, k, v, docs)[:, :, 2:], alone, atol=1e-6)
        True
    """
    if torch.compiler.is_compiling():
        # Inside a compiled block (lightning_ultrascale.Compile): one masked SDPA over the window.
        # The tiles and the varlen kernel's offsets are read on the host, which a graph cannot
        # hold (a graph break, or a new graph for every batch's document boundaries).
        k, v = _expand_kv(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, document_ids, True))
    if uses_varlen(q):
        return _varlen_attention(q, k, v, document_ids)
    k, v = _expand_kv(q, k, v)
    # Tile by tile (document_tiles): the masked pairs between tiles are never computed.
    outs = []
    for start, stop, key_start in memo(document_ids, "tiles", document_tiles):
        keys = slice(key_start, stop)
        mask = document_mask(document_ids[:, start:stop], document_ids[:, keys], True, start - key_start)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, keys], v[:, :, keys], attn_mask=mask))
    return torch.cat(outs, dim=2)
