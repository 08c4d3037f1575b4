"""Pipeline parallelism: stage split, schedule checks, parity with one process, activation memory."""

import dataclasses

import lightning as L
import pytest
import torch
import torch.distributed as dist
from llama_runs import ADAMW, SGD, assert_adamw_parity, run_tiny_llama

from lightning_ultrascale import (
    LlamaModule,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.pipeline import balance_stages, piece_costs, plan_stages, stage_ranks
from lightning_ultrascale.parallel.pipeline.schedules import SCHEDULES
from lightning_ultrascale.parallel.pipeline.split import PieceCosts
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity

TINY = get_model_config("llama_tiny")
# Interleaved and V-shaped schedules at pp=4 need 8 stages of at least one block each.
TINY_8L = dataclasses.replace(TINY, n_layers=8, name="llama_tiny_8l")
TINY_TIED = dataclasses.replace(TINY, tie_embeddings=True, name="llama_tiny_tied")


# ------------------------------------------------------------------------------------ stage split
def test_balanced_split_gives_the_costly_head_fewer_blocks():
    costs = PieceCosts(embedding=0.0, blocks=(1.0,) * 8, head=2.0)
    assert [len(r) for r in balance_stages(costs, 2)] == [5, 3]
    # Stage costs 2, 2, 3, 1 + 2: no stage above 3, and of the even splits the earliest stages
    # (which hold the most activations under 1F1B) take the fewer blocks.
    assert [len(r) for r in balance_stages(costs, 4)] == [2, 2, 3, 1]


def test_llama3_8b_last_stage_holds_fewer_blocks_for_its_head():
    model = build_model("llama3_8b", device="meta")
    costs = piece_costs(model, model.spec)
    # The 4096 x 128256 head costs as much compute as ~2.4 blocks of 218M parameters.
    assert 2.3 < costs.head / costs.blocks[0] < 2.5
    ranges = plan_stages(model, model.spec, 4)
    # 32 blocks + a head worth 2.4 of them: 8, 9, 9 and 6 + head (8.4), where counting blocks
    # alone (8 each) would make the last stage 10.4 blocks' worth: 30% slower than the others.
    assert [len(r) for r in ranges] == [8, 9, 9, 6]
    # The costliest stage is within one block of the perfect quarter.
    assert max(_cost(costs, r) for r in ranges) - (sum(costs.blocks) + costs.head) / 4 < costs.blocks[0]


def _cost(costs: PieceCosts, blocks: range) -> float:
    cost = sum(costs.blocks[i] for i in blocks)
    return cost + (costs.head if blocks.stop == len(costs.blocks) else 0.0)


def test_user_split_points_override_the_balance():
    model = build_model("llama_tiny", device="meta")
    assert plan_stages(model, model.spec, 2, ["layers.3"]) == [range(0, 3), range(3, 4)]
    message = r"PipelineParallel\(split_points=\['layers.9'\]\): layers.9 are not split points; valid: layers.1"
    with pytest.raises(ConfigError, match=message):
        plan_stages(model, model.spec, 2, ["layers.9"])
    with pytest.raises(ConfigError, match=r"has 2 names but 2 stages need 1"):
        plan_stages(model, model.spec, 2, ["layers.1", "layers.2"])


def test_stages_are_looped_or_v_shaped():
    assert stage_ranks("1f1b", 4, 1) == [0, 1, 2, 3]
    assert stage_ranks("interleaved_1f1b", 2, 3) == [0, 1, 0, 1, 0, 1]
    # V-shape: rank 0 holds the first and the last stage.
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert stage_ranks("dualpipev", 2, 2) == [0, 1, 1, 0]


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "gpipe2"}, r"\(schedule='gpipe2'\) is unknown; valid: afab, 1f1b, interleaved_1f1b"),
        ({"schedule": "1f1b", "microbatches": 1}, r"Parallel\(microbatches=1\) is fewer than .* = 2, the minimum"),
        ({"schedule": "afab", "microbatches": 1}, r"microbatches=1\) is fewer than pp = 2"),
        ({"schedule": "dualpipev", "microbatches": 3}, r"fewer than the number of stages \(pp x virtual stages"),
        ({"schedule": "zbv", "virtual_stages": 3}, r"virtual_stages=3\) does not fit .*\(schedule='zbv'\)"),
        ({"schedule": "1f1b", "virtual_stages": 2}, r"runs exactly 1 stage\(s\) per rank; valid: 1"),
        ({"schedule": "interleaved_1f1b", "microbatches": 5}, r"microbatches=5\) must be a multiple of its rounds"),
        ({"schedule": "1f1b", "microbatches": 0}, r"PipelineParallel\(microbatches=0\) must be a positive integer"),
    ],
)
def test_bad_schedule_settings_are_refused_when_the_plugin_is_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PipelineParallel(2, **kwargs)
    assert not dist.is_initialized()


