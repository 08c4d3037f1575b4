"""Every call the package makes into torch's private CUDA ops, in one place, with each kernel's rules.

This code was written without a GPU. A CUDA kernel checks its preconditions in C++ (or does not, and
misreads its input), which no CPU run reaches: so each op is called from here only, and
:mod:`lightning_ultrascale.testing.cuda_contracts` runs the package's CUDA branches on a CPU with every
op below replaced by a shim that enforces the kernel's checks (citing torch's source) and computes the
result with a CPU reference. The rules each call site keeps are written beside it.

=============================  ==============================================================
call site                      torch op (kernel)
=============================  ==============================================================
:func:`flash_attention`        ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2)
:func:`flash_attention_backward`  ``aten._scaled_dot_product_flash_attention_backward``
:func:`efficient_attention`    ``aten._scaled_dot_product_efficient_attention`` (xFormers')
:func:`efficient_attention_backward`  ``aten._scaled_dot_product_efficient_attention_backward``
:func:`varlen_attention`       ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention, varlen)
:func:`scaled_mm`              ``F.scaled_mm`` (cuBLASLt FP8 GEMM, blockwise scales)
:func:`grouped_mm`             ``torch._grouped_mm`` (CUTLASS grouped GEMM)
:func:`launch`                 a Triton kernel
=============================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Device",
    "capability",
    "efficient_attention",
    "efficient_attention_backward",
    "flash_attention",
    "flash_attention_backward",
    "grouped_mm",
    "launch",
    "multiprocessors",
    "on_cuda",
    "scaled_mm",
    "varlen_attention",
]


@dataclass(frozen=True)
class Device:
    """What the package asks of a CUDA device: its compute capability and multiprocessor count."""

    name: str
    capability: tuple[int, int]
    multiprocessors: int


#: The device the CPU test mode stands in for (``testing.cuda_contracts.emulate_cuda``); None: the real one.
EMULATED: Device | None = None


def on_cuda(t: Tensor) -> bool:
    """Whether ``t`` takes the CUDA branch: it lives on a CUDA device (or the CPU test mode stands in for one)."""
    return t.is_cuda or (EMULATED is not None and t.device.type == "cpu")


def capability() -> tuple[int, int] | None:
    """The compute capability of the current CUDA device, None without one."""
    if EMULATED is not None:
        return EMULATED.capability
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (a CUDA device)."""
    if EMULATED is not None:
        return EMULATED.multiprocessors
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# ------------------------------------------------------------------------------------ attention
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_head(x: Tensor, size: int) -> Tensor:
    # Zero columns add nothing to q k^T, and the output's extra columns are sliced off.
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _flash_head_size(q: Tensor, v: Tensor) -> int:
    # One head size for q, k and v (flash_api.cpp mha_fwd: CHECK_SHAPE(v, ..., head_size_og)), a
    # multiple of 8 ("head_size must be a multiple of 8, this is ensured by padding!"): MLA's value
    # heads are narrower than its query heads, and SDPA pads before this op, a direct call must too.
    return _round_up(max(q.shape[-1], v.shape[-1]), 8)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """FlashAttention-2 forward of ``[b, heads, s, d]`` half-precision inputs: ``(out, lse [b, heads, s] fp32)``.

    ``k, v`` may hold fewer heads than ``q`` (grouped-query attention: the kernel reads each kv head for its
    group, ``num_heads % num_heads_k == 0``); ``v`` may have another head size (it is padded, with ``q``
    and ``k``, to one size, a multiple of 8, at most 256). ``causal`` needs as many keys as queries: the
    kernel aligns its mask to the bottom right (``window_size_right = 0``), SDPA's ``is_causal`` to the top left.
    """
    d = _flash_head_size(q, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        _pad_head(q, d), _pad_head(k, d), _pad_head(v, d), 0.0, causal, False, scale=scale
    )[:2]
    return out[..., : v.shape[-1]], lse


def flash_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`flash_attention` given the rows' output and LSE (the GLOBAL ones, for a ring block)."""
    d = _flash_head_size(q, v)
    q_, k_, v_, out_, dout_ = (_pad_head(t, d) for t in (q, k, v, out.to(q.dtype), dout.to(q.dtype)))
    # Dropout 0: the RNG state is never read. The cumulative lengths must be None (undefined):
    # attention_backward.cu takes the variable-length kernel when cumulative_sequence_length_q.defined(),
    # and an empty tensor is defined. The LSE must be contiguous: mha_bwd reads it at raw offsets from
    # its data pointer, as [b, heads, s] (torch's context parallel: "otherwise there will be numerical error").
    rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout_, q_, k_, v_, out_, lse.contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, rng, rng,
        scale=scale,
    )[:3]  # fmt: skip
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


