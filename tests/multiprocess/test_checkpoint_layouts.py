"""Any layout loads any other's checkpoint: save after 2 AdamW steps, resume elsewhere, train 2 more.

Also under another gradient accumulation, micro batch or dp size: the resumed run trains on the
global batches and steps of an uninterrupted run in its own layout.

Ten layouts cover every way a rank can hold a parameter and its optimizer state: a replica (one
process), a sharded optimizer's flat range (ZeRO-1 with small buckets, ZeRO-2 with one bucket: a
different bucket plan), an FSDP2 shard (ZeRO-3, HSDP), a tensor-parallel shard, a pipeline stage
(1F1B, and interleaved with two stages per rank), a context-parallel replica, and FSDP over TP.
42 of the 90 pairs are run (each layout saved from and loaded into at least twice, every family
into every other family): losses after the resume equal the uninterrupted one-process run within
1e-5 and parameters within the AdamW bound.
"""

from pathlib import Path

import lightning as L
import pytest
from llama_runs import ADAMW, ADAMW_RTOL, GLOBAL_BATCH, SEQ_LEN, SaveCheckpoint, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    DataParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.core.checkpoint import ACCUMULATION_KEY, rebase_accumulation
from lightning_ultrascale.data.sampler import DataParallelSampler
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity

#: A run's steps (the LR schedule spans them all), and the step after which it saves. Two resumed
#: steps: the second starts from what the restored optimizer stepped.
STEPS, SAVED_AT = 4, 2

#: name -> (world size, plugins, data-parallel size)
LAYOUTS = {
    "one": (1, lambda: [], 1),
    "zero1-dp2": (2, lambda: [ZeRO(1, bucket_mb=0.1)], 2),
    "zero2-dp2": (2, lambda: [ZeRO(2)], 2),
    "zero3-dp2": (2, lambda: [ZeRO(3)], 2),
    "hsdp-2x2": (4, lambda: [ZeRO(3, replicate=2)], 4),
    "tp2": (2, lambda: [TensorParallel(2)], 1),
    "pp2-1f1b": (2, lambda: [PipelineParallel(2, "1f1b")], 1),
    "pp2-interleaved": (2, lambda: [PipelineParallel(2, "interleaved_1f1b")], 1),
    "cp2": (2, lambda: [ContextParallel(2)], 1),
    "dp2xtp2-zero3": (4, lambda: [TensorParallel(2), ZeRO(3)], 2),
}

#: target -> the sources it loads
PAIRS = {
    "one": ["zero1-dp2", "zero2-dp2", "hsdp-2x2", "tp2", "pp2-1f1b", "cp2", "dp2xtp2-zero3"],
    "zero1-dp2": ["one", "zero3-dp2", "hsdp-2x2", "pp2-1f1b", "dp2xtp2-zero3"],
    "zero2-dp2": ["zero1-dp2", "zero3-dp2", "tp2", "pp2-interleaved"],
    "zero3-dp2": ["one", "zero1-dp2", "pp2-1f1b", "cp2"],
    "hsdp-2x2": ["zero2-dp2", "pp2-interleaved"],
    "tp2": ["zero1-dp2", "zero3-dp2", "pp2-interleaved", "cp2", "dp2xtp2-zero3"],
    "pp2-1f1b": ["zero1-dp2", "zero3-dp2", "pp2-interleaved", "cp2"],
    "pp2-interleaved": ["one", "zero2-dp2", "tp2", "pp2-1f1b", "dp2xtp2-zero3"],
    "cp2": ["zero2-dp2", "hsdp-2x2", "pp2-1f1b"],
    "dp2xtp2-zero3": ["one", "hsdp-2x2", "tp2"],
}


def _fit(layout: str, max_steps: int, ckpt_path: str | None = None, save_to: str | None = None) -> RunRecord:
    world_size, plugins, dp = LAYOUTS[layout]
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    # Saved at step SAVED_AT of a STEPS-step run, which then stops: the LR schedule spans max_steps.
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=SAVED_AT, stop=True)] if save_to else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=max_steps,
        callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


def _resume_each(target: str, sources: list[str], root: str) -> dict[str, RunRecord]:
    return {source: _fit(target, STEPS, ckpt_path=str(Path(root) / source)) for source in sources}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("layouts")
    for layout, (world_size, _, _) in LAYOUTS.items():
        run_pooled(_fit, world_size, layout, STEPS, None, str(root / layout), timeout_s=300)
    return str(root)


@pytest.fixture(scope="module")
def uninterrupted() -> RunRecord:
    return run_tiny_llama(ADAMW, steps=STEPS)


