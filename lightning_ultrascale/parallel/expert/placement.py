"""Expert placement from measured load: DeepSeek's Expert Parallelism Load Balancer (EPLB), our own code.

Under expert parallelism the slowest rank sets the step: the one whose experts received the most
rows. Routers are rarely uniform (a few hot experts early in training), and the aux-loss-free bias
only nudges routing over many steps. EPLB answers with a *placement*: ``P = E + R`` physical slots
per MoE block, ``P / ep`` on each expert-parallel rank, each holding one logical expert; the ``R``
redundant slots replicate the hottest experts (a replicated expert's rows are split over its
replicas), and the slots are packed onto ranks so each rank's rows even out. Hierarchically, as
DeepSeek's ``rebalance_experts``: expert groups (group-limited routing) are first packed onto nodes,
so a token's groups stay within few nodes; replicas are made within each node; then the node's slots
are packed onto its ranks. Where the nodes do not divide the groups, globally (one node, one group).
Two departures from DeepSeek's code (the busiest rank no busier, but for a swap of two cold slots): how
many redundant slots go to the hot experts is chosen by packing (greedy replication can make more hot
slots than ranks can share evenly), and a rank takes a second replica of an expert only where it cannot
be avoided.

A placement is a layout fact computed from loads (``LlamaModule.expert_stats().loads``: tokens per
expert of every MoE block, summed over the global batch): the same on every rank, since every rank
reads the same global loads.

Training runs on a placement with ``ExpertParallel(redundant_experts=R, rebalance_every=N)``
(:class:`~lightning_ultrascale.parallel.expert.comms.PlacedDispatcher`); the balance a placement leaves
(:meth:`ExpertPlacement.rank_loads`) is measured by ``benchmarks/expert_placement.py`` and priced by the
planner (:func:`~lightning_ultrascale.plan.expert_load` with ``redundant``). Without a placement, expert
parallelism holds experts ``r E/ep ..`` on rank ``r`` (:meth:`ExpertPlacement.contiguous`).

Example:
    >>> loads = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])  # tokens per expert
    >>> round(ExpertPlacement.contiguous(1, 12, ep=4).max_over_mean(loads), 3)  # experts 0-2 on rank 0, ...
    1.278
    >>> placed = balance_experts(loads, ep=4, redundant=4)  # 16 slots, 4 per rank
    >>> placed.slots.view(4, 4).tolist()  # rank by rank: the hottest two (10, 5) on two ranks each
    [[1, 5, 2, 7], [4, 5, 9, 6], [10, 0, 3, 6], [10, 11, 8, 7]]
    >>> placed.rank_loads(loads).tolist(), round(placed.max_over_mean(loads), 3)
    ([[256.5, 262.0, 262.0, 252.5]], 1.015)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ultrascale.errors import ConfigError, is_positive_int


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot holds, per MoE block: ``slots [blocks, P]`` (int64); slots
    ``r P/ep .. (r+1) P/ep - 1`` are expert-parallel rank ``r``'s."""

    slots: Tensor
    ep: int

    def __post_init__(self) -> None:
        if self.slots.ndim != 2 or self.slots.shape[1] % self.ep:
            raise ConfigError(f"a placement needs slots [blocks, P] with P divisible by ep={self.ep}")

    @classmethod
    def contiguous(cls, blocks: int, experts: int, ep: int) -> ExpertPlacement:
        """Expert parallelism's own layout: experts ``r E/ep ..`` on rank ``r``, no replicas."""
        return cls(torch.arange(experts).repeat(blocks, 1), ep)

    @property
    def slots_per_rank(self) -> int:
        return self.slots.shape[1] // self.ep

    def replicas(self, experts: int) -> Tensor:
        """Slots holding each logical expert ``[blocks, experts]`` (0: an expert without a slot)."""
        return torch.zeros(self.slots.shape[0], experts, dtype=torch.int64).scatter_add_(
            1, self.slots, torch.ones_like(self.slots)
        )

    def rank_loads(self, loads: Tensor) -> Tensor:
        """Rows each rank's slots receive ``[blocks, ep]`` from per-expert ``loads [blocks, experts]``, a replicated
        expert's rows split evenly over its replicas."""
        loads = loads.double()
        counts = self.replicas(loads.shape[1])
        if (counts == 0).any():
            raise ConfigError("a placement must give every expert a slot")
        per_slot = (loads / counts).gather(1, self.slots)
        return per_slot.view(loads.shape[0], self.ep, -1).sum(-1)

    def max_over_mean(self, loads: Tensor) -> float:
        """The busiest rank's rows over the mean, averaged over the blocks (1.0: even)."""
        per_rank = self.rank_loads(loads)
        return float((per_rank.max(-1).values / per_rank.mean(-1).clamp(min=1e-12)).mean())


