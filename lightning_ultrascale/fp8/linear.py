"""DeepSeek-V3's blockwise FP8 linear: FP8 tensor-core GEMMs on CUDA, emulated in pure torch elsewhere.

Every GEMM of a linear layer takes E4M3 operands with fp32 scales and accumulates in fp32
(DeepSeek-V3 technical report, section 3.3):

* forward ``y = x W^T``: ``x`` in 1 x 128 tiles along the input features, ``W`` in 128 x 128 blocks;
* input gradient ``dx = dy W``: ``dy`` in 1 x 128 tiles along the output features, ``W`` the same blocks;
* weight gradient ``dW = dy^T x``: both in 128 x 1 tiles, along the tokens (the reduction dim).

On a GPU with FP8 tensor cores each GEMM is one ``torch.nn.functional.scaled_mm`` call with
torch's blockwise recipes (``BlockWise1x128`` with ``BlockWise128x128`` forward and for ``dx``,
``1x128`` with ``1x128`` for ``dW``; the layouts those want are built in :func:`_scaled_mm`).
Emulation (the CPU reference) dequantises each operand (``data * scale``, exact in fp32) and
multiplies in fp32, so the result is what an FP8 tensor-core GEMM with fp32 accumulation
computes, up to the order of the additions. Backward keeps the quantised ``x`` and ``W`` (E4M3
bytes plus scales), as a real FP8 kernel does, not the high-precision ones.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.kernels.quantize import TILE, Quantized, quantize

__all__ = ["blockwise_fp8_linear", "quantize_input", "quantize_weight"]

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _mm(a: Quantized, b: Quantized, emulate: bool, dtype: torch.dtype) -> Tensor:
    """``a @ b^T`` of two quantised 2-D operands (``a`` in 1 x 128 tiles), accumulated in fp32."""
    if emulate:
        return (a.dequantize() @ b.dequantize().t()).to(dtype)
    return _scaled_mm(a, b, dtype)


def _column_major(t: Tensor) -> Tensor:
    return t.t().contiguous().t()


def _scaled_mm(a: Quantized, b: Quantized, dtype: torch.dtype) -> Tensor:
    """``a @ b^T`` as one FP8 tensor-core GEMM: torch's blockwise ``scaled_mm`` (CUDA, sm90).

    torch wants the second operand column-major (``b^T`` of a row-major ``b`` is), 1 x 128 scales
    "outer-dim major" (``[rows, K / 128]`` with stride ``(1, rows)``), and a 128 x 128 operand's
    scales as ``[round_up(K / 128, 4), N / 128]``, column-major (padded rows are never read).
    """
    import torch.nn.functional as F

    kinds = {"tile": F.ScalingType.BlockWise1x128, "block": F.ScalingType.BlockWise128x128}
    scale_a = _column_major(a.scale)
    if b.granularity == "tile":
        scale_b = _column_major(b.scale)
    else:
        blocks_n, blocks_k = b.scale.shape
        padded = b.scale.new_zeros(blocks_n, -(-blocks_k // 4) * 4)
        padded[:, :blocks_k] = b.scale
        scale_b = padded.t()  # [L4, N / 128], stride (1, L4)
    return cuda.scaled_mm(a.data, b.data.t(), scale_a, kinds[a.granularity], scale_b, kinds[b.granularity], dtype)


def _pad_tokens(t: Tensor) -> Tensor:
    """``t [features, tokens]`` with zero columns up to a multiple of 128 tokens, contiguous."""
    pad = -t.shape[1] % TILE
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()


def quantize_input(x: Tensor, requantize: bool = True) -> tuple[Quantized, Quantized]:
    """``x [tokens, in]`` in 1 x 128 tiles (forward GEMM), and ``x^T`` in tiles along the tokens (``dW``).

    The transposed copy is re-quantised from the E4M3 values of the first, as DeepSeek-V3 caches
    activations in FP8 (``requantize=False``: from ``x`` itself, for the gradient ``dy``); a token count
    that is not a multiple of 128 is padded with zero tokens (they add nothing to ``dW``). On a CUDA
    GPU one Triton kernel writes both (:mod:`lightning_ultrascale.kernels.triton_fp8`), with the same bits.
    """
    if cuda.on_cuda(x) and _HAS_TRITON:
        from lightning_ultrascale.kernels.triton_fp8 import tile_quantize_with_transpose

        return tile_quantize_with_transpose(x, requantize)
    qx = quantize(x, "tile")
    return qx, quantize(_pad_tokens(qx.dequantize().t() if requantize else x.t()), "tile")


def quantize_weight(weight: Tensor, emulate: bool) -> tuple[Quantized, Quantized]:
    """``W`` and ``W^T`` in 128 x 128 blocks: the forward's operand and ``dx = dy W``'s (the same values).

    The tensor-core GEMM reads its second operand column-major: ``W^T`` is then a contiguous copy. On a
    CUDA GPU one Triton kernel writes both (:mod:`lightning_ultrascale.kernels.triton_fp8`), with the same bits.
    """
    if cuda.on_cuda(weight) and _HAS_TRITON:
        from lightning_ultrascale.kernels.triton_fp8 import block_quantize_with_transpose

        return block_quantize_with_transpose(weight)
    qw = quantize(weight, "block")
    w_t = qw.data.t() if emulate else qw.data.t().contiguous()
    return qw, Quantized(w_t, qw.scale.t().contiguous(), "block")


class _BlockwiseFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, emulate: bool) -> Tensor:
        qx, qx_t = quantize_input(x.reshape(-1, x.shape[-1]))
        qw, w_t = quantize_weight(weight, emulate)
        # Backward needs x only for dW, tiled along the tokens: keep that E4M3 copy (same bytes).
        ctx.save_for_backward(qx_t.data, qx_t.scale, w_t.data, w_t.scale)
        ctx.shape, ctx.dtype, ctx.weight_dtype, ctx.emulate = x.shape, x.dtype, weight.dtype, emulate
        return _mm(qx, qw, emulate, x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        xt_data, xt_scale, wt_data, wt_scale = ctx.saved_tensors
        qx_t, w_t = Quantized(xt_data, xt_scale, "tile"), Quantized(wt_data, wt_scale, "block")
        # dy tiled along the output features (dx = dy W) and along the tokens (dW = dy^T x, the dim the
        # GEMM reduces), both from dy: one pass on a GPU.
        qdy, qdy_t = quantize_input(dy.reshape(-1, dy.shape[-1]), requantize=False)
        dx = _mm(qdy, w_t, ctx.emulate, ctx.dtype)
        dw = _mm(qdy_t, qx_t, ctx.emulate, torch.float32)
        return dx.reshape(ctx.shape), dw.to(ctx.weight_dtype), None


def blockwise_fp8_linear(x: Tensor, weight: Tensor, emulate: bool = True) -> Tensor:
    """``x @ weight^T`` with DeepSeek-V3's blockwise FP8 recipe (see the module docstring).

    ``weight [out, in]`` with both dims multiples of 128; ``x [..., in]`` with any number of tokens
    (the weight gradient's 128 x 1 tiles pad the last one with zeros). ``emulate=False`` runs FP8
    tensor-core GEMMs (CUDA, FP8-capable GPU).

    Example:
        >>> import torch
        >>> x, w = torch.randn(128, 256, requires_grad=True), torch.randn(128, 256, requires_grad=True)
        >>> y, exact = blockwise_fp8_linear(x, w).detach(), (x @ w.t()).detach()
        >>> y.shape, float((y - exact).norm() / exact.norm()) < 0.1
        (torch.Size([128, 128]), True)
    """
    return _BlockwiseFP8Linear.apply(x, weight, emulate)
