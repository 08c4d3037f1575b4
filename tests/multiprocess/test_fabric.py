"""Lightning Fabric: the plugins in a loop one writes train like one process; checkpoints go both ways with the Trainer.

The reference is plain torch on one process (``build_model`` + SGD), not Lightning: the Fabric
runs share none of its code. Data is the Trainer's (``UltraScaleDataModule``'s sequences through a
``DataParallelSampler``), so a Fabric run and a Trainer run see the same global batches.
"""

import lightning as L
import pytest
import torch
from llama_runs import GLOBAL_BATCH, SEQ_LEN, SGD
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    FP8Precision,
    LlamaModule,
    Muon,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    ZeRO,
    muon_param_groups,
)
from lightning_ultrascale import UltraScaleStrategy as TrainerStrategy
from lightning_ultrascale.core.fabric import FabricStrategy as UltraScaleStrategy
from lightning_ultrascale.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity

LAYOUTS = {
    "zero3-dp2": lambda: [ZeRO(stage=3)],
    "tp2-sp": lambda: [TensorParallel(2)],
    "zero1-dp2": lambda: [ZeRO(stage=1, bucket_mb=0.1)],
    "cp2": lambda: [ContextParallel(2)],
    "ep2-zero3": lambda: [ExpertParallel(2), ZeRO(stage=3)],
}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _loader(micro_batch_size: int, num_replicas: int = 1, rank: int = 0) -> ResumableDataLoader:
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=micro_batch_size, seed=0)
    data.setup("fit")
    sampler = DataParallelSampler(data.train_dataset, micro_batch_size, num_replicas, rank, seed=0)
    return ResumableDataLoader(data.train_dataset, sampler)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """LlamaModule's parameter groups (weight decay 0 in SGD's settings), so a Trainer run loads its state."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.SGD([{"params": matrices}, {"params": vectors}], lr=SGD.lr)


def _muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    return Muon(muon_param_groups(model, weight_decay=0.1), lr=3e-3)


OPTIMIZERS = {"sgd": _sgd, "muon": _muon}


def _reference(
    steps: int,
    accumulate: int = 1,
    max_norm: float | None = None,
    clip_val: float | None = None,
    fp8: str | None = None,
    model_name: str = "llama_tiny",
    optimizer_name: str = "sgd",
) -> RunRecord:
    model = build_model(model_name, seed=0)
    if fp8 is not None:  # the same quantisation, on one process
        FP8Precision(fp8, "32-true").swap.convert(model, tp=1)
    optimizer = OPTIMIZERS[optimizer_name](model)
    record, batches = RunRecord(), iter(_loader(GLOBAL_BATCH // accumulate))
    for _ in range(steps):
        total = 0.0
        for _ in range(accumulate):
            batch = next(batches)
            loss = model(batch["input_ids"], labels=batch["labels"]) / accumulate
            loss.backward()
            total += loss.item()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
        optimizer.step()
        optimizer.zero_grad()
        record.losses.append(total)
    record.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def _fabric_fit(
    layout: str,
    steps: int,
    *,
    meta: bool = True,
    accumulate: int = 1,
    max_norm: float | None = None,
    clip_val: float | None = None,
    fp8: str | None = None,
    model_name: str = "llama_tiny",
    save_at: int | None = None,
    path: str | None = None,
    load: str | None = None,
    optimizer_name: str = "sgd",
) -> RunRecord:
    """A Fabric loop on 2 processes: ``steps`` SGD steps (counted from a loaded checkpoint's), recorded."""
    precision = [FP8Precision(fp8, "32-true")] if fp8 is not None else []
    strategy = UltraScaleStrategy(*LAYOUTS[layout]())
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2, plugins=precision)
    fabric.launch()
    if meta:  # each rank allocates its shards only, initialised by name (UltraScaleStrategy(seed=0))
        with fabric.init_module(empty_init=True):
            model = Llama(get_model_config(model_name))
    else:
        model = build_model(model_name, seed=0)
    model, optimizer = fabric.setup(model, OPTIMIZERS[optimizer_name](model))
    scheduler = LambdaLR(optimizer, lambda step: 1.0)  # LlamaModule's schedule under SGD's settings
    dp = fabric.strategy.distributed_sampler_kwargs
    loader = fabric.setup_dataloaders(_loader(GLOBAL_BATCH // (dp["num_replicas"] * accumulate), **dp))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}
    if load is not None:
        fabric.load(load, state)
    record, batches = RunRecord(), iter(loader)
    while fabric.strategy.global_step < steps:
        total = torch.zeros(())
        for micro in range(accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                # (under context parallelism the positions of this rank's tokens: the batch is its part)
                loss = model(batch["input_ids"], batch.get("position_ids"), labels=batch["labels"]) / accumulate
                fabric.backward(loss)
            total += _whole(loss)
        if max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        if clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=clip_val)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record.losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
        if fabric.strategy.global_step == save_at:
            fabric.save(path, state)
    if max_norm is not None:
        with pytest.raises(ConfigError, match=r"norm_type=1\.0\).*valid: 2\.0"):
            fabric.clip_gradients(model, optimizer, max_norm=max_norm, norm_type=1.0)
    record.params = {n: _whole(p) for n, p in model.module.named_parameters()}
    return record


@pytest.fixture(scope="module")
def reference() -> RunRecord:
    return _reference(steps=3)


@pytest.mark.parametrize("meta", [True, False], ids=["meta", "whole"])
@pytest.mark.parametrize("layout", ["zero3-dp2", "tp2-sp", "cp2"])
def test_a_fabric_loop_trains_like_one_process(reference, layout, meta):
    assert_parity(run_pooled(_fabric_fit, 2, layout, 3, meta=meta)[0], reference, rtol=1e-5)


@pytest.mark.parametrize("layout", ["zero1-dp2", "zero3-dp2", "tp2-sp"])
def test_muon_under_fabric_trains_like_plain_torch_muon(layout):
    # fabric.setup points Muon's groups at the new parameters; ZeRO-1 tells it its flat shards.
    # (3 Muon steps: errors measured up to 1.3e-6 in the Trainer's layouts; bound 1e-5 as there)
    reference = _reference(steps=3, optimizer_name="muon")
    assert_parity(run_pooled(_fabric_fit, 2, layout, 3, optimizer_name="muon")[0], reference, rtol=1e-5)


def test_expert_parallelism_under_fabric_trains_like_one_process():
    # moe_tiny's experts split over 2 ranks (all-to-all dispatch), ZeRO-3 over the rest; each rank's
    # micro-batch is routed as one process routes its micro-batches.
    run = run_pooled(_fabric_fit, 2, "ep2-zero3", 3, model_name="moe_tiny")[0]
    assert_parity(run, _reference(steps=3, accumulate=2, model_name="moe_tiny"), rtol=1e-5)


@pytest.mark.parametrize(
    ("layout", "accumulate", "clip"),
    [
        # ZeRO-1 over 2 ranks, 2 micro-steps a step (no_backward_sync), every step clipped by the global norm
        ("zero1-dp2", 2, {"max_norm": 0.5}),
        # every element clipped, the sequence-parallel norm weights' partial-sum gradients too
        ("tp2-sp", 1, {"clip_val": 1e-3}),
    ],
    ids=["zero1-dp2-acc2-max_norm", "tp2-sp-clip_val"],
)
def test_fabric_accumulation_and_clipping_match_one_process(layout, accumulate, clip):
    run = run_pooled(_fabric_fit, 2, layout, 3, accumulate=accumulate, **clip)[0]
    assert_parity(run, _reference(steps=3, accumulate=accumulate, **clip), rtol=1e-5)


def test_fp8_under_fabric_quantises_like_one_process():
    # The Trainer's FP8Precision given to Fabric: the swap applies first, ZeRO-3 all-gathers the
    # tensorwise weights in FP8 (scales refreshed after each step); each rank's micro-batch is
    # quantised as the one-process run's micro-batches are (test_fp8_training.py).
    run = run_pooled(_fabric_fit, 2, "zero3-dp2", 3, fp8="tensorwise")[0]
    assert_parity(run, _reference(steps=3, accumulate=2, fp8="tensorwise"), rtol=1e-5)


def _trainer_fit(steps: int, ckpt_path: str | None = None, save_to: str | None = None) -> RunRecord:
    """The Trainer on 2 processes, ZeRO-3 (another layout than the Fabric runs'), LlamaModule with SGD."""
    from llama_runs import SaveCheckpoint

    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=3)] if save_to else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=TrainerStrategy(ZeRO(stage=3)), max_steps=steps,
        callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // 2, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