def efficient_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """The memory-efficient kernel's forward: ``(out, lse [b, heads, s rounded up to 32] fp32)``.

    fp32, bf16 or fp16; as many kv heads as query heads (no grouped-query attention: expand first); ``v``
    may have its own head size. ``bias`` (additive, q's dtype, ``[b, 1 or heads, sq, sk]``) needs rows
    that start at 16-byte multiples (:func:`aligned_bias`); ``causal`` aligns to the top left.
    """
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
    return out, lse


def efficient_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor, causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv of :func:`efficient_attention`; ``lse`` in the kernel's layout (rows padded to a multiple of 32)."""
    rng = torch.empty(0, dtype=torch.int64, device=q.device)
    padded = F.pad(lse, (0, -lse.shape[-1] % 32))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype), q, k, v, bias, out.to(q.dtype), padded, rng, rng, 0.0, [True, True, True, False], causal,
        scale=scale,
    )[:3]  # fmt: skip
    return dq, dk, dv


def aligned_bias(bias: Tensor, alignment: int = 16) -> Tensor:
    """``bias`` as a view whose rows start at multiples of ``alignment`` elements.

    The memory-efficient kernel refuses a bias whose row stride is not aligned (kernel_forward.h
    ``check_supported``: "attn_bias is not correctly aligned (strideM)"); ``F.scaled_dot_product_attention``
    pads the mask so, a direct call to the kernel must too.

    Example:
        >>> aligned_bias(torch.zeros(1, 1, 69, 431)).stride()[-2]
        432
    """
    pad = -bias.shape[-1] % alignment
    return F.pad(bias, (0, pad))[..., : bias.shape[-1]] if pad else bias


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int) -> Tensor:
    """Causal FlashAttention over the sequences of a flattened ``[tokens, heads, d]`` batch, cut at ``cu_seqlens``.

    ``cu_seqlens`` int32 (``mha_varlen_fwd``: "cu_seqlens_q must have dtype int32"), ``max_len`` at least
    the longest sequence (it sizes the kernel's grid); as many kv heads as query heads. Head sizes are
    padded as for :func:`flash_attention` (``varlen_attn`` calls the kernel without SDPA's padding).
    """
    from torch.nn.attention.varlen import varlen_attn

    d = _flash_head_size(q, v)
    scale = 1.0 / q.shape[-1] ** 0.5  # of the real head size, not the padded one
    padded = (_pad_head(t, d) for t in (q, k, v))
    out: Tensor = varlen_attn(*padded, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0))
    return out[..., : v.shape[-1]]


# ------------------------------------------------------------------------------------ GEMMs
def scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, recipe_a: Any, scale_b: Tensor, recipe_b: Any, out_dtype: torch.dtype
) -> Tensor:
    """``a @ b`` of FP8 operands with their scales and recipes (``F.ScalingType``): one cuBLASLt GEMM.

    ``a`` row-major, ``b`` column-major (ScaledBlas.cpp ``_scaled_gemm``: "Only multiplication of row-major
    and column-major matrices is supported by cuBLASLt"), dims multiples of 16. Blockwise recipes (1 x 128,
    128 x 128) run on compute capability 9.x only (``_check_deepseek_support``), with the scale layouts
    ``fp8/linear.py`` builds.
    """
    return F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: one GEMM per group of rows, ``offs`` the groups' int32 ends.

    Both operands with one unit stride and the other a multiple of 16 bytes, data 16-byte aligned
    (GroupedMMUtils.h ``check_valid_strides_and_return_transposed``). On CUDA bf16 takes CUTLASS's grouped
    kernel (sm90 and sm100), whose TMA loads assert 16-byte group sizes along a ragged row-major dim
    (GroupMMCommon.cuh ``prepare_grouped_gemm_data``); other dtypes loop on the host over the offsets.
    """
    return torch._grouped_mm(a, b, offs=offs)


# ------------------------------------------------------------------------------------ Triton
def launch(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
    """Run Triton ``kernel`` on ``grid`` (at most 3 dims: x < 2**31, y and z < 2**16 programs)."""
    kernel[tuple(grid)](*args, **meta)
