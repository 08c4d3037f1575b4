"""Where expert parallelism moves bytes: two all-to-alls per MoE layer forward (dispatch, combine), two back.

Each rank routes its own tokens, sorts the ``T k`` (token, expert) rows by expert and tells every
rank of its ``ep`` group how many rows it sends to each of that rank's experts (a small all-to-all
of counts). Then the rows travel with uneven splits (``all_to_all_single``, whose autograd
version runs the reverse exchange in backward), the receiving rank regroups them by its local
expert, runs its experts, restores the order and sends the results back. Per layer and rank,
forward moves ``T k dim`` activation elements out and the same back, ``(ep-1)/ep`` of them to
other ranks when routing is uniform; backward the same again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from lightning_ultrascale.models.common.moe import Dispatcher, GroupedExperts


class AllToAllDispatcher(Dispatcher):
    """Sends each expert's rows to the rank of ``group`` holding it (experts ``r E/ep ..`` on rank ``r``).

    Expert gradients are scaled by ``1/ep``: a rank's expert receives the tokens of all ``ep``
    ranks of its group, so after the average over its expert-data ranks (``dp x cp / ep`` of them)
    it holds the mean over all ``dp x cp`` ranks, like every other gradient.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        ep = self.size
        send = counts.view(ep, -1)  # [destination rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [source rank, my local expert]
        # The one host read of a layer: all_to_all_single takes its split sizes as Python lists.
        splits = torch.cat((send.sum(1), recv.sum(1))).tolist()
        send_splits, recv_splits = splits[:ep], splits[ep:]
        sent = sum(send_splits)  # rows past it are dropped over capacity: none travels
        received = all_to_all_single_autograd(x[:sent], recv_splits, send_splits, self.group)
        # Rows arrive grouped by source rank, then local expert: regroup by local expert.
        local = send.shape[1]
        expert_of_row = torch.arange(local, device=x.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(recv.flatten(), output_size=sum(recv_splits))
        order = expert_of_row.argsort(stable=True)
        y = experts(received[order], recv.sum(0), grad_scale=1.0 / ep)
        restored = torch.empty_like(y).index_copy(0, order, y)
        back = all_to_all_single_autograd(restored, send_splits, recv_splits, self.group)
        return back if sent == x.shape[0] else torch.cat((back, back.new_zeros(x.shape[0] - sent, back.shape[1])))
