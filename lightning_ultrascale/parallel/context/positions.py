"""Did the model read the positions context parallelism handed it? A first-batch handshake.

A context-parallel rank holds chunks of each sequence (zig-zag: two far apart), so it hands the
model the global ``position_ids`` of its tokens. A model that ignores them and counts positions
from 0 rotates its queries and keys by the wrong angles and trains, silently, on a different
model (1.9e-5 from one process after a few steps on a tiny one). The first training batch's
positions are therefore a :class:`Watched` tensor: an op that computes with them marks them
read, an op that only moves or reshapes them passes the mark on to its result. The first batch
after a forward has run (the attention that context parallelism installs reports it) finds out
(:meth:`PositionProbe.check`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ultrascale.models.contract import ContractError

#: Ops that move, reshape or split positions without computing with them (their results carry the mark).
CARRY = frozenset({
    "to", "cuda", "cpu", "contiguous", "detach", "clone", "long", "int", "float", "double", "half", "bfloat16",
    "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "__getitem__", "split",
    "tensor_split", "chunk", "narrow", "select", "index_select", "unbind", "repeat", "repeat_interleave", "type",
    "type_as", "pin_memory", "share_memory_", "requires_grad_",
})  # fmt: skip
#: Reads of metadata: neither a use nor a result.
NEUTRAL = frozenset({"shape", "dtype", "device", "size", "dim", "numel", "ndim", "is_cuda", "__len__", "__repr__",
                     "__format__", "data_ptr", "element_size", "stride", "is_contiguous", "__get__"})  # fmt: skip


class PositionProbe:
    """One batch's positions, and whether anything computed with them."""

    def __init__(self) -> None:
        self.read = False
        self.forward_seen = False  # the attention ran since the positions were handed out

    def watch(self, positions: torch.Tensor) -> torch.Tensor:
        return _wrap(positions, self)

    def check(self, owner: str) -> None:
        if not self.read:
            raise ContractError(
                f"{owner} handed the model each token's position_ids (a rank holds chunks of the sequence) and "
                "the model never read them: it counts positions from 0, which is wrong on every rank but the first "
                "and trains a different model, silently. Pass batch['position_ids'] to the model and build RoPE "
                "from them (the model contract: forward(..., position_ids=...); example: "
                "lightning_ultrascale.models.llama.Llama.forward)"
            )


class Watched(torch.Tensor):
    """Positions that tell their :class:`PositionProbe` when an op computes with them."""

    _probe: PositionProbe

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        probe = next(leaf._probe for leaf in leaves if isinstance(leaf, Watched))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in NEUTRAL:
            return out
        if name in CARRY and args and isinstance(args[0], Watched):
            return tree_map(lambda t: _wrap(t, probe) if isinstance(t, torch.Tensor) else t, out)
        probe.read = True
        return out


def _wrap(t: torch.Tensor, probe: PositionProbe) -> torch.Tensor:
    watched = t.as_subclass(Watched)
    watched._probe = probe
    return watched