def balance_experts(loads: Tensor, ep: int, redundant: int = 0, nodes: int = 1, groups: int = 1) -> ExpertPlacement:
    """EPLB's placement for per-expert ``loads [blocks, experts]`` over ``ep`` ranks, with ``redundant`` extra
    slots per block, on ``nodes`` nodes (``ep / nodes`` ranks each), experts in ``groups`` routing groups.

    Hierarchical where ``nodes`` divides ``groups``; otherwise global (see the module docstring).
    """
    blocks, experts = loads.shape
    slots = experts + redundant
    _check(experts, ep, redundant, nodes, groups)
    if groups % nodes:
        groups, nodes = 1, 1
    weight = loads.double()
    per_node, group_size = experts // nodes, experts // groups
    # 1. Pack the groups onto nodes, evenly by load; number the experts node by node ("node-major" ids).
    group_node, group_rank = _pack(weight.view(blocks, groups, group_size).sum(-1), nodes)
    first = (group_node * (groups // nodes) + group_rank) * group_size  # [blocks, groups]: its first node-major id
    to_major = (first[..., None] + torch.arange(group_size)).flatten(1)  # logical -> node-major
    from_major = _inverse(to_major)
    # 2. Replicate within each node: [blocks x nodes, experts per node] -> its slots; 3. pack them onto its ranks.
    node_weight = weight.gather(1, from_major).view(blocks * nodes, per_node)
    slot_expert, rank, rank_slot = _replicate_and_pack(node_weight, slots // nodes, ep // nodes)
    position = _inverse(rank * (slots // ep) + rank_slot)  # [.., position on the node] -> the node's slot
    major = slot_expert.gather(1, position).view(blocks, nodes, -1) + (torch.arange(nodes) * per_node)[:, None]
    return ExpertPlacement(from_major.gather(1, major.flatten(1)), ep)


def _check(experts: int, ep: int, redundant: int, nodes: int, groups: int) -> None:
    for name, value in (("ep", ep), ("nodes", nodes), ("groups", groups)):
        if not is_positive_int(value):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if not (isinstance(redundant, int) and redundant >= 0):
        raise ConfigError(f"redundant={redundant!r} must be an integer >= 0 (extra expert slots per MoE block)")
    if (experts + redundant) % ep or ep % nodes or experts % groups or experts % nodes:
        raise ConfigError(
            f"{experts} experts + redundant={redundant} slots must split evenly over ep={ep} ranks, ep over "
            f"nodes={nodes} and the experts over groups={groups}; valid redundant: multiples of {ep} "
            f"(with {experts} divisible by ep)"
        )


def _pack(weight: Tensor, packs: int, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row's ``n`` items into ``packs`` packs of ``n / packs`` items, heaviest first into the lightest pack
    with room: ``(pack of each item, its position in the pack)``, both ``[rows, n]``.

    ``labels [rows, n]`` (an expert's replicas): a pack takes a second item of a label only where every pack
    with room holds one (two replicas of an expert on one rank split nothing); DeepSeek's packing does not ask.
    """
    rows, n = weight.shape
    per_pack = n // packs
    pack = torch.empty(rows, n, dtype=torch.int64)
    position = torch.empty(rows, n, dtype=torch.int64)
    for row in range(rows):
        totals, filled = [0.0] * packs, [0] * packs
        held: list[set[int]] = [set() for _ in range(packs)]
        doubled = False  # a pack took a label it holds (only then is there anything to separate)
        for item in weight[row].sort(descending=True, stable=True).indices.tolist():
            label = -1 if labels is None else int(labels[row, item])
            room = [p for p in range(packs) if filled[p] < per_pack]
            room = [p for p in room if label not in held[p]] or room
            chosen = min(room, key=totals.__getitem__)
            doubled |= label in held[chosen]
            held[chosen].add(label)
            pack[row, item], position[row, item] = chosen, filled[chosen]
            totals[chosen] += float(weight[row, item])
            filled[chosen] += 1
        if labels is not None and doubled:  # (quadratic in the items: only where a pack holds a label twice)
            _separate(weight[row], labels[row], pack[row], position[row])
    return pack, position


def _separate(weight: Tensor, labels: Tensor, pack: Tensor, position: Tensor) -> None:
    """Where the last items left a pack two of one label, swap one with the item of the closest weight in a pack
    that has neither's label (in place)."""
    for item in range(len(labels)):
        mates = [j for j in range(len(labels)) if pack[j] == pack[item] and labels[j] == labels[item]]
        if len(mates) < 2 or mates[0] == item:
            continue
        mine = {int(labels[j]) for j in range(len(labels)) if pack[j] == pack[item]}
        swaps = [
            j for j in range(len(labels))
            if pack[j] != pack[item] and int(labels[j]) not in mine
            and not any(pack[i] == pack[j] and labels[i] == labels[item] for i in range(len(labels)))
        ]  # fmt: skip
        if swaps:
            other = min(swaps, key=lambda j: abs(float(weight[j] - weight[item])))
            pack[item], pack[other] = int(pack[other]), int(pack[item])
            position[item], position[other] = int(position[other]), int(position[item])


def _replicate(weight: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """Each row's ``n`` experts into ``slots`` slots: one each, then every extra slot to the expert whose rows per
    replica are the most. ``(expert of each slot [rows, slots], replicas of each expert [rows, n])``."""
    rows, n = weight.shape
    slot_expert = torch.arange(slots).repeat(rows, 1)
    counts = torch.ones(rows, n, dtype=torch.int64)
    every = torch.arange(rows)
    for slot in range(n, slots):
        hottest = (weight / counts).max(-1).indices
        slot_expert[:, slot] = hottest
        counts[every, hottest] += 1
    return slot_expert, counts


def _replicate_and_pack(weight: Tensor, slots: int, packs: int) -> tuple[Tensor, Tensor, Tensor]:
    """Replicate each row's experts into ``slots`` and pack them into ``packs``: ``(expert of each slot, its pack,
    its position in the pack)``, each ``[rows, slots]``.

    One choice DeepSeek's greedy replication does not make: how many of the redundant slots replicate the hot
    experts. Greedy lowers the hottest *replica*'s rows, not the busiest *rank*'s: with two experts holding every
    row, 4 ranks of 3 slots and 4 redundant slots, greedy gives each 3 replicas (6 hot slots on 4 ranks: the
    busiest has 1.33x the mean), where 2 each are even. So the first ``k`` greedy replicas, ``k`` from all of them
    down to none (the others replicating the coldest experts, which moves nothing that matters), are each packed,
    and the fewest rows on the busiest rank wins; on a tie the most replicas (DeepSeek's own placement).
    """
    rows, n = weight.shape
    greedy, _ = _replicate(weight, slots)
    out = [torch.empty(rows, slots, dtype=torch.int64) for _ in range(3)]
    for row in range(rows):
        coldest = weight[row].argsort(stable=True).tolist() * (slots // n + 1)
        best: tuple[float, Tensor, Tensor, Tensor] | None = None
        for k in range(slots - n, -1, -1):
            slot_expert = torch.tensor([*range(n), *greedy[row, n : n + k].tolist(), *coldest[: slots - n - k]])
            counts = torch.bincount(slot_expert, minlength=n)
            slot_weight = (weight[row] / counts)[slot_expert]
            pack, position = _pack(slot_weight[None], packs, labels=slot_expert[None])
            busiest = float(torch.zeros(packs, dtype=slot_weight.dtype).index_add_(0, pack[0], slot_weight).max())
            if best is None or busiest < best[0] * (1 - 1e-9):
                best = (busiest, slot_expert, pack[0], position[0])
        assert best is not None
        for target, value in zip(out, best[1:]):
            target[row] = value
    return out[0], out[1], out[2]


def _inverse(permutation: Tensor) -> Tensor:
    """Each row's inverse permutation."""
    out = torch.empty_like(permutation)
    return out.scatter_(1, permutation, torch.arange(permutation.shape[1]).expand_as(permutation).contiguous())
