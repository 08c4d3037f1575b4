"""Layers every model family shares: the norm, the attention kernel and the SwiGLU feed-forward.

Llama, MLA (DeepSeek) and the MoE experts' dense counterpart build on these; they import nothing
of a model family, so every family imports them without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ultrascale.kernels import reference
from lightning_ultrascale.models.common.documents import document_attention

__all__ = ["FeedForward", "RMSNorm", "causal_attention"]


class RMSNorm(nn.Module):
    """Root-mean-square norm, normalised in fp32 then cast back before the weight, as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel: Callable[[Tensor, Tensor, float], Tensor] = reference.rms_norm  # Llama.use_kernels sets it

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.weight, self.eps)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None = None) -> Tensor:
    """Causal SDPA of ``q [b, heads, s, d]`` over ``k, v [b, kv_heads, s, d]`` (grouped-query).

    ``documents``: the window's ``document_ids [b, s]``; attention then stays inside each
    document (:func:`~lightning_ultrascale.models.common.documents.document_attention`).
    """
    if documents is not None:
        return document_attention(q, k, v, documents)
    # Expanding kv heads ourselves instead of `enable_gqa=True` keeps every SDPA backend
    # (flash, memory-efficient, cuDNN, CPU) eligible; repeat_interleave is HF's `repeat_kv`
    # order: query head j reads kv head j // n_rep.
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``; w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.swiglu: Callable[[Tensor, Tensor], Tensor] = reference.swiglu

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))