def test_more_stages_than_layers_is_refused_before_any_process_group():
    plugin = PipelineParallel(4, "interleaved_1f1b")
    message = r"size=4\) x PipelineParallel\(virtual_stages=2\) = 8 stages, but model llama_tiny has"
    with pytest.raises(ConfigError, match=message):
        plugin.validate(ParallelDims(pp=4), build_model("llama_tiny", device="meta").spec, None)
    # What trainer.fit does first: the strategy checks the module's declared spec, then sets up processes.
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=UltraScaleStrategy(plugin), **QUIET_TRAINER)
    trainer.strategy._lightning_module = LlamaModule("llama_tiny")
    with pytest.raises(ConfigError, match=r"8 stages, but model llama_tiny has n_layers=4"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    spec = build_model("llama_tiny", device="meta").spec
    with pytest.raises(
        ConfigError, match=r"DataModule\(micro_batch_size=6\) .* divisible by PipelineParallel\(microbatches=4\)"
    ):
        PipelineParallel(2, "1f1b", microbatches=4).validate(ParallelDims(pp=2), spec, DataShape(64, 6))


def test_full_checkpoints_are_refused_with_pipeline_stages():
    strategy = UltraScaleStrategy(PipelineParallel(2), save_distributed_checkpoint=False)
    with pytest.raises(ConfigError, match=r"save_distributed_checkpoint=True"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **QUIET_TRAINER)


# ------------------------------------------------------------------------------------ parity
@pytest.fixture(scope="module")
def reference_adamw():
    return run_tiny_llama(ADAMW, steps=3)


@pytest.mark.parametrize(
    ("schedule", "microbatches"),
    [("afab", 2), ("1f1b", 2), ("interleaved_1f1b", 4), ("looped_bfs", 2), ("zero_bubble", 2), ("zbv", 4),
     ("dualpipev", 4)],
)  # fmt: skip
def test_every_schedule_at_pp2_matches_one_process(reference_adamw, schedule, microbatches):
    run = run_tiny_llama(ADAMW, lambda: [PipelineParallel(2, schedule, microbatches)], 2, dp=1, steps=3)
    assert_adamw_parity(run, reference_adamw)


def test_1f1b_at_pp4_matches_one_process(reference_adamw):
    run = run_tiny_llama(ADAMW, lambda: [PipelineParallel(4, "1f1b", microbatches=8)], 4, dp=1, steps=3)
    assert_adamw_parity(run, reference_adamw)


@pytest.fixture(scope="module")
def reference_adamw_8l():
    return run_tiny_llama(ADAMW, steps=3, model=TINY_8L)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_virtual_stage_schedules_at_pp4_match_one_process(reference_adamw_8l, schedule):
    plugins = lambda: [PipelineParallel(4, schedule, microbatches=8)]  # noqa: E731
    run = run_tiny_llama(ADAMW, plugins, 4, dp=1, steps=3, model=TINY_8L)
    # Eight microbatches of one sample sum the loss in another order than one batch of eight;
    # AdamW turns that 1e-7 noise into parameter differences up to 2.2e-5 (measured) on the
    # 8-layer model: the final parameters get the AdamW bound, losses stay at 1e-5.
    assert_adamw_parity(run, reference_adamw_8l)


@pytest.mark.parametrize("stage", [1, 3])
def test_pp2_x_dp2_with_zero_matches_one_process(reference_adamw, stage):
    plugins = lambda: [PipelineParallel(2, "1f1b", microbatches=2), ZeRO(stage=stage, bucket_mb=0.1)]  # noqa: E731
    run = run_tiny_llama(ADAMW, plugins, 4, dp=2, steps=3)
    assert_adamw_parity(run, reference_adamw)


def test_pp2_x_tp2_matches_one_process(reference_adamw):
    plugins = lambda: [PipelineParallel(2, "interleaved_1f1b", microbatches=2), TensorParallel(2)]  # noqa: E731
    run = run_tiny_llama(ADAMW, plugins, 4, dp=1, steps=3)
    assert_adamw_parity(run, reference_adamw)


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD, steps=3)


@pytest.mark.parametrize(
    ("name", "plugins", "world_size", "dp", "accumulate"),
    [
        ("zero0", lambda: [PipelineParallel(2, "afab", 2), ZeRO(stage=0, bucket_mb=0.1)], 4, 2, 1),
        ("zero2-zbv", lambda: [PipelineParallel(2, "zbv", 4), ZeRO(stage=2, bucket_mb=0.1)], 4, 2, 1),
        ("zero3-zero-bubble", lambda: [PipelineParallel(2, "zero_bubble", 2), ZeRO(stage=3)], 4, 2, 1),
        ("accumulation", lambda: [PipelineParallel(2, "1f1b", 2)], 2, 1, 2),
        ("zero1-accumulation", lambda: [PipelineParallel(2, "1f1b", 2), ZeRO(stage=1, bucket_mb=0.1)], 4, 2, 2),
        ("recompute", lambda: [PipelineParallel(2, "zero_bubble", 2), Recompute("full")], 2, 1, 1),
        ("tp-no-sp", lambda: [PipelineParallel(2, "1f1b", 2), TensorParallel(2, sequence_parallel=False)], 4, 1, 1),
    ],
)
def test_pipeline_compositions_match_one_process_with_sgd(reference_sgd, name, plugins, world_size, dp, accumulate):
    run = run_tiny_llama(SGD, plugins, world_size, dp=dp, accumulate=accumulate, steps=3)
    assert_parity(run, reference_sgd, rtol=1e-5)


