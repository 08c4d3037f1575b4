"""Data parallelism (ZeRO stage 0): parity with one process, overlap, no_sync, comm volume."""

import pytest
import torch
import torch.distributed as dist
from llama_runs import ADAMW, SGD, assert_adamw_parity, run_tiny_llama
from torch import nn

from lightning_ultrascale.parallel.data import DataParallel
from lightning_ultrascale.parallel.data.buckets import BucketedAllReduce
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import assert_parity


def _run(optim, world_size=1, accumulate=1):
    # Small buckets: several reductions per backward, so ordering and overlap are exercised.
    plugins = (lambda: [DataParallel(bucket_mb=0.1)]) if world_size > 1 else None
    return run_tiny_llama(optim, plugins, world_size, accumulate)


@pytest.fixture(scope="module")
def reference_sgd():
    return _run(SGD)


@pytest.fixture(scope="module")
def reference_adamw():
    return _run(ADAMW)


# The world size sets who reduces, accumulation when: they do not interact. dp4 with accumulation
# runs with AdamW below (losses and first-step gradients at 1e-5).
@pytest.mark.parametrize(("world_size", "accumulate"), [(2, 1), (2, 2), (4, 1)])
def test_dp_matches_one_process_with_sgd(reference_sgd, world_size, accumulate):
    assert_parity(_run(SGD, world_size, accumulate), reference_sgd, rtol=1e-5)


@pytest.mark.parametrize(("world_size", "accumulate"), [(2, 2), (4, 2)])
def test_dp_matches_one_process_with_adamw(reference_adamw, world_size, accumulate):
    run = _run(ADAMW, world_size, accumulate)
    assert_adamw_parity(run, reference_adamw)


def _toy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])


def _overlap_worker():
    model = _toy_model()
    # ~2 layers per bucket: 3 buckets.
    reducer = BucketedAllReduce(list(model.parameters()), dist.group.WORLD, bucket_bytes=2 * 33 * 32 * 4)
    events = []
    model[0].register_full_backward_hook(lambda *a: events.append(("first_layer_backward", len(reducer.launch_log))))
    x = torch.randn(4, 32) * (dist.get_rank() + 1)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return len(reducer.buckets), reducer.launch_log, events, grads


def test_bucket_reductions_start_before_backward_finishes():
    results = run_pooled(_overlap_worker, 2)
    n_buckets, launch_log, events, _ = results[0]
    assert n_buckets == 3
    assert [i for i, _ in launch_log] == [0, 1, 2], "buckets must launch in index order on every rank"
    # When the first layer's backward ran, the buckets of the last layers were already in flight.
    assert events == [("first_layer_backward", 2)]
    assert [during for _, during in launch_log] == [True, True, True]


def test_reduced_gradients_are_the_mean_over_ranks():
    results = run_pooled(_overlap_worker, 2)
    per_rank = []
    for rank in range(2):
        model = _toy_model()  # same seed and RNG draws as the worker of this rank
        model(torch.randn(4, 32) * (rank + 1)).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    for got0, got1, g0, g1 in zip(results[0][3], results[1][3], *per_rank):
        torch.testing.assert_close(got0, (g0 + g1) / 2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got1, got0, rtol=0, atol=0)


def _no_sync_worker():
    model = _toy_model()
    reducer = BucketedAllReduce(list(model.parameters()), dist.group.WORLD, bucket_bytes=10**9)
    calls = []
    original = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        rank_input = [torch.full((2, 32), float(dist.get_rank() + 1 + k)) for k in range(2)]
        with reducer.no_sync():
            model(rank_input[0]).sum().backward()
        after_no_sync = len(calls)
        model(rank_input[1]).sum().backward()
    finally:
        dist.all_reduce = original
    return after_no_sync, len(calls), [p.grad.clone() for p in model.parameters()]


