"""FP8 training: quantisation at every scale granularity, the emulated blockwise linear, the module swap.

Example:
    >>> import torch
    >>> from lightning_ultrascale.fp8 import quantize
    >>> q = quantize(torch.randn(4, 256), "tile")  # 1 x 128 tiles: one fp32 scale per tile
    >>> q.data.dtype, q.scale.shape
    (torch.float8_e4m3fn, torch.Size([4, 2]))
"""

from lightning_ultrascale.fp8.convert import RECIPES, BlockwiseFP8Linear, FP8Conversion, convert_to_fp8, plan_fp8
from lightning_ultrascale.fp8.linear import blockwise_fp8_linear
from lightning_ultrascale.kernels.quantize import E4M3_MAX, GRANULARITIES, TILE, Quantized, quantize, to_e4m3

__all__ = [
    "E4M3_MAX",
    "GRANULARITIES",
    "RECIPES",
    "TILE",
    "BlockwiseFP8Linear",
    "FP8Conversion",
    "Quantized",
    "blockwise_fp8_linear",
    "convert_to_fp8",
    "plan_fp8",
    "quantize",
    "to_e4m3",
]
