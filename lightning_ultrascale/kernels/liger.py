"""Liger-Kernel's Triton kernels behind our op signatures (where their numerics match the reference).

Liger's RMSNorm ("llama" casting: normalise in fp32, cast back, then the weight), SwiGLU
(``silu(a) * b``), RoPE (``rotate_half`` layout) and fused linear cross-entropy compute what
:mod:`~lightning_ultrascale.kernels.reference` computes. Its fused cross-entropy has no
vocabulary-parallel form: with a vocabulary-sharded head weight (tensor parallelism) ours runs
(:func:`~lightning_ultrascale.kernels.get_kernels` routes DTensor inputs).
"""

from __future__ import annotations

from liger_kernel.transformers.functional import (
    liger_fused_linear_cross_entropy,
    liger_rms_norm,
    liger_rope,
    liger_swiglu,
)
from torch import Tensor

from lightning_ultrascale.utils.loss import IGNORE_INDEX

__all__ = ["linear_cross_entropy", "rms_norm", "rope", "swiglu"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out: Tensor = liger_rms_norm(x, weight, eps, casting_mode="llama", in_place=False)
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    out: Tensor = liger_swiglu(gate, up)
    return out


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    # Liger takes cos/sin as [b or 1, s, d] and unsqueezes the head dim itself; Liger writes into
    # its inputs, so give it contiguous copies (q and k are transposed views of the projections).
    q_out, k_out = liger_rope(q.contiguous(), k.contiguous(), cos[:, 0].float(), sin[:, 0].float())
    return q_out, k_out


def linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    loss: Tensor = liger_fused_linear_cross_entropy(
        h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
    return loss
