"""Expert placement while training (``ExpertParallel(redundant_experts=R, rebalance_every=N)``): re-placed from the
measured loads mid-run, the hottest expert's rows split over its replicas on other ranks, and training computes what
one process computes, in every layout it composes with."""

from dataclasses import replace
from typing import Any

import lightning as L
import pytest
import torch
from llama_runs import DEEPSEEK_V3_TINY, GLOBAL_BATCH, SEQ_LEN, SGD, run_tiny_llama

from lightning_ultrascale import (
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    Recompute,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.expert.comms import PlacedDispatcher
from lightning_ultrascale.parallel.expert.placement import ExpertPlacement
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity


def _placed(ep: int) -> ExpertParallel:
    return ExpertParallel(ep, redundant_experts=ep, rebalance_every=1)


#: name -> (plugins, world size, data-parallel size); re-placed after every step, so steps 2 and 3 run on placements
#: computed from the loads of steps 1 and 2.
LAYOUTS = {
    "ep2": (lambda: [_placed(2)], 2, 2),
    "ep4": (lambda: [_placed(4)], 4, 4),
    "ep2_zero3": (lambda: [_placed(2), ZeRO(3)], 2, 2),
    # Each pipeline stage's MoE blocks, placed from their own rows of the loads.
    "ep2_pp2": (lambda: [PipelineParallel(2, "1f1b", microbatches=2), _placed(2)], 4, 2),
    # The recomputed forward sends the slots their weights again, inside backward.
    "ep2_recompute": (lambda: [_placed(2), Recompute("full")], 2, 2),
}


@pytest.fixture(scope="module")
def reference():
    return run_tiny_llama(SGD, model=DEEPSEEK_V3_TINY, steps=3)


def test_rows_over_capacity_stay_dropped_on_a_placement():
    # Capacity 1.0 drops rows: they sort past every slot and come back as zeros, as without a placement.
    capped = replace(DEEPSEEK_V3_TINY, name="capped", moe=replace(DEEPSEEK_V3_TINY.moe, capacity_factor=1.0))
    run = run_tiny_llama(SGD, lambda: [_placed(2)], world_size=2, dp=2, model=capped, steps=3)
    assert_parity(run, run_tiny_llama(SGD, model=capped, steps=3), rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_on_a_placement_re_computed_mid_run_equals_one_process(layout, reference):
    plugins, world_size, dp = LAYOUTS[layout]
    run = run_tiny_llama(SGD, plugins, world_size=world_size, dp=dp, model=DEEPSEEK_V3_TINY, steps=3)
    assert_parity(run, reference, rtol=1e-5)


class _Placements(L.Callback):
    """Expert 0 hot in every MoE block (its selection bias raised); after each step each block's placement it
    ran on, the rows this rank's slots received, the step's global loads, and the placement for the next step."""

    def __init__(self, skew: bool = True) -> None:
        self.steps: list[dict[str, Any]] = []
        self.ran_on: dict[str, list[int]] = {}
        self.skew = skew

    def on_train_start(self, trainer, pl_module) -> None:
        for moe in pl_module.model.moe_layers().values():
            moe.router.expert_bias[0] += 1.0 if self.skew else 0.0
        self.ran_on = {name: moe.dispatcher.slots.tolist() for name, moe in self._layers(pl_module).items()}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        loads = pl_module.expert_stats.loads
        step = {}
        for row, (name, moe) in enumerate(self._layers(pl_module).items()):
            dispatcher = moe.dispatcher
            step[name] = {
                "ran_on": self.ran_on[name],
                "received": dispatcher.received.tolist(),
                "loads": loads[row].tolist(),
                "placements": dispatcher.placements,
            }
            dispatcher.received = None
            self.ran_on[name] = dispatcher.slots.tolist()
        self.steps.append(step)

    @staticmethod
    def _layers(pl_module) -> dict[str, Any]:
        layers = pl_module.model.moe_layers()
        assert all(isinstance(moe.dispatcher, PlacedDispatcher) for moe in layers.values())
        return layers


def _fit_placed(ep: int, redundant: int, every: int, steps: int) -> list[dict[str, Any]]:
    record = _Placements()
    strategy = UltraScaleStrategy(ExpertParallel(ep, redundant_experts=redundant, rebalance_every=every))
    trainer = L.Trainer(
        accelerator="cpu", devices=ep, strategy=strategy, max_steps=steps, callbacks=[record], **QUIET_TRAINER
    )
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // ep, seed=0)
    trainer.fit(LlamaModule(DEEPSEEK_V3_TINY, optim=SGD), datamodule=data)
    return record.steps


def test_the_hot_expert_is_replicated_and_the_ranks_receive_what_the_placement_says():
    ranks = run_pooled(_fit_placed, 2, 2, 2, 2, 4, timeout_s=300)
    for step, layers in enumerate(ranks[0]):
        for name, layer in layers.items():
            assert layer["placements"] == (step + 1) // 2  # re-placed after steps 2 and 4
            slots = torch.tensor(layer["ran_on"])
            loads = torch.tensor(layer["loads"])
            received = torch.tensor([r[step][name]["received"] for r in ranks])  # [rank, its slots]
            assert received.sum() == loads.sum()  # every routed row ran once
            # Each rank's rows: its slots' experts', a replicated expert's split over its replicas (the split is
            # per sending rank, in whole rows: within a row per sender of the placement's even split).
            predicted = ExpertPlacement(slots[None], 2).rank_loads(loads[None])[0]
            assert (received.sum(1).double() - predicted).abs().max() <= 2 * 5, (received, predicted)
            if step >= 2:  # on a placement from measured loads: the hot expert on both ranks
                assert (slots.view(2, -1) == 0).any(1).all(), slots
                contiguous = ExpertPlacement.contiguous(1, 8, 2).max_over_mean(loads[None])
                assert ExpertPlacement(slots[None], 2).max_over_mean(loads[None]) < contiguous


def _fit_on_two_nodes() -> tuple[Any, list[dict[str, Any]]]:
    """ep4 as if ranks 0-1 and 2-3 were two nodes (torchrun's GROUP_RANK): the placement is hierarchical."""
    import os

    from lightning_ultrascale.testing.parity import ParityRecorder

    os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) // 2)
    try:
        recorder, placements = ParityRecorder(), _Placements(skew=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=UltraScaleStrategy(_placed(4)), max_steps=3,
            callbacks=[recorder, placements], **QUIET_TRAINER,
        )  # fmt: skip
        data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // 4, seed=0)
        trainer.fit(LlamaModule(DEEPSEEK_V3_TINY, optim=SGD), datamodule=data)
        return recorder.record, placements.steps
    finally:
        del os.environ["GROUP_RANK"]


def test_on_two_nodes_each_routing_group_stays_on_one_node(reference):
    # DeepSeek-V3-tiny routes within 4 groups of 2 experts: a hierarchical placement puts each group's experts and
    # their replicas on one node's ranks, so a token's groups cross few nodes; training is unchanged.
    record, steps = run_pooled(_fit_on_two_nodes, 4, timeout_s=300)[0]
    assert_parity(record, reference, rtol=1e-5)
    for layer in steps[-1].values():
        nodes = torch.tensor(layer["ran_on"]).view(2, -1)  # [node, its slots]
        for group in range(4):
            assert sum(bool((nodes[n] // 2 == group).any()) for n in range(2)) == 1, (group, nodes)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"size": 2, "redundant_experts": -1}, r"ExpertParallel\(redundant_experts=-1\) must be an integer >= 0"),
    ({"size": 2, "rebalance_every": 0}, r"rebalance_every=0"),
    ({"size": 1, "redundant_experts": 2}, r"has one; valid: size > 1, or redundant_experts=0"),
])  # fmt: skip
def test_bad_placement_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ExpertParallel(**kwargs)


def test_redundant_slots_that_do_not_split_over_the_ranks_are_refused_before_any_process_group():
    strategy = UltraScaleStrategy(ExpertParallel(2, redundant_experts=1))
    with pytest.raises(ConfigError, match=r"8 experts \+ 1 slots do not split evenly over .*size=2.* ranks; valid: 2"):
        strategy.validate(LlamaModule(DEEPSEEK_V3_TINY).model_spec, None, world_size=2)


def test_the_planner_prices_the_weights_a_placement_sends():
    from lightning_ultrascale.models.llama import Llama
    from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware

    with torch.device("meta"):
        model = Llama(DEEPSEEK_V3_TINY)
    costs = {}
    for name, ep in (("plain", ExpertParallel(2)), ("placed", _placed(2))):
        candidate = Candidate.from_plugins([ep, ZeRO(0)], 2, 1)
        [costs[name]] = estimate(
            Workload(DEEPSEEK_V3_TINY, SEQ_LEN, GLOBAL_BATCH), candidate, model, get_hardware("h100")
        )
    # Each forward sends every slot (5 a rank: 8 experts + 2 slots over 2) its expert's w1, w2, w3; backward their
    # gradients back; in every MoE block.
    view, cfg = costs["placed"].view, DEEPSEEK_V3_TINY
    weights = 5 * 3 * cfg.dim * cfg.moe.moe_ffn_dim * view.element_bytes
    moe_blocks = len(cfg.moe_blocks())
    sent = costs["placed"].comm["ep:all_to_all"] - costs["plain"].comm["ep:all_to_all"]
    assert sent == 2 * weights * moe_blocks * view.forwards
    assert costs["placed"].memory["working"] - costs["plain"].memory["working"] == 2 * weights


def _forwards_without_loads(every: int, forwards: int) -> list[str]:
    import logging

    import torch.distributed as dist

    from lightning_ultrascale.models.common.moe import GroupedExperts

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_ultrascale.parallel.expert.comms")
    logger.addHandler(handler)
    try:  # (a pooled worker lives on: the handler goes)
        experts = GroupedExperts(4, 8, 8)
        for w in experts.parameters():
            torch.nn.init.normal_(w)
        dispatcher = PlacedDispatcher(dist.group.WORLD, 4, 0, every)
        for _ in range(forwards):
            dispatcher(experts, torch.randn(6, 8), torch.tensor([2, 1, 3, 0]))
    finally:
        logger.removeHandler(handler)
    return messages


def test_a_run_that_never_hands_over_its_loads_is_told():
    # A LightningModule other than LlamaModule that does not call observe_expert_loads: said once, after 64 x N.
    [messages] = run_pooled(_forwards_without_loads, 1, 2, 64 * 2 + 5, timeout_s=120)
    assert len(messages) == 1
    assert "ExpertParallel(rebalance_every=2): 128 training forwards and no loads observed" in messages[0]


def test_experts_that_cannot_be_placed_are_refused_before_any_process_group():
    # transformers' own experts (model=hf) run on their parameters only: refused by name at validation.
    from lightning_ultrascale.models.spec import ModelSpec
    from lightning_ultrascale.parallel.dims import ParallelDims

    spec = ModelSpec("qwen3_moe", n_layers=2, n_heads=4, n_kv_heads=2, dim=64, vocab_size=320, n_experts=8,
                     moe_blocks=(0, 1))  # fmt: skip
    with pytest.raises(ConfigError, match=r"model qwen3_moe's experts run on their own parameters only"):
        _placed(2).validate(ParallelDims(dp_shard=2), spec, None)
    ExpertParallel(2).validate(ParallelDims(dp_shard=2), spec, None)
    assert LlamaModule(DEEPSEEK_V3_TINY).model_spec.expert_placement
