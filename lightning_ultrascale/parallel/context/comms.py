"""Where context parallelism moves bytes: the K/V ring and the Ulysses all-to-all.

Ring: every rank sends its current key/value block to the next rank and receives the previous
rank's, ``cp - 1`` times per attention forward. The send/recv of the next block is issued before
the current block is computed and waited for after, so the transfer overlaps the compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingExchange:
    """Asynchronous pass of tensors to the next rank of a ring (and receipt from the previous one)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._works: list[dist.Work] = []

    def start(self, *tensors: torch.Tensor, send: bool = True, recv: bool = True) -> list[torch.Tensor]:
        """Send ``tensors`` onwards; return the buffers the previous rank's tensors will land in.

        ``send=False`` keeps them (the next rank needs none); ``recv=False`` expects nothing (an
        empty list). Both sides must agree, as the ring's plan makes them.
        """
        received = [torch.empty_like(t) for t in tensors] if recv else []
        ops = []
        if send:
            ops += [dist.P2POp(dist.isend, t.contiguous(), self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self._prev, self.group) for r in received]
        self._works = dist.batch_isend_irecv(ops) if ops else []
        return received

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all: split ``x`` along ``scatter_dim`` over the ranks, gather along ``gather_dim``.

    Ulysses uses it twice per attention: heads scattered / sequence gathered before, the reverse
    after. Its backward is the reverse all-to-all.
    """
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    # all_to_all_single on one stacked buffer (gloo has no list all_to_all): chunk i goes to rank i.
    send = torch.stack(x.chunk(size, dim=scatter_dim))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None