def test_checkpoints_go_from_fabric_to_the_trainer_and_back_in_any_layout(tmp_path):
    fabric_ckpt, trainer_ckpt = str(tmp_path / "fabric"), str(tmp_path / "trainer")
    reference = _reference(steps=6)
    uninterrupted = run_pooled(_fabric_fit, 2, "tp2-sp", 6, save_at=3, path=fabric_ckpt)[0]
    assert_parity(uninterrupted, reference, rtol=1e-5)
    continued = RunRecord(reference.losses[3:])
    runs = {
        # a bare model's checkpoint (layers.0...) in a LightningModule (model.layers.0...), at its step and batch
        "fabric tp2 -> trainer zero3": run_pooled(_trainer_fit, 2, 6, fabric_ckpt)[0],
        "fabric tp2 -> fabric zero3": run_pooled(_fabric_fit, 2, "zero3-dp2", 6, load=fabric_ckpt)[0],
    }
    run_pooled(_trainer_fit, 2, 6, save_to=trainer_ckpt)
    runs["trainer zero3 -> fabric tp2"] = run_pooled(_fabric_fit, 2, "tp2-sp", 6, load=trainer_ckpt)[0]
    for name, run in runs.items():
        try:
            assert_parity(RunRecord(run.losses), continued, rtol=1e-5, check_params=False)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _forward_a_batch_of_its_own() -> None:
    fabric = L.Fabric(strategy=UltraScaleStrategy(*LAYOUTS["cp2"]()), accelerator="cpu", devices=2)
    fabric.launch()
    model = fabric.setup(build_model("llama_tiny", seed=0))
    batch = next(iter(_loader(GLOBAL_BATCH)))
    with pytest.raises(ConfigError, match=r"this rank's part before the model sees it.*fabric\.setup_dataloaders"):
        model(batch["input_ids"], labels=batch["labels"])


