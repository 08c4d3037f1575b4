"""Triton: DeepSeek-V3's activation quantisation fused with the transpose its weight gradient needs.

The blockwise FP8 linear (:mod:`lightning_ultrascale.fp8.linear`) quantises its input ``x [tokens,
features]`` twice: in 1 x 128 tiles along the features for the forward GEMM, and, transposed, in
tiles along the tokens for the weight-gradient GEMM (``dW = dy^T x`` reduces over tokens), from
the E4M3 values of the first (DeepSeek-V3 caches activations in FP8). Eager PyTorch does that in
about ten passes over memory (amax, scale, cast; dequantise, transpose, pad, amax, scale, cast).
One program here loads a 128 x 128 block of ``x`` once and writes both E4M3 copies and their
scales: the row amax of the block is a forward tile's, the column amax of its dequantised values
a transposed tile's. No library has this op (torchao's blockwise kernels quantise one way at a time).

Numerics are :func:`~lightning_ultrascale.kernels.quantize.quantize`'s, bit for bit (tested in Triton's
interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import lightning_ultrascale.kernels.cuda as cuda
from lightning_ultrascale.kernels.quantize import E4M3, E4M3_MAX, TILE, Quantized

__all__ = ["block_quantize_with_transpose", "tile_quantize_with_transpose"]

_MIN_AMAX = 1e-12
_MAX_AMAX = torch.finfo(torch.float32).max


@triton.jit
def _quantize_block(x, axis: tl.constexpr, MIN_AMAX: tl.constexpr, MAX_AMAX: tl.constexpr, MAX: tl.constexpr):
    """E4M3 values and fp32 scales of 128-wide groups along ``axis`` of a block."""
    amax = tl.max(tl.abs(x), axis=axis)
    scale = tl.minimum(tl.maximum(amax, MIN_AMAX), MAX_AMAX) / MAX
    return _to_e4m3(x / tl.expand_dims(scale, axis), MAX), scale


@triton.jit
def _to_e4m3(x, MAX: tl.constexpr):
    v = tl.minimum(tl.maximum(x, -MAX), MAX)
    # Round to E4M3's grid in fp32 (to nearest, ties to even, as torch's cast does) so that the
    # cast below is exact: Triton's interpreter mis-rounds across a power of two (31.8 -> 16).
    # Normal range: keep 3 mantissa bits; the carry of a round-up moves into the exponent.
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals (below 2**-6) are multiples of 2**-9: adding 2**14 rounds to that grid.
    subnormal = (a + 16384.0) - 16384.0
    rounded = tl.where(a < 0.015625, subnormal, normal).to(tl.int32, bitcast=True)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # the sign bit, so -0.0 stays -0.0
    return (rounded | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _block_quantize_transpose(
    W, Q, QT, S, N, K, BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr, MAX_AMAX: tl.constexpr, MAX: tl.constexpr
):
    # One 128 x 128 block of the weight: one scale, its E4M3 values written as they are and transposed.
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (pid_k * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    w = tl.load(W + rows[:, None] * K + cols[None, :]).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    scale = tl.minimum(tl.maximum(amax, MIN_AMAX), MAX_AMAX) / MAX
    q = _to_e4m3(w / scale, MAX)
    tl.store(Q + rows[:, None] * K + cols[None, :], q)
    tl.store(QT + cols[:, None] * N + rows[None, :], tl.trans(q))
    tl.store(S + pid_n * (K // BLOCK) + pid_k, scale)


@triton.jit
def _tile_quantize_transpose(
    X, Q, S, QT, ST, M, K, M_PADDED,
    BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr, MAX_AMAX: tl.constexpr, MAX: tl.constexpr, FROM_E4M3: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)  # tokens
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)  # features (K is a multiple of 128)
    in_rows = rows < M
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(X + offsets, mask=in_rows[:, None], other=0.0).to(tl.float32)
    # Forward tiles: one scale per token over these 128 features.
    q, s = _quantize_block(x, 1, MIN_AMAX, MAX_AMAX, MAX)
    tl.store(Q + offsets, q, mask=in_rows[:, None])
    tl.store(S + rows.to(tl.int64) * (K // BLOCK) + pid_k, s, mask=in_rows)
    # Transposed tiles: one scale per feature over these 128 tokens, from the E4M3 values (activations)
    # or from the input itself (gradients). The tokens past M are zeros: the padding of the last tile.
    if FROM_E4M3:
        x = q.to(tl.float32) * s[:, None]
    qt, st = _quantize_block(x, 0, MIN_AMAX, MAX_AMAX, MAX)
    tl.store(QT + cols.to(tl.int64)[:, None] * M_PADDED + rows[None, :], tl.trans(qt))
    tl.store(ST + cols.to(tl.int64) * (M_PADDED // BLOCK) + pid_m, st)


def tile_quantize_with_transpose(x: Tensor, requantize: bool = True) -> tuple[Quantized, Quantized]:
    """``x [M, K]`` in 1 x 128 tiles, and ``x^T [K, M padded to 128]`` quantised in tiles along the tokens.

    The same as ``qx = quantize(x, "tile")`` and ``quantize(pad(qx.dequantize().t()), "tile")``
    (``requantize``: activations, cached in FP8) or ``quantize(pad(x.t()), "tile")`` (gradients), in
    one pass. ``K`` must be a multiple of 128; ``M`` any.
    """
    if x.ndim != 2 or x.shape[1] % TILE:
        raise ValueError(f"tile_quantize_with_transpose needs [tokens, features], features a multiple of {TILE}; "
                         f"got {tuple(x.shape)}")  # fmt: skip
    x = x.contiguous()
    m, k = x.shape
    m_padded = triton.cdiv(m, TILE) * TILE
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m, k // TILE, dtype=torch.float32, device=x.device)
    qt = torch.empty(k, m_padded, dtype=E4M3, device=x.device)
    st = torch.empty(k, m_padded // TILE, dtype=torch.float32, device=x.device)
    grid = (m_padded // TILE, k // TILE)
    # A 128 x 128 fp32 tile is 16,384 values: 8 warps hold 64 per thread (4 would spill). One
    # stage: each program reads its tile once, there is no loop to pipeline.
    cuda.launch(
        _tile_quantize_transpose, grid, x, q, s, qt, st, m, k, m_padded,
        BLOCK=TILE, MIN_AMAX=_MIN_AMAX, MAX_AMAX=_MAX_AMAX, MAX=E4M3_MAX, FROM_E4M3=requantize,
        num_warps=8, num_stages=1,
    )  # fmt: skip
    return Quantized(q, s, "tile"), Quantized(qt, st, "tile")


def block_quantize_with_transpose(w: Tensor) -> tuple[Quantized, Quantized]:
    """``w [N, K]`` in 128 x 128 blocks and its transpose ``[K, N]`` (contiguous: the tensor-core GEMM of
    ``dx = dy W`` reads it column-major), in one pass: ``quantize(w, "block")``'s bits."""
    if w.ndim != 2 or w.shape[0] % TILE or w.shape[1] % TILE:
        raise ValueError(f"block_quantize_with_transpose needs both dims multiples of {TILE}; got {tuple(w.shape)}")
    w = w.contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3, device=w.device)
    qt = torch.empty(k, n, dtype=E4M3, device=w.device)
    s = torch.empty(n // TILE, k // TILE, dtype=torch.float32, device=w.device)
    cuda.launch(
        _block_quantize_transpose, (n // TILE, k // TILE), w, q, qt, s, n, k,
        BLOCK=TILE, MIN_AMAX=_MIN_AMAX, MAX_AMAX=_MAX_AMAX, MAX=E4M3_MAX, num_warps=8, num_stages=1,
    )  # fmt: skip
    return Quantized(q, s, "block"), Quantized(qt, s.t().contiguous(), "block")
