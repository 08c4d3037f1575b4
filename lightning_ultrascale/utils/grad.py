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
from collections.abc import Callable, Collection, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_ultrascale.utils.comm import collective_device


def _no_groups(p: nn.Parameter) -> tuple[dist.ProcessGroup, ...]:
    return ()


def grad_norm(
    parameters: Iterable[nn.Parameter],
    across: Sequence[dist.ProcessGroup] = (),
    groups_of: Callable[[nn.Parameter], tuple[dist.ProcessGroup, ...]] = _no_groups,
) -> torch.Tensor:
    """The global L2 norm of the gradients, as if every parameter were whole on one rank.

    Every rank holding any of the parameters must call it (it all-reduces over sharded dims).
    ``across``: groups whose ranks hold different parameters (pipeline stages): the squares are
    summed over them at the end. ``groups_of(p)``: more groups over which ``p``'s local pieces are
    distinct than its own placements say (a sharded optimizer's flat shard of tensor-parallel
    pieces; ``Layout.grad_norm`` knows them).

    Example:
        >>> p = nn.Parameter(torch.ones(3)); p.grad = torch.full((3,), 2.0)
        >>> float(grad_norm([p])) == float(torch.full((3,), 2.0).norm())
        True
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    extra: dict[object, tuple[dist.ProcessGroup, ...]] = {}
    device = None
    for p in parameters:
        if p.grad is None:
            continue
        more = groups_of(p)
        key, local = _local_piece(p.grad, more)
        groups[key].append(local)
        extra[key] = more
        device = local.device
    # A rank may hold no gradient (a pipeline stage's frozen part): its zero still joins the sums.
    total = torch.zeros((), dtype=torch.float32, device=device or collective_device())
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


def _local_piece(grad: torch.Tensor, more: tuple[dist.ProcessGroup, ...]) -> tuple[object, torch.Tensor]:
    """This rank's piece of ``grad`` and the key of the pieces whose squares add up over the same groups."""
    if not isinstance(grad, DTensor):
        return (None, (), tuple(x.group_name for x in more)), grad
    if any(pl.is_partial() for pl in grad.placements):
        # e.g. a sequence-parallel norm weight: each tp rank holds its sequence shard's sum.
        # ||a + b|| is not made of ||a|| and ||b||: reduce the pieces first.
        grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
    # Every non-replicated dim holds distinct pieces: Shard, and FSDP-over-TP's _StridedShard
    # (which is neither a Shard subclass nor is_shard() in torch 2.13).
    sharded = tuple(i for i, pl in enumerate(grad.placements) if not pl.is_replicate())
    return (grad.device_mesh, sharded, tuple(x.group_name for x in more)), grad.to_local()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    across: Sequence[dist.ProcessGroup] = (),
    groups_of: Callable[[nn.Parameter], tuple[dist.ProcessGroup, ...]] = _no_groups,
    uncounted: Collection[nn.Parameter] = (),
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's formula); return the norm.

    ``uncounted``: parameters scaled like the others but left out of the norm (a tied weight's
    second copy, whose gradient another rank counts).
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    norm = grad_norm([p for p in params if id(p) not in skip], across, groups_of)
    # torch.nn.utils.clip_grad_norm_'s coefficient, epsilon included, for identical numerics.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return norm


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, as if each gradient were whole on one rank.

    Element-wise, so each rank clamps its own pieces, but a ``Partial`` gradient (a
    sequence-parallel norm weight's: each tp rank holds a partial sum) is reduced first: the
    clamp of a sum is not the sum of the clamps (torch's ``clip_grad_value_`` refuses them).

    Example:
        >>> p = nn.Parameter(torch.zeros(3)); p.grad = torch.tensor([-2.0, 0.5, 3.0])
        >>> clip_grad_value_([p], 1.0); p.grad.tolist()
        [-1.0, 0.5, 1.0]
    """
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            placements = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
            grad = p.grad = grad.redistribute(grad.device_mesh, placements)
        (grad.to_local() if isinstance(grad, DTensor) else grad).clamp_(-clip_value, clip_value)
