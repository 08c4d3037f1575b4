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

import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from lightning_ultrascale.models.common.moe import Dispatcher, GroupedExperts, _in_backward
from lightning_ultrascale.parallel.expert.placement import balance_experts

log = logging.getLogger(__name__)
#: Training forwards per ``rebalance_every`` after which a run that never handed over its loads is told.
_UNOBSERVED_FORWARDS = 64


class AllToAllDispatcher(Dispatcher):
    """Sends each expert's rows to the rank of ``group`` holding it (experts ``r E/ep ..`` on rank ``r``).

    Expert gradients are scaled by ``1/ep``: a rank's expert receives the tokens of all ``ep``
    ranks of its group, so after the average over its expert-data ranks (``dp x cp / ep`` of them)
    it holds the mean over all ``dp x cp`` ranks, like every other gradient.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        #: Rows each of this rank's experts (slots, under a placement) received, summed over the training forwards
        #: since it was last reset to None (a recomputed forward not counted again); benchmarks and tests read it.
        self.received: Tensor | None = None

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        ep = self.size
        send = counts.view(ep, -1)  # [destination rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [source rank, my local expert]
        if torch.is_grad_enabled() and not _in_backward():  # (a recomputed forward counts nothing again)
            self.received = recv.sum(0) if self.received is None else self.received + recv.sum(0)
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
        y = self._run(experts, received[order], recv.sum(0))
        restored = torch.empty_like(y).index_copy(0, order, y)
        back = all_to_all_single_autograd(restored, send_splits, recv_splits, self.group)
        return back if sent == x.shape[0] else torch.cat((back, back.new_zeros(x.shape[0] - sent, back.shape[1])))

    def _run(self, experts: GroupedExperts, rows: Tensor, counts: Tensor) -> Tensor:
        """This rank's experts on the rows it received, sorted by its local expert (``counts`` of each)."""
        return experts(rows, counts, grad_scale=1.0 / self.size)


