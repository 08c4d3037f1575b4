"""Shims of torch's CUDA GEMMs for :func:`~lightning_ultrascale.testing.cuda_contracts.emulate_cuda`.

``F.scaled_mm`` with DeepSeek's blockwise scales (``aten._scaled_mm_v2``): the checks of
``aten/src/ATen/native/cuda/ScaledBlas.cpp``, then the product of the dequantised operands in fp32.
``torch._grouped_mm``: the checks of ``aten/src/ATen/native/GroupedMMUtils.h`` and, on the bf16 fast
path, the device asserts of CUTLASS's grouped kernel (``aten/src/ATen/native/cuda/GroupMMCommon.cuh``
``prepare_grouped_gemm_data``), then torch's own CPU implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.testing.cuda_rules import require

_SCALED = "ScaledBlas.cpp"
_GROUPED = "GroupedMMUtils.h"
_GROUP_KERNEL = "GroupMMCommon.cuh prepare_grouped_gemm_data"
_TILE, _BLOCK = 4, 5  # F.ScalingType.BlockWise1x128, BlockWise128x128
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# ------------------------------------------------------------------------------------ scaled_mm
def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _scale_layout(scale: Tensor, shape: tuple[int, int], stride_1: int, name: str, where: str) -> None:
    ok = tuple(scale.shape) == shape and scale.dtype == torch.float32
    require(ok, f"{name} must have shape {shape[0]} x {shape[1]} Float elements, got {tuple(scale.shape)}", where)
    ok = scale.stride(0) == 1 and (scale.stride(1) == stride_1 or (shape[1] == 1 and scale.stride(1) == 1))
    require(ok, f"{name} must have strides (1, {stride_1}); got {scale.stride()}", where)


def _blockwise_scales(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, recipes: tuple[int, int]) -> None:
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    capability = cuda.capability() or (0, 0)
    require(
        capability[0] == 9,
        "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90",
        f"{_SCALED} _check_deepseek_support (dprops->major != 9; this device is sm{capability[0]}{capability[1]})",
    )
    if recipes == (_TILE, _BLOCK):
        where = f"{_SCALED} _scaled_block1x128_block128x128"
        _scale_layout(scale_a, (m, _ceil(k, 128)), m, "scale_a", where)
        rows = _ceil(_ceil(k, 128), 4) * 4
        _scale_layout(scale_b, (rows, _ceil(n, 128)), rows, "scale_b", where)
    else:
        where = f"{_SCALED} _scaled_block1x128_block1x128"
        _scale_layout(scale_a, (m, _ceil(k, 128)), m, "scale_a", where)
        _scale_layout(scale_b, (n, _ceil(k, 128)), n, "scale_b", where)


def _dequantized(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, recipe_b: int) -> tuple[Tensor, Tensor]:
    k, n = b.shape
    a_ = a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
    if recipe_b == _BLOCK:
        blocks = scale_b[: _ceil(k, 128)].repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    else:
        blocks = scale_b.t().repeat_interleave(128, dim=0)[:k]
    return a_, b.float() * blocks


def _scaled_mm(
    a: Tensor, b: Tensor, scale_a: list[Tensor], recipe_a: list[int], swizzle_a: list[int], scale_b: list[Tensor],
    recipe_b: list[int], swizzle_b: list[int], bias: Tensor | None, out_dtype: torch.dtype | None,
    contraction_dim: list[int] = (), use_fast_accum: bool = False,  # type: ignore[assignment]
) -> Tensor:  # fmt: skip
    where = f"{_SCALED} _scaled_mm_cuda_v2_out"
    capability = cuda.capability() or (0, 0)
    require(
        capability >= (8, 9),
        "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9",
        where,
    )
    require(a.dim() == 2 and b.dim() == 2, "mat_a and mat_b must be matrices", where)
    require(a.shape[1] == b.shape[0], f"mat_a and mat_b shapes cannot be multiplied ({a.shape}, {b.shape})", where)
    require(a.shape[1] % 16 == 0, f"Expected trailing dimension of mat1 to be divisible by 16, got {a.shape}", where)
    require(
        b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, f"mat2 shape {tuple(b.shape)} must be divisible by 16", where
    )
    require(a.dtype in _FP8 and b.dtype in _FP8, f"Expected float8 matrices, got {a.dtype}, {b.dtype}", where)
    recipes = (recipe_a[0], recipe_b[0])
    require(recipes in ((_TILE, _BLOCK), (_TILE, _TILE)), f"recipes {recipes}: not one the package uses", where)
    _blockwise_scales(a, b, scale_a[0], scale_b[0], recipes)
    require(
        a.stride(1) == 1 and b.stride(0) == 1,
        "Only multiplication of row-major and column-major matrices is supported by cuBLASLt "
        f"(mat_a strides {a.stride()}, mat_b strides {b.stride()})",
        f"{_SCALED} _scaled_gemm",
    )
    a_, b_ = _dequantized(a, b, scale_a[0], scale_b[0], recipes[1])
    return (a_ @ b_).to(out_dtype or torch.bfloat16)


# ------------------------------------------------------------------------------------ grouped_mm
def _strides(mat: Tensor, name: str) -> bool:
    """GroupedMMUtils.h check_valid_strides_and_return_transposed, on CUDA; returns whether ``mat`` is row-major."""
    where = f"{_GROUPED} check_valid_strides_and_return_transposed"
    align = 16 // mat.element_size()
    require(mat.data_ptr() % 16 == 0, f"{name}: expected data_ptr to be aligned to 16 bytes", where)
    strides, sizes = mat.stride(), mat.shape
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        require(strides[-1] % align == 0, f"{name}: strides should be multiple of 16 bytes, got {strides}", where)
        return False
    ok = strides[-1] == 1 and strides[-2] >= max(1, sizes[-1])
    require(ok, f"{name}: Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes", where)
    require(strides[-2] % align == 0, f"{name}: strides should be multiple of 16 bytes, got {strides}", where)
    return True


def _group_asserts(a: Tensor, b: Tensor, offs: Tensor, a_row_major: bool, b_row_major: bool) -> None:
    """The device asserts of prepare_grouped_gemm_data (bf16 fast path): group sizes along a ragged dim."""
    ends = offs.tolist()
    sizes = [end - start for start, end in zip([0, *ends], ends)]
    require(len(sizes) < 1024, "Can't process more than 1024 groups", "GroupMM.cu")
    ragged = "K" if a.dim() == b.dim() == 2 else ("M" if a.dim() == 2 else "N")
    if ragged == "K":
        empty_ok = not a_row_major and b_row_major
        require(
            all(s >= 0 if empty_ok else s > 0 for s in sizes),
            f"expected offsets to be greater than 0 (CUTLASS cannot handle an empty group here): sizes {sizes}",
            _GROUP_KERNEL,
        )
    align = 16 // a.element_size()
    # TMA loads need each group's start 16-byte aligned where groups advance along a unit-stride dim.
    a_moves = (ragged == "K" and a_row_major) or (ragged == "M" and not a_row_major)
    b_moves = (ragged == "K" and not b_row_major) or (ragged == "N" and b_row_major)
    if a_moves or b_moves or ragged == "N":
        require(
            all(s % align == 0 for s in sizes[:-1]),
            f"expected input tensor dynamic dimension byte size to be non-negative multiple of 16: group sizes {sizes}",
            _GROUP_KERNEL,
        )


def _grouped_mm(
    a: Tensor, b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    where = f"{_GROUPED} _grouped_mm_validate_inputs"
    floats = (torch.bfloat16, torch.float32, torch.float16)
    require(a.dtype in floats and b.dtype in floats, f"Expected Float32, BFloat16 or Float16, got {a.dtype}", where)
    require(a.dim() in (2, 3) and b.dim() in (2, 3), "mat_a and mat_b have to be 2 or 3d", where)
    a_row_major, b_row_major = _strides(a, "mat_a"), _strides(b, "mat_b")
    require((offs is not None) == (a.dim() == 2 or b.dim() == 2), "offsets iff there is a 2d matrix", where)
    require(offs is None or (offs.dim() == 1 and offs.dtype == torch.int32), "Offsets have to be int32", where)
    require(bias is None, "Bias not supported yet", where)
    capability = cuda.capability() or (0, 0)
    fast = a.dtype == b.dtype == torch.bfloat16 and capability[0] in (9, 10)
    if fast and offs is not None:
        _group_asserts(a, b, offs, a_row_major, b_row_major)
    return torch.ops.aten._grouped_mm.default(a, b, offs=offs, bias=bias, out_dtype=out_dtype)


aten = torch.ops.aten
SHIMS: dict[Any, Any] = {
    aten._scaled_mm_v2.default: _scaled_mm,
    aten._grouped_mm.default: _grouped_mm,
}