def test_no_sync_accumulates_locally_and_reduces_the_sum_once():
    r0, _ = run_pooled(_no_sync_worker, 2)
    assert r0[0] == 0, "no reduction may happen inside no_sync"
    assert r0[1] == 1, "one bucket, one all-reduce on the synced micro-step"
    # Single-process reference: the mean over ranks of (grad of micro-step 1 + micro-step 2).
    model = _toy_model()
    for rank in range(2):
        for k in range(2):
            model(torch.full((2, 32), float(rank + 1 + k))).sum().backward()
    for p, got in zip(model.parameters(), r0[2]):
        torch.testing.assert_close(got, p.grad / 2, rtol=1e-6, atol=1e-6)


def _fit_twice_with_one_trainer(tp: int, stage: int = 0) -> None:
    import lightning as L

    from lightning_ultrascale import LlamaModule, TensorParallel, UltraScaleDataModule, UltraScaleStrategy, ZeRO
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    strategy = UltraScaleStrategy(ZeRO(stage=stage), *([TensorParallel(tp)] if tp > 1 else []))
    world = 2 * tp
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, **QUIET_TRAINER)
    module = LlamaModule("llama_tiny")
    data = UltraScaleDataModule(seq_len=32, micro_batch_size=2)
    trainer.fit(module, datamodule=data)
    trainer.fit_loop.epoch_loop.max_steps = 2  # one step more: unsynchronised, the replicas would part
    trainer.fit(module, datamodule=data)  # setup runs again: the engine binds again
    # dp replicas stayed identical through the second fit: gradients were still averaged.
    for p in module.parameters():
        local = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        mean = local.clone()
        dist.all_reduce(mean, group=strategy.mesh["dp"].get_group())
        torch.testing.assert_close(mean / 2, local, rtol=0, atol=1e-7)

    with pytest.raises(RuntimeError, match="already parallelised by another UltraScaleStrategy"):
        other = L.Trainer(accelerator="cpu", devices=world, strategy=UltraScaleStrategy(), max_steps=1, **QUIET_TRAINER)
        other.fit(module, datamodule=data)


def test_a_second_fit_keeps_gradients_synchronised_and_a_second_strategy_is_refused():
    run_pooled(_fit_twice_with_one_trainer, 2, 1)


def _finished_runs_free_their_models() -> None:
    import gc
    import weakref

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy, ZeRO
    from lightning_ultrascale.models.spec import find_model
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    precision = MixedPrecision("bf16-mixed", "cpu")  # kept across runs, as a sweep keeps its config objects

    def fit(stage: int, module: LlamaModule) -> L.Trainer:
        strategy = UltraScaleStrategy(ZeRO(stage=stage))
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, plugins=[precision], max_steps=1, **QUIET_TRAINER
        )
        # (a datamodule keeps its last Trainer: Lightning's, so each run gets its own)
        trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=32, micro_batch_size=2))
        return trainer

    for stage in (0, 3):
        module = LlamaModule("llama_tiny")
        trainer = fit(stage, module)
        alive = [weakref.ref(find_model(module)[0]), weakref.ref(trainer.optimizers[0]), weakref.ref(trainer.strategy)]
        del module, trainer
        gc.collect()
        # Before: the strategy registry held each strategy strongly (and so its model), and the precision
        # plugin held the clipping closures: every model fitted in a process stayed in memory.
        assert [ref() is None for ref in alive] == [True, True, True], stage
    kept = LlamaModule("llama_tiny")
    fit(0, kept)  # the Trainer and strategy are gone; the model is still sharded and hooked for them
    gc.collect()
    with pytest.raises(RuntimeError, match="already parallelised by another UltraScaleStrategy"):
        fit(0, kept)


def test_a_finished_run_frees_its_model_and_its_model_still_refuses_another_strategy():
    run_pooled(_finished_runs_free_their_models, 2)


# Stages 0 and 1: their engines hook the parameters (stage 3's FSDP2 shards differ by design).
@pytest.mark.parametrize("stage", [0, 1])
def test_a_second_fit_with_tensor_parallel_keeps_gradients_synchronised(stage):
    # Lightning's .to(device) at the second setup swaps the DTensor parameters' tensors; the
    # data-parallel hooks bound after it must still fire (buckets.GradientBuckets).
    run_pooled(_fit_twice_with_one_trainer, 4, 2, stage)
