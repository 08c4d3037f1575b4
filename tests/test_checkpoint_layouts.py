"""Any layout loads any other's checkpoint: save after 3 AdamW steps, resume elsewhere, train 3 more.

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
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity

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
    # Saved at step 3 of a 6-step run, which then stops: the LR schedule spans max_steps.
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=3, stop=True)] if save_to else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=max_steps,
        callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


def _resume_each(target: str, sources: list[str], root: str) -> dict[str, RunRecord]:
    return {source: _fit(target, 6, ckpt_path=str(Path(root) / source)) for source in sources}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("layouts")
    for layout, (world_size, _, _) in LAYOUTS.items():
        run_workers(_fit, world_size, layout, 6, None, str(root / layout), timeout_s=300)
    return str(root)


@pytest.fixture(scope="module")
def uninterrupted() -> RunRecord:
    return run_tiny_llama(ADAMW, steps=6)


@pytest.mark.parametrize("target", list(PAIRS))
def test_a_checkpoint_of_any_layout_resumes_in_another(checkpoints, uninterrupted, target):
    world_size = LAYOUTS[target][0]
    runs = run_workers(_resume_each, world_size, target, PAIRS[target], checkpoints, timeout_s=600)[0]
    # The reference's steps 4-6: the resumed runs record only what they trained.
    reference = RunRecord(uninterrupted.losses[3:], uninterrupted.grads[3:], uninterrupted.params)
    for source, run in runs.items():
        try:  # every gradient here is a later AdamW step's
            assert_parity(run, reference, rtol=1e-5, grad_rtol=ADAMW_RTOL, param_rtol=ADAMW_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{source} -> {target}: {err}") from None