def test_gradient_clipping_sums_the_norm_over_stages():
    ref = run_tiny_llama(SGD, steps=3, gradient_clip_val=0.5)
    run = run_tiny_llama(SGD, lambda: [PipelineParallel(2, "1f1b", 2)], 2, dp=1, steps=3, gradient_clip_val=0.5)
    assert_parity(run, ref, rtol=1e-5)


@pytest.fixture(scope="module")
def reference_sgd_tied():
    return run_tiny_llama(SGD, steps=3, model=TINY_TIED)


# 1F1B with ZeRO-1 over a tied embedding runs in test_zero.py
# (test_zero12_clipping_counts_a_weight_tied_across_pipeline_stages_once, SGD at 1e-5, copies checked).
@pytest.mark.parametrize(("schedule", "stage"), [("1f1b", None), ("zbv", None), ("1f1b", 3), ("zbv", 3)])
def test_tied_embeddings_stay_tied_across_stages(reference_sgd_tied, schedule, stage):
    # 1F1B puts the embedding and the head on different ranks (their gradients are summed);
    # ZBV's V-shape puts both on rank 0 (one parameter, as in one process, shared by two stages).
    def plugins():
        return [PipelineParallel(2, schedule, 4)] + ([ZeRO(stage=stage, bucket_mb=0.1)] if stage else [])

    world_size = 4 if stage else 2
    # (The harness checks that the head's copy on the last stage equals the embedding, bit for bit.)
    run = run_tiny_llama(SGD, plugins, world_size, dp=world_size // 2, steps=3, model=TINY_TIED)
    assert_parity(run, reference_sgd_tied, rtol=1e-5)


def _validation_loss(plugins, world_size):
    def worker():
        L.seed_everything(0, verbose=False)
        strategy = UltraScaleStrategy(*plugins()) if plugins else "auto"
        settings = {**QUIET_TRAINER, "limit_val_batches": 2, "val_check_interval": 2}
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, **settings)
        data = UltraScaleDataModule(seq_len=64, micro_batch_size=8)
        trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data)
        return float(trainer.callback_metrics["val/loss"])

    return run_pooled(worker, world_size)


@pytest.fixture(scope="module")
def validation_reference() -> float:
    return _validation_loss(None, 1)[0]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_validation_runs_a_forward_only_schedule_with_the_same_loss(validation_reference, schedule):
    # Between training steps: ZBV and DualPipeV crashed in torch's eval ("can't steal_bwd_input").
    microbatches = 4 if SCHEDULES[schedule].multi else 2
    losses = _validation_loss(lambda: [PipelineParallel(2, schedule, microbatches)], 2)
    assert losses[0] == losses[1]  # every rank reports it
    assert abs(losses[0] - validation_reference) / validation_reference < 1e-5


# ------------------------------------------------------------------------------------ activation memory
class _SavedActivations(L.Callback):
    """Live bytes of the tensors autograd saves for backward (parameters excluded), and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = self.packed = 0
        self._hooks = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # Per step, above what is already held when it starts: the first step also runs torch's
        # shape-inference forward, whose saved tensors (rank 0: 0.06 of a microbatch) stay alive.
        self.baseline, self.peak, self.packed = self.live, self.live, 0
        params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        callback = self

        class Held:
            def __init__(self, t):
                self.t, self.n = t, t.numel() * t.element_size()
                callback.live += self.n
                callback.packed += self.n
                callback.peak = max(callback.peak, callback.live)

            def __del__(self):
                callback.live -= self.n

        def pack(t):
            return t if t.untyped_storage().data_ptr() in params else Held(t)

        def unpack(x):
            return x.t if isinstance(x, Held) else x

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()

    def on_train_batch_end(self, trainer, *args):
        self._hooks.__exit__(None, None, None)


def _peak_microbatches(schedule: str, pp: int, microbatches: int) -> list[float]:
    def worker():
        L.seed_everything(0, verbose=False)
        meter = _SavedActivations()
        strategy = UltraScaleStrategy(PipelineParallel(pp, schedule, microbatches))
        settings = {**QUIET_TRAINER, "max_steps": 2, "callbacks": [meter]}
        trainer = L.Trainer(accelerator="cpu", devices=pp, strategy=strategy, **settings)
        data = UltraScaleDataModule(seq_len=64, micro_batch_size=microbatches)
        trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data)
        # Every microbatch saves the same bytes on a given rank: express the peak in microbatches.
        return (meter.peak - meter.baseline) / (meter.packed / microbatches)

    return run_pooled(worker, pp)


def test_1f1b_holds_at_most_pp_microbatches_and_afab_holds_all():
    pp, m = 4, 8
    afab = _peak_microbatches("afab", pp, m)
    one_f_one_b = _peak_microbatches("1f1b", pp, m)
    assert [round(x, 6) for x in afab] == [m] * pp
    # Rank r has pp - r microbatches in flight in 1F1B's steady state.
    assert [round(x, 6) for x in one_f_one_b] == [pp - r for r in range(pp)]
