"""Sharded (DCP) checkpoints of every ZeRO stage, with and without TP, resume exactly where training stopped."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from llama_runs import ADAMW, SaveCheckpoint

from lightning_ultrascale import (
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import WorkerError, run_pooled, run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, relative_error


def _interrupted_vs_uninterrupted(
    stage: int, replicate: int, tp: int, world_size: int, path: str, pp: int = 1, schedule: str = "1f1b"
) -> float:
    def fit(callbacks=(), ckpt_path=None):
        L.seed_everything(0, verbose=False)
        plugins = [ZeRO(stage=stage, replicate=replicate, bucket_mb=0.1)] + ([TensorParallel(tp)] if tp > 1 else [])
        plugins += [PipelineParallel(pp, schedule)] if pp > 1 else []
        strategy = UltraScaleStrategy(*plugins)
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, callbacks=list(callbacks),
            **QUIET_TRAINER,
        )  # fmt: skip
        module = LlamaModule("llama_tiny", optim=ADAMW)
        data = UltraScaleDataModule(seq_len=64, micro_batch_size=8 * tp * pp // world_size)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.named_parameters()}

    # Saved after 2 steps (AdamW states of two updates), 2 more resumed: the second reads what the first stepped.
    uninterrupted = fit([SaveCheckpoint(path, step=2)])
    resumed = fit(ckpt_path=path)  # a fresh model and optimizer, restored at step 2
    return max(relative_error(resumed[n], uninterrupted[n]) for n in uninterrupted)


@pytest.mark.parametrize(
    ("stage", "replicate", "tp", "world_size"),
    [
        (0, 1, 1, 2),
        (1, 1, 1, 2),
        (2, 1, 1, 2),
        (3, 1, 1, 2),
        (3, 2, 1, 4),
        (0, 1, 2, 2),
        (3, 1, 2, 4),
        # ZeRO-2 saves what ZeRO-1 does (the same sharded optimizer's state; gradients are not
        # saved): its resume is (2, 1, 1, 2); dp2 x tp2 runs stage 1.
        (1, 1, 2, 4),
    ],
)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path, stage, replicate, tp, world_size):
    # Weights, AdamW states, LR schedule and data position all restored: bit-identical here.
    args = (stage, replicate, tp, world_size, str(tmp_path / "ckpt"))
    error = run_pooled(_interrupted_vs_uninterrupted, world_size, *args)
    assert error[0] == 0.0, f"resumed parameters differ by {error[0]:.2e}"


@pytest.mark.parametrize(
    ("stage", "world_size", "schedule"), [(0, 2, "interleaved_1f1b"), (1, 4, "1f1b"), (3, 4, "zbv")]
)
def test_pipelined_run_resumes_exactly(tmp_path, stage, world_size, schedule):
    # Each stage saves and restores its own parameters and optimizer states (flattened, keyed by
    # parameter); ZeRO-1/2 shards under a key per stage.
    args = (stage, 1, 1, world_size, str(tmp_path / "ckpt"), 2, schedule)
    errors = run_pooled(_interrupted_vs_uninterrupted, world_size, *args)
    assert max(errors) == 0.0, f"resumed parameters differ by up to {max(errors):.2e}"


# --------------------------------------------------------------------------- crash-safe and async saves
class _DiesWhilePublishing(UltraScaleStrategy):
    """Rank 1 dies after writing its shard of step 3's checkpoint, before it is published."""

    def _publish(self, meta, partial, path):
        if self.global_rank == 1 and self.lightning_module.trainer.global_step == 3:
            os._exit(3)
        super()._publish(meta, partial, path)


def _fit_saving(path: str, max_steps: int, strategy_cls=UltraScaleStrategy, ckpt_path=None, **strategy_kwargs):
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy_cls(ZeRO(stage=1, bucket_mb=0.1), **strategy_kwargs),
        max_steps=max_steps, callbacks=[SaveCheckpoint(path), recorder], **QUIET_TRAINER,
        default_root_dir=os.path.dirname(path),  # where rank 0 writes collective-hang.json when rank 1 dies
    )  # fmt: skip
    trainer.fit(
        LlamaModule("llama_tiny", optim=ADAMW), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4),
        ckpt_path=ckpt_path,
    )  # fmt: skip
    return recorder.record


@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory) -> tuple[Path, RunRecord]:
    """4 steps saving after each (synchronously): where the checkpoint is, and what the run did."""
    path = tmp_path_factory.mktemp("synchronous") / "sync"
    return path, run_pooled(_fit_saving, 2, str(path), 4)[0]


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, synchronous_run):
    last = str(tmp_path / "last.ckpt")
    with pytest.raises(WorkerError, match=r"rank 1 died without reporting \(exit code 3\)"):
        run_workers(_fit_saving, 2, last, 4, _DiesWhilePublishing)  # (fresh: a rank dies)
    assert (tmp_path / "last.ckpt.partial").is_dir()  # step 3's, never published
    resumed = run_pooled(_fit_saving, 2, last, 4, UltraScaleStrategy, last)[0]
    uninterrupted = synchronous_run[1]
    assert len(resumed.losses) == 2  # steps 3 and 4: resumed from step 2's checkpoint
    assert resumed.losses == uninterrupted.losses[2:]
    for name, value in uninterrupted.params.items():
        assert torch.equal(resumed.params[name], value), name


def test_an_asynchronous_save_writes_what_a_synchronous_one_does(tmp_path, synchronous_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sync_path, sync = synchronous_run
    async_ = run_pooled(_fit_saving, 2, str(tmp_path / "async"), 4, async_checkpoint=True)[0]
    assert async_.losses == sync.losses
    saved = {}
    for name, path in (("sync", sync_path), ("async", tmp_path / "async")):
        dcp_to_torch_save(path, tmp_path / f"{name}.pt")
        saved[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    assert not (tmp_path / "async.partial").exists()  # published when fitting ended
    flat_sync, flat_async = _flat(saved["sync"]), _flat(saved["async"])
    assert flat_sync.keys() == flat_async.keys() and len(flat_sync) > 100
    for key, value in flat_sync.items():
        assert torch.equal(flat_async[key], value) if isinstance(value, torch.Tensor) else flat_async[key] == value, key


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}
