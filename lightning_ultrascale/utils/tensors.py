"""Small tensor helpers every layer uses."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a shard, or a replica), or ``t`` itself for a plain tensor.

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    return t.to_local() if isinstance(t, DTensor) else t
