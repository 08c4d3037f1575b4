"""Which storages a forward leaves alive: activation memory as tests count it, without a GPU's allocator."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _plain(t: Any) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data: a DTensor's local shard (the mode sees DTensor ops, not their local
    ones), else ``t`` itself; None for anything else."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local if type(local) in (torch.Tensor, torch.nn.Parameter) else None


class LiveStorages(TorchDispatchMode):
    """Weakly records every storage an op creates while active; afterwards, which are still alive.

    Counted on their storages, not on autograd's saved-tensor hooks: op-level recomputation keeps tensors in its
    own cache, which those hooks never see, and a view saved for backward keeps its whole storage.

    Example:
        >>> x = torch.ones(4, requires_grad=True)
        >>> with LiveStorages() as live:
        ...     y = (x * 2).sin()   # (x * 2) is kept for sin's backward; y is the output
        >>> live.alive_bytes(x, y)
        16
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            local = _plain(t) if isinstance(t, torch.Tensor) else None
            if local is not None:
                storage = local.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self, *held: torch.Tensor) -> Counter:
        """Sizes (bytes) of the recorded storages still alive, how many of each; ``held``'s storages left out."""
        gc.collect()
        out = {_plain(t) for t in held}
        skip = {t.untyped_storage().data_ptr() for t in out if t is not None}
        return Counter(n for ptr, (ref, n) in self.made.items() if not ref.expired() and ptr not in skip)

    def alive_bytes(self, *held: torch.Tensor) -> int:
        """Bytes of the recorded storages still alive, ``held``'s left out (parameters, outputs)."""
        return sum(size * count for size, count in self.alive(*held).items())
