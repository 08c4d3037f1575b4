"""EPLB's expert placement (``parallel/expert/placement.py``): DeepSeek's own example reproduced, and the
properties a placement must have on loads our tests did not pick."""

import pytest
import torch

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.expert.placement import ExpertPlacement, _pack, _replicate, balance_experts
from lightning_ultrascale.plan import expert_load

#: DeepSeek's EPLB README: two MoE layers of 12 experts in 4 groups, 4 redundant slots, 2 nodes of 4 GPUs.
DEEPSEEK_LOADS = torch.tensor(
    [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
)
DEEPSEEK_PLACEMENT = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_deepseeks_example_placement_is_reproduced():
    # The hierarchical policy: groups packed onto nodes, replicas within nodes, slots packed onto GPUs.
    placed = balance_experts(DEEPSEEK_LOADS, ep=8, redundant=4, nodes=2, groups=4)
    assert placed.slots.tolist() == DEEPSEEK_PLACEMENT


def _skewed_loads(blocks: int, experts: int, seed: int) -> torch.Tensor:
    """Token counts with a few hot experts, as a router shows early in training."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(blocks, experts, generator=g) ** 4 * 1000).round() + 1


@pytest.mark.parametrize(("experts", "ep", "redundant", "nodes", "groups"), [
    (8, 2, 0, 1, 1), (8, 4, 4, 1, 1), (16, 4, 4, 2, 4), (64, 8, 8, 2, 8), (12, 4, 4, 2, 3),
])  # fmt: skip
def test_every_placement_holds_every_expert_and_evens_the_ranks(experts, ep, redundant, nodes, groups):
    loads = _skewed_loads(6, experts, seed=experts + ep)
    placed = balance_experts(loads, ep, redundant, nodes, groups)
    slots = experts + redundant
    assert placed.slots.shape == (6, slots) and placed.slots_per_rank == slots // ep
    counts = placed.replicas(experts)
    assert (counts >= 1).all() and (counts.sum(1) == slots).all()
    # The rows are all received, split over the replicas; fewer on the busiest rank than experts r E/ep .. leave.
    per_rank = placed.rank_loads(loads)
    torch.testing.assert_close(per_rank.sum(1), loads.double().sum(1))
    contiguous = ExpertPlacement.contiguous(6, experts, ep)
    assert placed.max_over_mean(loads) <= contiguous.max_over_mean(loads)
    # A rank holds a second replica of an expert only where the expert has more replicas than its node has ranks
    # (two replicas on one rank split nothing).
    for block, row in enumerate(placed.slots.view(6, ep, -1)):
        for rank in row:
            held = torch.bincount(rank, minlength=experts)
            assert (held <= -(-counts[block] // (ep // nodes))).all(), (block, rank)
    if nodes == 1:  # never busier than DeepSeek's greedy replication packed (up to a last swap of two cold slots)
        greedy, replicas = _replicate(loads.double(), slots)
        weight = (loads.double() / replicas).gather(1, greedy)
        pack, _ = _pack(weight, ep)
        theirs = torch.zeros(6, ep, dtype=torch.float64).scatter_add_(1, pack, weight)
        theirs = (theirs.max(1).values / theirs.mean(1)).mean()
        assert placed.max_over_mean(loads) <= 1.02 * float(theirs)


def test_replicas_go_where_they_even_the_ranks_not_only_to_the_hottest_expert():
    # Two experts hold every row; 4 ranks of 3 slots. DeepSeek's greedy gives each hot expert 3 replicas (6 hot
    # slots on 4 ranks: the busiest holds 2, 1.33x the mean); 2 each put one hot slot on every rank.
    loads = torch.tensor([[4091, 1, 4090, 2, 3, 4, 1, 0]])
    placed = balance_experts(loads, ep=4, redundant=4)
    assert placed.replicas(8)[0, [0, 2]].tolist() == [2, 2]
    assert placed.max_over_mean(loads) < 1.001
    greedy, _ = _replicate(loads.double(), 12)
    assert torch.bincount(greedy[0], minlength=8)[[0, 2]].tolist() == [3, 3]


def test_a_hierarchical_placement_keeps_each_group_on_one_node():
    loads = _skewed_loads(4, 16, seed=1)
    placed = balance_experts(loads, ep=4, redundant=4, nodes=2, groups=4)
    for row in placed.slots.view(4, 2, -1):  # [node, its slots]
        nodes_of_group = [{n for n in range(2) if (row[n] // 4 == g).any()} for g in range(4)]
        assert all(len(nodes) == 1 for nodes in nodes_of_group), nodes_of_group


def test_the_planner_prices_the_balance_a_placement_leaves():
    loads = _skewed_loads(3, 8, seed=0)
    before = expert_load(loads, ep=4)
    after = expert_load(loads, ep=4, redundant=4)
    assert before == pytest.approx(ExpertPlacement.contiguous(3, 8, 4).max_over_mean(loads))
    assert 1.0 <= after < before
    assert expert_load(torch.ones(2, 8), ep=4, redundant=0) == pytest.approx(1.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ep": 3}, r"8 experts \+ redundant=0 slots must split evenly over ep=3"),
    ({"ep": 4, "redundant": 2}, r"redundant=2 slots must split evenly over ep=4 .* valid redundant: multiples of 4"),
    ({"ep": 4, "redundant": -1}, r"redundant=-1 must be an integer >= 0"),
    ({"ep": 0}, r"ep=0 must be a positive integer"),
    ({"ep": 4, "groups": 3}, r"the experts over groups=3"),
])  # fmt: skip
def test_a_placement_that_cannot_split_evenly_is_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        balance_experts(torch.ones(1, 8), **kwargs)
    with pytest.raises(ConfigError, match="every expert a slot"):
        ExpertPlacement(torch.zeros(1, 4, dtype=torch.int64), ep=2).rank_loads(torch.ones(1, 4))


def test_keep_home_gives_each_rank_the_set_holding_most_of_its_own_experts():
    from lightning_ultrascale.parallel.expert.comms import keep_home

    loads = _skewed_loads(1, 16, seed=3)
    for nodes in (1, 2):
        slots = balance_experts(loads, ep=4, redundant=4, nodes=nodes, groups=4).slots[0]
        kept = keep_home(slots, ranks=4, experts=16, nodes=nodes)
        before, after = slots.view(4, -1), kept.view(4, -1)
        # The same sets, each moved within its node only, and at least as many slots at their expert's rank.
        for node in range(nodes):
            rows = range(node * 4 // nodes, (node + 1) * 4 // nodes)
            assert sorted(before[list(rows)].tolist()) == sorted(after[list(rows)].tolist())
        home = lambda sets: int(sum((sets[r] // 4 == r).sum() for r in range(4)))  # noqa: E731
        assert home(after) >= home(before)
        balance = [ExpertPlacement(x[None], 4).max_over_mean(loads) for x in (kept, slots)]
        assert balance[0] == balance[1]