@pytest.mark.parametrize("target", list(PAIRS))
def test_a_checkpoint_of_any_layout_resumes_in_another(checkpoints, uninterrupted, target):
    world_size = LAYOUTS[target][0]
    runs = run_pooled(_resume_each, world_size, target, PAIRS[target], checkpoints, timeout_s=600)[0]
    # The reference's steps after SAVED_AT: the resumed runs record only what they trained.
    reference = RunRecord(uninterrupted.losses[SAVED_AT:], uninterrupted.grads[SAVED_AT:], uninterrupted.params)
    for source, run in runs.items():
        try:  # every gradient here is a later AdamW step's
            assert_parity(run, reference, rtol=1e-5, grad_rtol=ADAMW_RTOL, param_rtol=ADAMW_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{source} -> {target}: {err}") from None


# ------------------------------------------------------------------------------------ accumulation
#: name -> (world size, plugins, micro batch size, gradient accumulation); global batch = micro x dp x accumulation
ACCUMULATION_LAYOUTS = {
    "zero1-dp2": (2, lambda: [ZeRO(1)], 4, 1),
    "pp2-acc2": (2, lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 4, 2),
    "tp2-acc2": (2, lambda: [TensorParallel(2)], 4, 2),
    "dp2": (2, lambda: [DataParallel()], 4, 1),
    "dp2-mb8": (2, lambda: [DataParallel()], 8, 1),  # a global batch of 16
    "dp1-mb4-acc4": (1, lambda: [], 4, 4),
}
#: (saved in, resumed in)
ACCUMULATION_PAIRS = [
    ("zero1-dp2", "pp2-acc2"),
    ("pp2-acc2", "zero1-dp2"),
    ("dp2-mb8", "dp1-mb4-acc4"),
    ("tp2-acc2", "dp2"),
]


def _fit_accumulating(layout: str, ckpt_path: str | None = None, save_to: str | None = None) -> RunRecord:
    world_size, plugins, micro_batch_size, accumulate = ACCUMULATION_LAYOUTS[layout]
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=SAVED_AT, stop=True)] if save_to else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=STEPS,
        accumulate_grad_batches=accumulate, callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=micro_batch_size, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


@pytest.mark.parametrize(("source", "target"), ACCUMULATION_PAIRS, ids=[f"{a}->{b}" for a, b in ACCUMULATION_PAIRS])
def test_a_resume_under_another_accumulation_trains_the_uninterrupted_steps(tmp_path, source, target):
    # Before: the restored micro-batch count was the saving layout's, so zero1-dp2 -> pp2-acc2 stepped
    # after one micro-batch and then on halves of two global batches (losses 1e-2 off).
    run_pooled(_fit_accumulating, ACCUMULATION_LAYOUTS[source][0], source, None, str(tmp_path / "ckpt"))
    world_size = ACCUMULATION_LAYOUTS[target][0]
    uninterrupted = run_pooled(_fit_accumulating, world_size, target)[0]
    resumed = run_pooled(_fit_accumulating, world_size, target, str(tmp_path / "ckpt"))[0]
    reference = RunRecord(uninterrupted.losses[SAVED_AT:], uninterrupted.grads[SAVED_AT:], uninterrupted.params)
    assert_parity(resumed, reference, rtol=1e-5, grad_rtol=ADAMW_RTOL, param_rtol=ADAMW_RTOL)


def _mid_epoch_checkpoint(micro_batches: int, accumulate: int) -> dict:
    counters = {"ready": micro_batches, "started": micro_batches, "processed": micro_batches, "completed": 0}
    progress = {"current": dict(counters), "total": {**counters, "ready": micro_batches + 10}, "is_last_batch": False}
    return {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}, ACCUMULATION_KEY: accumulate}


def test_the_saved_micro_batch_count_becomes_this_runs_and_a_partial_step_is_refused():
    checkpoint = _mid_epoch_checkpoint(6, accumulate=2)  # 3 steps of 2 micro-batches
    rebase_accumulation(checkpoint, 1)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    # 3 steps of 1: the epoch's end is 3 micro-batches later, not 6 (which would skip 3 batches)
    assert progress["current"] == {"ready": 3, "started": 3, "processed": 3, "completed": -3}
    assert progress["total"]["ready"] == 13
    with pytest.raises(ConfigError, match=r"after micro-batch 5 of its epoch, inside a gradient accumulation of 2"):
        rebase_accumulation(_mid_epoch_checkpoint(5, accumulate=2), 2)


def test_a_data_position_between_micro_steps_is_refused():
    sampler = DataParallelSampler(range(64), micro_batch_size=8, num_replicas=2)
    with pytest.raises(ConfigError, match=r"12 samples into epoch 0, is not a whole number .* = 16 samples"):
        sampler.load_state_dict({"epoch": 0, "consumed_samples": 12})
