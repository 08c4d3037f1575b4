"""Small tensor helpers every layer uses."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["by_device_and_dtype", "local_tensor"]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a shard, or a replica), or ``t`` itself for a plain tensor.

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    return t.to_local() if isinstance(t, DTensor) else t


def by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by device and dtype, in order: one multi-tensor (``torch._foreach_*``) call each.

    Example:
        >>> import torch
        >>> groups = by_device_and_dtype([torch.ones(2), torch.ones(1, dtype=torch.bfloat16), torch.zeros(3)])
        >>> {dtype: len(ts) for (_, dtype), ts in groups.items()}
        {torch.float32: 2, torch.bfloat16: 1}
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
