"""A flat range of a tensor as the rectangular chunks DCP saves: how ZeRO-1/2 shards join the one checkpoint format.

The sharded optimizer splits a flat bucket of parameters at arbitrary element boundaries: rank
``r`` holds elements ``[r*c, (r+1)*c)``, which may start and end in the middle of a parameter's
row. A checkpoint keyed by parameter name (the format every layout reads) stores each parameter's
optimizer state at the parameter's own shape, so each rank describes its part of a parameter as
boxes: a partial first row, whole rows, a partial last row (recursively for more dims). Every box is
contiguous in memory, so the boxes are views of the live optimizer state: DCP writes from them and
loads into them in place, and reshards to any other layout's chunks by offset. Nothing is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """``(offsets, sizes)`` boxes covering the flat elements ``[start, stop)`` of a row-major ``shape``.

    Example:
        >>> flat_range_boxes((3, 4), 2, 11)  # the end of row 0, row 1, the start of row 2
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []
    if start % inner:  # the rest of a row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        boxes += _in_row(shape, row, start - row * inner, end - row * inner)
        start = end
    whole_rows_end = stop // inner
    if start < whole_rows_end * inner:
        first = start // inner
        boxes.append(((first, *[0] * (len(shape) - 1)), (whole_rows_end - first, *shape[1:])))
        start = whole_rows_end * inner
    if start < stop:  # the beginning of the last row
        row = start // inner
        boxes += _in_row(shape, row, start - row * inner, stop - row * inner)
    return boxes


def _in_row(shape: Sequence[int], row: int, start: int, stop: int) -> list[Box]:
    return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start, stop)]


def flat_chunks(
    values: torch.Tensor,
    flat_start: int,
    piece_shape: Sequence[int],
    piece_offset: Sequence[int],
    global_shape: Sequence[int],
    mesh: DeviceMesh,
) -> DTensor:
    """``values`` (flat elements ``flat_start..`` of a piece of a tensor) as a DTensor DCP saves and loads in place.

    ``piece_shape`` / ``piece_offset``: the local piece the flat range indexes (a tensor-parallel
    shard, or the whole tensor) and where it starts in the tensor of ``global_shape``.
    """
    shards, offsets, position = [], [], 0
    for box_offset, box_size in flat_range_boxes(piece_shape, flat_start, flat_start + values.numel()):
        n = math.prod(box_size)
        shards.append(values[position : position + n].view(box_size))
        offsets.append(tuple(p + o for p, o in zip(piece_offset, box_offset)))
        position += n
    # torch's wrapper for several local chunks of one tensor (what TorchRec checkpoints with); DCP
    # reads its chunks through the DTensor, which carries the global shape.
    stride = torch.empty(global_shape, device="meta").stride()
    local = _Boxes(shards, offsets)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape), stride=stride)


class _Boxes(LocalShardsWrapper):
    """``LocalShardsWrapper`` whose identity view works at any rank of tensor.

    ``DTensor.from_local`` views its local tensor as itself; torch 2.13's wrapper allows that for
    several chunks of 1- and 2-D tensors only, and a ZeRO-1/2 shard of a stacked expert weight
    (``[experts, rows, cols]``) is several 3-D boxes: saving any MoE checkpoint under ZeRO-1/2 failed.
    """

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        wrapper = args[0] if args else None
        if func is torch.ops.aten.view.default and isinstance(wrapper, LocalShardsWrapper):
            if len(wrapper.local_shards()) > 1 and wrapper.local_shards()[0].ndim > 2:
                return _Boxes([s.view(s.shape) for s in wrapper.local_shards()], wrapper.local_offsets())
        return super().__torch_dispatch__(func, types, args, kwargs)