def test_context_parallelism_refuses_a_batch_that_bypassed_setup_dataloaders():
    # It would train on whole sequences through ring attention: every rank's positions wrong, silently.
    run_pooled(_forward_a_batch_of_its_own, 2)


def test_pipeline_parallelism_under_fabric_is_refused_naming_the_trainer():
    with pytest.raises(ConfigError, match=r"runs forward and backward itself.*lightning\.Trainer\(strategy="):
        UltraScaleStrategy(ZeRO(stage=1), PipelineParallel(2))
    UltraScaleStrategy(PipelineParallel(1))  # size 1: no pipeline, nothing to refuse


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        (lambda: [ZeRO(stage=4)], r"ZeRO\(stage=4\) is not a ZeRO stage; valid: 0, 1, 2, 3"),
        (lambda: [TensorParallel(3)], r"tp=3.*divisors: 1, 2"),
        (lambda: [ContextParallel(2, method="ringz")], r"method='ringz'\) is unknown; valid: ring, zigzag_ring"),
    ],
    ids=["zero-stage", "tp-size", "cp-method"],
)
def test_a_bad_option_names_itself_and_the_valid_values_before_any_process(plugins, message):
    with pytest.raises(ConfigError, match=message):
        L.Fabric(strategy=UltraScaleStrategy(*plugins()), accelerator="cpu", devices=2)