class PlacedDispatcher(AllToAllDispatcher):
    """An :class:`AllToAllDispatcher` over an expert placement: ``P = E + R`` slots, ``P / ep`` a rank, each running
    one logical expert (:mod:`~lightning_ultrascale.parallel.expert.placement`).

    The experts' parameters stay where expert parallelism puts them (experts ``r E/ep ..`` on rank ``r``: the
    optimizer, its state, checkpoints and every other reader see nothing else); each forward sends every slot
    its expert's weights (one all-to-all of this rank's ``E/ep`` experts, a replicated one to each of its
    slots), and backward sends the slots' gradients back, summed into the expert's: the placement changes where
    the rows are computed, never what. A replicated expert's rows (sorted by expert, the rank's own) are split
    over its replicas in contiguous, nearly equal parts. Hierarchical over ``nodes`` (the group's ranks
    ``n ep/nodes ..`` on node ``n``) when they divide the routing ``groups``. Every ``every`` optimizer steps
    (:meth:`observe`: the steps' global tokens per expert, the same on every rank, no collective) the placement
    is re-computed
    (:func:`~lightning_ultrascale.parallel.expert.placement.balance_experts`); before the first, the experts
    ``0 .. R-1`` are replicated.
    """

    def __init__(
        self, group: dist.ProcessGroup, experts: int, redundant: int, every: int | None, nodes: int = 1, groups: int = 1
    ) -> None:
        super().__init__(group)
        self.experts, self.redundant, self.every = experts, redundant, every
        self.nodes, self.groups = nodes, groups  # hierarchical placement: the group's nodes, the routing groups
        self._window: Tensor | None = None  # tokens per expert since the last placement
        self._steps = 0
        self._forwards = 0  # training forwards, to tell a run that never hands the loads over (:meth:`observe`)
        self.placements = 0  # how many times the placement was re-computed from loads
        self.place(balance_experts(torch.ones(1, experts), self.size, redundant, nodes, groups).slots[0])

    def place(self, slots: Tensor) -> None:
        """Run on the placement ``slots [P]`` (the logical expert of each slot, rank-major) from the next forward.

        The ranks' sets of slots are first given to the ranks that hold most of their experts already (within a
        node: :func:`keep_home`): fewer weights travel, the balance is the same.
        """
        per_rank, local = slots.numel() // self.size, self.experts // self.size
        self.slots = keep_home(slots.cpu(), self.size, self.experts, self.nodes)
        held = self.slots.view(self.size, per_rank).tolist()
        me = dist.get_rank(self.group)
        replicas: list[list[int]] = [[] for _ in range(self.experts)]
        for slot, expert in enumerate(self.slots.tolist()):
            replicas[expert].append(slot)
        width = max(len(r) for r in replicas)
        replicas.append([slots.numel()])  # the rows of none: past every slot
        self._replica_slots = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas])  # [E + 1, most]
        self._replica_count = torch.tensor([len(r) for r in replicas])
        # The weights' exchange: to rank b, b's slots whose expert this rank holds, in b's slot order.
        send = [[e % local for e in held[b] if e // local == me] for b in range(self.size)]
        self._send_index = torch.tensor([i for row in send for i in row], dtype=torch.long)
        self._weight_send = [len(row) for row in send]
        sources = [e // local for e in held[me]]  # the rank holding each of my slots' expert
        self._weight_recv = [sources.count(q) for q in range(self.size)]
        arrival = sorted(range(per_rank), key=lambda slot: sources[slot])  # (stable: slot order per source)
        self._slot_order = torch.tensor(arrival).argsort()  # my slot -> its row among those received
        self._on_device: dict[tuple[str, torch.device], Tensor] = {}  # the tables above, copied once per placement

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        """``x`` sorted by logical expert with ``counts [E]``: each row to a slot of its expert, then as the base."""
        if self.every is not None and torch.is_grad_enabled() and self._steps == 0:
            self._forwards += 1
            if self._forwards == _UNOBSERVED_FORWARDS * self.every and dist.get_rank() == 0:
                log.warning(
                    "ExpertParallel(rebalance_every=%d): %d training forwards and no loads observed, so the experts "
                    "stay on their first placement. The LightningModule must call "
                    "model.observe_expert_loads(global tokens per expert) after each optimizer step (LlamaModule "
                    "does); training is unaffected either way",
                    self.every, self._forwards,
                )  # fmt: skip
        device, total, n_slots = x.device, x.shape[0], self.slots.numel()
        # Rows past sum(counts) (over capacity) belong to none: "expert E", one "slot P" after every slot.
        counts = torch.cat((counts, (total - counts.sum())[None]))
        expert = torch.arange(self.experts + 1, device=device).repeat_interleave(counts, output_size=total)
        within = torch.arange(total, device=device) - (counts.cumsum(0) - counts)[expert]
        replicas = self._table("_replica_count", device)[expert]
        replica = within * replicas // counts[expert].clamp(min=1)  # contiguous, nearly equal parts
        slot = self._table("_replica_slots", device)[expert, replica]
        order = slot.argsort(stable=True)
        slot_counts = torch.zeros(n_slots + 1, dtype=torch.long, device=device).scatter_add_(
            0, slot, torch.ones_like(slot)
        )
        y = super().__call__(experts, x[order], slot_counts[:n_slots])
        return torch.empty_like(y).index_copy(0, order, y)

    def _run(self, experts: GroupedExperts, rows: Tensor, counts: Tensor) -> Tensor:
        return experts(rows, counts, grad_scale=1.0 / self.size, place=self._slot_weights)

    def _table(self, name: str, device: torch.device) -> Tensor:
        """One of the placement's index tables on ``device`` (copied there once, not every forward)."""
        key = (name, device)
        if key not in self._on_device:
            self._on_device[key] = getattr(self, name).to(device)
        return self._on_device[key]

    def _slot_weights(self, w1: Tensor, w2: Tensor, w3: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's experts' weights (``[E/ep, ...]`` each) -> its slots' (``[P/ep, ...]``), by one all-to-all."""
        shapes = [w.shape[1:] for w in (w1, w2, w3)]
        rows = torch.cat([w.flatten(1) for w in (w1, w2, w3)], dim=1)
        sent = rows.index_select(0, self._table("_send_index", rows.device))
        received = all_to_all_single_autograd(sent, self._weight_recv, self._weight_send, self.group)
        mine = received.index_select(0, self._table("_slot_order", rows.device))
        parts = mine.split([math.prod(shape) for shape in shapes], dim=1)
        w1, w2, w3 = (p.reshape(-1, *shape) for p, shape in zip(parts, shapes))
        return w1, w2, w3

    @torch.no_grad()
    def observe(self, load: Tensor) -> None:
        if self.every is None:
            return
        load = load.detach().double().cpu()
        self._window = load if self._window is None else self._window + load
        self._steps += 1
        if self._steps % self.every == 0:
            placement = balance_experts(self._window[None], self.size, self.redundant, self.nodes, self.groups)
            self.place(placement.slots[0])
            self._window = None
            self.placements += 1


def keep_home(slots: Tensor, ranks: int, experts: int, nodes: int = 1) -> Tensor:
    """``slots [P]`` (rank-major sets of ``P / ranks``) with the sets reassigned among each node's ranks so that as
    many slots as it can sit on the rank holding their expert's parameters (experts ``r E/ranks ..`` on rank
    ``r``): greedily, the (set, rank) pair sharing the most experts first.

    Example:
        >>> keep_home(torch.tensor([2, 3, 0, 1]), ranks=2, experts=4).tolist()  # the two sets swap ranks
        [0, 1, 2, 3]
    """
    sets = slots.view(ranks, -1)
    local, per_node = experts // ranks, ranks // nodes
    order = list(range(ranks))
    for node in range(nodes):
        members = range(node * per_node, (node + 1) * per_node)
        shared = {(s, r): int((sets[s] // local == r).sum()) for s in members for r in members}
        free_sets, free_ranks = set(members), set(members)
        for (s, r), _ in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
            if s in free_sets and r in free_ranks:
                order[r] = s
                free_sets.discard(s)
                free_ranks.discard(r)
    return sets[order].flatten()
