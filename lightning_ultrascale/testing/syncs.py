"""Count the host syncs of a training step on a CPU: every place a GPU run would wait for the device.

A CUDA program stalls its queue whenever the host needs a value from the device: ``item()``,
``bool(t)``, ``int(t)``, ``tolist()``, and ops whose output size depends on the data (``nonzero``,
boolean-mask indexing, ``bincount``, ``repeat_interleave`` without ``output_size``, ``unique``,
``masked_select``). On a CPU none of them costs anything, so the suite cannot feel them;
:class:`HostSyncCounter` sees them all (a ``TorchDispatchMode`` for the ops, whose scalar reads
arrive as ``aten._local_scalar_dense``, and ``Tensor.tolist`` patched, which reads CPU memory
below the dispatcher) and files each under the first frame outside torch that caused it.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: Ops that read device memory on the host or size their output from the data.
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,  # item(), bool(), int(), float()
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten.bincount.default,
        _aten._unique2.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim.default,
    }
)


def _caller() -> str:
    """``path:line`` of the nearest frame outside torch (and outside this module)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "torch" not in path.parts and path.name != "syncs.py":
            parts = path.parts
            for root in ("lightning_ultrascale", "lightning", "tests"):
                if root in parts:
                    return f"{Path(*parts[parts.index(root) :])}:{frame.f_lineno}"
            return f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "torch"


def _syncs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if func in SYNC_OPS:
        return True
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


#: The dispatcher namespaces of collectives (``torch.distributed``'s and the functional ones DTensor issues).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs while active, by call site (``counts``), and collectives (``collectives``);
    enter it on the thread that trains.

    Example:
        >>> with HostSyncCounter() as syncs:
        ...     _ = bool(torch.ones(2).sum() > 0)
        >>> sum(syncs.counts.values())
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self._tolist: Any = None

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.counts[f"{func._overloadpacket.__name__} at {_caller()}"] += 1
        elif func.namespace in COLLECTIVE_NAMESPACES:
            self.collectives[f"{func._overloadpacket.__name__} at {_caller()}"] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        counts, original = self.counts, torch.Tensor.tolist

        def tolist(tensor: torch.Tensor) -> Any:
            counts[f"tolist at {_caller()}"] += 1
            return original(tensor)

        self._tolist, torch.Tensor.tolist = original, tolist  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
