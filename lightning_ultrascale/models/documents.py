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
* CPU: SDPA with a boolean ``[b, 1, s, s]`` mask (FlexAttention has no CPU backward in torch 2.13).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def document_mask(doc_q: Tensor, doc_k: Tensor, causal: bool) -> Tensor:
    """``[b, 1, sq, sk]`` booleans, True where query ``i`` may attend to key ``j``: same document (and ``j <= i``).

    ``causal`` compares local indices, so it is right for a block whose query and key rows are
    the same stretch of the window (a diagonal block); an off-diagonal ring block, wholly after its
    keys, passes ``causal=False``.

    Example:
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> document_mask(docs, docs, causal=True)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    mask = doc_q[:, None, :, None] == doc_k[:, None, None, :]
    if causal:
        sq, sk = doc_q.shape[-1], doc_k.shape[-1]
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=doc_q.device).tril()
    return mask


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
    from torch.nn.attention.varlen import varlen_attn

    b, h, s, _ = q.shape
    cu = memo(document_ids, "cu_seqlens", _cu_seqlens)
    k, v = _expand_kv(q, k, v)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[-1]) for t in (q, k, v)]
    # ``s`` bounds every document's length: no host read of the true maximum.
    out = varlen_attn(*flat, cu, cu, s, s, window_size=(-1, 0))
    return out.view(b, s, h, -1).transpose(1, 2)


def uses_varlen(q: Tensor) -> bool:
    """Whether :func:`document_attention` takes FlashAttention's variable-length kernel for ``q``."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> Tensor:
    """Causal attention within documents: ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]``, ``document_ids [b, s]``.

    Example:
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> alone = F.scaled_dot_product_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], is_causal=True)
        >>> torch.allclose(document_attention(q, k, v, docs)[:, :, 2:], alone, atol=1e-6)
        True
    """
    if uses_varlen(q) and v.shape[-1] == q.shape[-1]:
        return _varlen_attention(q, k, v, document_ids)
    k, v = _expand_kv(q, k, v)
    mask = document_mask(document_ids, document_ids, causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
