"""The pure-torch reference of every op in :mod:`lightning_ultrascale.kernels`: the numerics to match.

Each fast path (Triton, Liger, ``torch.compile``) is tested against these, forward and backward.
They are also what runs on DTensor inputs (sequence-parallel norms), where DTensor's own sharding
rules do the distributed part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["apply_rope", "cross_entropy", "linear_cross_entropy", "rms_norm", "rope", "swiglu"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)`` over the last dim, normalised in fp32 and cast back before the weight (HF Llama)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``: the gated activation of a SwiGLU MLP (``gate = w1 x``, ``up = w3 x``)."""
    return F.silu(gate) * up


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by RoPE angles, HF ``rotate_half`` layout.

    Computed in fp32 and cast back: in bf16 the rotation of far positions loses most of its
    precision (torchtitan also rotates in fp32).
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE of queries and keys; ``cos``/``sin`` are ``[b, 1, s, head_dim]`` (the two halves repeated)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits [..., vocab]`` over the ``labels [...]`` that are not -100, in fp32.

    Vocabulary-sharded DTensor logits (tensor parallelism) run under DTensor's ``loss_parallel``.
    """
    # fp32 loss whatever the compute precision: the softmax over a 128k vocab loses too much in bf16.
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """:func:`cross_entropy` of ``h [..., dim] @ weight.T`` (``weight [vocab, dim]``), the logits materialised."""
    return cross_entropy(F.linear(h, weight), labels)
