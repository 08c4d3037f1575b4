"""E4M3 quantisation with fp32 scales per tensor, per row, per 1 x 128 tile or per 128 x 128 block.

``x ~ data * scale``: ``data`` is ``float8_e4m3fn`` with ``x``'s shape, ``scale`` the fp32
dequantisation multiplier of each group (``amax / 448``, the convention of ``torch._scaled_mm``'s
``scale_a`` / ``scale_b`` and of DeepSeek-V3's ``weight_scale_inv``), so each group's largest
magnitude lands on E4M3's largest finite value, 448. Granularities (DeepSeek-V3's recipe uses the
last two: activations and gradients in 1 x 128 tiles, weights in 128 x 128 blocks):

=========  ==========================================  ======================
name       one scale per                               ``scale`` shape
=========  ==========================================  ======================
tensor     the whole tensor                            ``[]``
row        row (all but the last dim)                  ``[..., 1]``
tile       128 consecutive entries of a row            ``[..., K / 128]``
block      128 x 128 block of a 2-D tensor             ``[M / 128, K / 128]``
=========  ==========================================  ======================

Zero groups get a tiny positive scale (their entries quantise to 0); an infinite amax counts as
float32's largest value, and values are clamped to +-448 before the cast, so no group turns
into NaN or Inf (torch's CPU cast saturates, but not every device's does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["E4M3", "E4M3_MAX", "GRANULARITIES", "TILE", "Quantized", "quantize", "to_e4m3"]

E4M3 = torch.float8_e4m3fn
#: The largest finite E4M3 value.
E4M3_MAX = 448.0
#: The width of a tile and the side of a block.
TILE = 128
GRANULARITIES = ("tensor", "row", "tile", "block")
_MIN_AMAX = 1e-12
_MAX_AMAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Quantized:
    """An E4M3 tensor and its fp32 scales: ``dequantize() ~ the original``."""

    data: Tensor
    scale: Tensor
    granularity: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale`` in ``dtype`` (computed in fp32)."""
        return (
            (_grouped(self.data.float(), self.granularity) * _expand(self.scale, self.granularity))
            .reshape(self.data.shape)
            .to(dtype)
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the data and the scales: what moves when the tensor is communicated."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def to_e4m3(x: Tensor) -> Tensor:
    """Cast to ``float8_e4m3fn``, saturating at +-448 (round to nearest even inside the range)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize(x: Tensor, granularity: str, *, pow2_scales: bool = False) -> Quantized:
    """Quantise ``x`` to E4M3 with one fp32 scale per group of ``granularity`` (see the module docstring).

    ``pow2_scales`` rounds each scale up to a power of two (torchao's rowwise recipe does, so that
    scaling is exact in any precision). The amax is taken in fp32 whatever ``x``'s dtype.

    Example:
        >>> q = quantize(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "row")
        >>> q.scale.flatten().tolist(), q.dequantize()[0].tolist()
        ([0.004464285913854837, 0.0011160714784637094], [1.0, -2.0])
    """
    _check(x, granularity)
    groups = _grouped(x.float(), granularity)
    magnitude = groups.abs()
    amax = magnitude.amax() if granularity == "tensor" else magnitude.amax(dim=_reduce_dims(granularity), keepdim=True)
    scale = amax.clamp(min=_MIN_AMAX, max=_MAX_AMAX) / E4M3_MAX
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    data = to_e4m3(groups / scale).reshape(x.shape)
    return Quantized(data, _squeeze(scale, granularity, x), granularity)


def _check(x: Tensor, granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is unknown; valid: {', '.join(GRANULARITIES)}")
    if granularity in ("tile", "block") and x.shape[-1] % TILE:
        raise ValueError(f"{granularity} quantisation needs the last dim a multiple of {TILE}; got {tuple(x.shape)}")
    if granularity == "block" and (x.ndim != 2 or x.shape[0] % TILE):
        raise ValueError(f"block quantisation needs a 2-D tensor, both dims multiples of {TILE}; got {tuple(x.shape)}")


def _grouped(x: Tensor, granularity: str) -> Tensor:
    """``x`` viewed so that each group is one slice over :func:`_reduce_dims`."""
    if granularity == "tile":
        return x.reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    if granularity == "block":
        m, k = x.shape
        return x.reshape(m // TILE, TILE, k // TILE, TILE)
    return x


def _reduce_dims(granularity: str) -> tuple[int, ...]:
    return {"row": (-1,), "tile": (-1,), "block": (1, 3)}[granularity]


def _squeeze(scale: Tensor, granularity: str, x: Tensor) -> Tensor:
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "tile":
        return scale.squeeze(-1)
    if granularity == "block":
        return scale.reshape(x.shape[0] // TILE, x.shape[1] // TILE)
    return scale


def _expand(scale: Tensor, granularity: str) -> Tensor:
    """``scale`` shaped to broadcast over :func:`_grouped`'s view."""
    if granularity == "tile":
        return scale.unsqueeze(-1)
    if granularity == "block":
        return scale[:, None, :, None]
    return scale
