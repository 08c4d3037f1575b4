"""Sharded (DCP) checkpoints of every ZeRO stage, with and without TP, resume exactly where training stopped."""

import lightning as L
import pytest
from llama_runs import ADAMW

from lightning_ultrascale import (
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, relative_error


class _SaveAtStep(L.Callback):
    """Save mid-training, as ModelCheckpoint(every_n_train_steps=...) does."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _interrupted_vs_uninterrupted(
    stage: int, replicate: int, tp: int, world_size: int, path: str, pp: int = 1, schedule: str = "1f1b"
) -> float:
    def fit(callbacks=(), ckpt_path=None):
        L.seed_everything(0, verbose=False)
        plugins = [ZeRO(stage=stage, replicate=replicate, bucket_mb=0.1)] + ([TensorParallel(tp)] if tp > 1 else [])
        plugins += [PipelineParallel(pp, schedule)] if pp > 1 else []
        strategy = UltraScaleStrategy(*plugins)
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=6, callbacks=list(callbacks),
            **QUIET_TRAINER,
        )  # fmt: skip
        module = LlamaModule("llama_tiny", optim=ADAMW)
        data = UltraScaleDataModule(seq_len=64, micro_batch_size=8 * tp * pp // world_size)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.named_parameters()}

    uninterrupted = fit([_SaveAtStep(3, path)])
    resumed = fit(ckpt_path=path)  # a fresh model and optimizer, restored at step 3
    return max(relative_error(resumed[n], uninterrupted[n]) for n in uninterrupted)


@pytest.mark.parametrize(
    ("stage", "replicate", "tp", "world_size"),
    [(0, 1, 1, 2), (1, 1, 1, 2), (2, 1, 1, 2), (3, 1, 1, 2), (3, 2, 1, 4), (0, 1, 2, 2), (3, 1, 2, 4), (1, 1, 2, 4),
     (2, 1, 2, 4)],
)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path, stage, replicate, tp, world_size):
    # Weights, AdamW states, LR schedule and data position all restored: bit-identical here.
    args = (stage, replicate, tp, world_size, str(tmp_path / "ckpt"))
    error = run_workers(_interrupted_vs_uninterrupted, world_size, *args)
    assert error[0] == 0.0, f"resumed parameters differ by {error[0]:.2e}"


@pytest.mark.parametrize(
    ("stage", "world_size", "schedule"), [(0, 2, "interleaved_1f1b"), (1, 4, "1f1b"), (3, 4, "zbv")]
)
def test_pipelined_run_resumes_exactly(tmp_path, stage, world_size, schedule):
    # Each stage saves and restores its own parameters and optimizer states (flattened, keyed by
    # parameter); ZeRO-1/2 shards under a key per stage.
    args = (stage, 1, 1, world_size, str(tmp_path / "ckpt"), 2, schedule)
    errors = run_workers(_interrupted_vs_uninterrupted, world_size, *args)
    assert max(errors) == 0.0, f"resumed parameters differ by up to {max(errors):.2e}"
