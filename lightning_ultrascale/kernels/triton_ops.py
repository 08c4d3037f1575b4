"""Our Triton kernels for RMSNorm, SwiGLU and RoPE, forward and backward.

Each op is one pass over memory in each direction where eager PyTorch makes several (RMSNorm:
square, mean, rsqrt, two multiplies and a cast, each a kernel reading and writing the whole
activation). Numerics follow :mod:`~lightning_ultrascale.kernels.reference`: statistics and
rotations in fp32, the same casts at the same places. They need a CUDA GPU, or CPU tensors under
``TRITON_INTERPRET=1`` (the tests), which must be set before this module is imported: Triton
chooses compiled or interpreted kernels when ``@triton.jit`` runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import lightning_ultrascale.kernels.cuda as cuda

__all__ = ["rms_norm", "rope", "swiglu"]

_ELEMENTWISE_BLOCK = 1024


def num_warps(block: int) -> int:
    """Warps for a program that holds ``block`` fp32 values of a row (Liger-Kernel's rule).

    Triton's default of 4 warps (128 threads) leaves a row of 8,192-16,384 elements (Llama 3's
    hidden sizes) at 64-128 fp32 values per thread, several such rows live at once in the
    backward: registers spill to local memory. 8 warps from 2,048 elements, 16 from 8,192 and
    32 from 32,768 keep it at 16-32 per thread.

    Example:
        >>> num_warps(4096), num_warps(16384)
        (8, 16)
    """
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # Cast the normalised row back to the input dtype before the weight, as the reference does.
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    # One program walks a run of rows and keeps its part of the weight gradient in registers:
    # a [programs, cols] partial sum instead of a [rows, cols] one.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    row_start = first.to(tl.int64) * n_cols  # int64: rows x cols may pass 2**31 elements
    for row in range(first, last):
        offset = row_start + cols
        row_start += n_cols
        x = tl.load(X + offset, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        normed = x * rstd
        dn = dy * w
        # d/dx of x * rstd(x): rstd * (dn - normed * mean(dn * normed)).
        dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / n_cols))
        tl.store(DX + offset, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n_rows, n_cols = x2.shape
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        cuda.launch(_rms_norm_fwd, (n_rows,), x2, weight, y, rstd, n_cols, eps, BLOCK=block, num_warps=num_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2)
        programs = min(n_rows, _parallel_programs(x2))
        rows_per_program = triton.cdiv(n_rows, programs)
        programs = triton.cdiv(n_rows, rows_per_program)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(n_cols)
        cuda.launch(
            _rms_norm_bwd, (programs,), dy2, x2, weight, rstd, dx, dw, n_rows, n_cols, rows_per_program,
            BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), None


def _parallel_programs(x: Tensor) -> int:
    if cuda.on_cuda(x):
        return 4 * cuda.multiprocessors(x.device)
    return 8  # the interpreter runs programs one after the other: few, long ones


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` over its last dim (see :func:`~lightning_ultrascale.kernels.reference.rms_norm`)."""
    out: Tensor = _RMSNorm.apply(x, weight, eps)
    return out


@triton.jit
def _swiglu_fwd(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded twice, like eager silu(a) * b.
    silu = (a * tl.sigmoid(a)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (silu * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    tl.store(DB + offs, (dy * silu.to(DB.dtype.element_ty).to(tl.float32)).to(DB.dtype.element_ty), mask=mask)
    # silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))
    tl.store(DA + offs, (dy * b * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        a, b = gate.contiguous(), up.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        cuda.launch(_swiglu_fwd, (triton.cdiv(n, _ELEMENTWISE_BLOCK),), a, b, y, n, BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
        cuda.launch(_swiglu_bwd, grid, dy.contiguous(), a, b, da, db, n, BLOCK=_ELEMENTWISE_BLOCK)
        return da, db


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (see :func:`~lightning_ultrascale.kernels.reference.swiglu`)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu needs gate and up of one shape and dtype; got {gate.shape} {gate.dtype}, {up.shape} {up.dtype}"
        )
    out: Tensor = _SwiGLU.apply(gate, up)
    return out


@triton.jit
def _rope(X, COS, SIN, Y, heads, seq, half, sxb, sxh, sxs, scb, scs, sign, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (batch, position): every head of it as one [heads, half] tile, cos and sin read
    # once for all of them; the two halves of a head pair up (rotate_half).
    pid = tl.program_id(0).to(tl.int64)
    s = pid % seq
    b = pid // seq
    h = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    in_row = cols < half
    mask = (h < heads) & in_row
    c_row = b * scb + s * scs
    c1 = tl.load(COS + c_row + cols, mask=in_row, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_row + half + cols, mask=in_row, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + c_row + cols, mask=in_row, other=0.0).to(tl.float32) * sign
    s2 = tl.load(SIN + c_row + half + cols, mask=in_row, other=0.0).to(tl.float32) * sign
    x_row = X + b * sxb + s * sxs + h * sxh
    x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    y_row = Y + b * sxb + s * sxs + h * sxh  # (Y has X's strides)
    tl.store(y_row + cols, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half + cols, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """``x [b, heads, s, d]`` (any strides, the last 1) rotated, in ``x``'s layout; ``sign=-1`` rotates back: the
    backward of a rotation.

    The output keeps the layout of its input (queries and keys transposed from the projections' ``[b, s, heads,
    d]``), as the reference's element-wise ops do: attention's output follows the queries' layout where the
    kernel allows it (CPU), and a contiguous ``[b, heads, s, d]`` there made the output projection's input a copy
    that backward kept, ``h`` per token and block more than the reference.
    """
    b, heads, seq, d = x.shape
    y = torch.empty_like(x)  # (preserve_format: x's strides, for a dense input)
    if y.stride() != x.stride():  # (an input with gaps or overlaps: contiguous in and out)
        x = x.contiguous()
        y = torch.empty_like(x)
    # cos/sin are [b or 1, 1, s, d]; a batch of one broadcasts (stride 0).
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    half = d // 2
    block_h, block = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    cuda.launch(
        _rope, (b * seq,), x, cos, sin, y, heads, seq, half, x.stride(0), x.stride(1), x.stride(2), scb,
        cos.stride(2), sign, BLOCK_H=block_h, BLOCK=block, num_warps=num_warps(block_h * block),
    )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        if x.stride(-1) != 1:
            x = x.contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        # The transpose of a rotation by theta is the rotation by -theta.
        return _rotate(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, -1.0), None, None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE of queries and keys (see :func:`~lightning_ultrascale.kernels.reference.rope`)."""
    return _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)
