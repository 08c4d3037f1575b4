"""Gradient norm and clipping over any mix of plain and DTensor gradients, counted once.

Lightning clips with ``torch.nn.utils.clip_grad_norm_``, which handles a list of like DTensors but
not a mix: tensor parallelism leaves column/row-parallel weights sharded over ``tp`` next to
replicated norms (plain tensors, or ``Replicate`` DTensors), ZeRO-1/2 shards are unevenly
``Shard(0)``-split, FSDP2 and HSDP shard over one or two dims. The rule that covers every case:
sum the squares of the local gradient pieces, then add up the partial sums over exactly the mesh
dims a gradient is sharded on (a ``Partial`` gradient is reduced first: a sum's norm is not the sum
of its pieces' norms). A replicated gradient is identical on every rank of
its replicated dims and must not be counted once per rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def grad_norm(parameters: Iterable[nn.Parameter], across: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    """The global L2 norm of the gradients, as if every parameter were whole on one rank.

    Every rank holding any of the parameters must call it (it all-reduces over sharded dims).
    ``across``: groups whose ranks hold different parameters (pipeline stages): the squares are
    summed over them at the end. A parameter marked ``_ultrascale_norm_skip`` (the second copy of
    a tied weight) is not counted.

    Example:
        >>> p = nn.Parameter(torch.ones(3)); p.grad = torch.full((3,), 2.0)
        >>> float(grad_norm([p])) == float(torch.full((3,), 2.0).norm())
        True
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    extra: dict[object, tuple[dist.ProcessGroup, ...]] = {}
    device = None
    for p in parameters:
        if p.grad is None or getattr(p, "_ultrascale_norm_skip", False):
            continue
        g = p.grad
        # A sharded optimizer's flat shard of tensor-parallel pieces is split over more groups
        # than its own mesh says (ZeroEngine marks them).
        more: tuple[dist.ProcessGroup, ...] = getattr(p, "_ultrascale_norm_groups", ())
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                # e.g. a sequence-parallel norm weight: each tp rank holds its sequence shard's sum.
                # ||a + b|| is not made of ||a|| and ||b||: reduce the pieces first.
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            # Every non-replicated dim holds distinct pieces: Shard, and FSDP-over-TP's _StridedShard
            # (which is neither a Shard subclass nor is_shard() in torch 2.13).
            sharded = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key: object = (g.device_mesh, sharded, tuple(x.group_name for x in more))
            groups[key].append(g.to_local())
        else:
            key = (None, (), tuple(x.group_name for x in more))
            groups[key].append(g)
        extra[key] = more
        device = g.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        squares = torch.stack([t.detach().float().pow(2).sum() for t in grads]).sum()
        mesh, sharded, _ = key  # type: ignore[misc]
        for dim in sharded:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        for group in extra[key]:
            dist.all_reduce(squares, group=group)
        total = total + squares
    for group in across:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, across: Sequence[dist.ProcessGroup] = ()
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's formula); return the norm."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params, across)
    # torch.nn.utils.clip_grad_norm_'s coefficient, epsilon included, for identical numerics.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return norm
