"""Mid-epoch resume through a real Lightning checkpoint: the resumed run sees the batches it would have."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ultrascale.data import UltraScaleDataModule
from lightning_ultrascale.data.prepare import main as tokenize_main

pytestmark = pytest.mark.filterwarnings(
    "ignore:The dirpath has changed",  # the resumed run writes its checkpoints elsewhere, on purpose
    "ignore:You passed in a `val_dataloader` but have no `validation_step`",
)

STEPS_PER_EPOCH = 6  # 25 sequences of 16 tokens, micro batch 4 -> 6 steps, one sequence dropped
MAX_STEPS = 15


class _Recorder(L.LightningModule):
    """A model too small to matter that remembers every batch it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(258, 4)
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"].clone())
        loss = self.embed(batch["input_ids"]).float().pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    text = root / "text.txt"
    text.write_text("".join(chr(ord("a") + (i * 7) % 26) for i in range(25 * 16 - 1)), encoding="utf-8")
    tokenize_main([str(text), str(root / "tokens.bin")])
    return root / "tokens.bin"


@pytest.fixture(scope="module")
def small_token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 sequences of 16 tokens of upper-case letters: blended at equal weight, it wraps twice an epoch."""
    root = tmp_path_factory.mktemp("resume_small")
    text = root / "small.txt"
    text.write_text("".join(chr(ord("A") + (i * 5) % 26) for i in range(7 * 16)), encoding="utf-8")
    tokenize_main([str(text), str(root / "small.bin")])
    return root / "small.bin"


def _fit(
    token_file: Path, root: Path, num_workers: int, ckpt_path: Path | None = None, blend_with: Path | None = None
) -> _Recorder:
    sources = None if blend_with is None else [{"path": str(token_file)}, {"path": str(blend_with)}]
    dm = UltraScaleDataModule(
        None if sources else str(token_file),
        sources=sources,
        seq_len=16,
        micro_batch_size=4,
        val_fraction=0.0,
        num_workers=num_workers,
    )
    model = _Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=MAX_STEPS,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize(
    ("resume_step", "num_workers"),
    [
        (STEPS_PER_EPOCH + 2, 0),  # mid-epoch, in the second epoch
        (STEPS_PER_EPOCH, 0),  # on the last batch of an epoch
        (3, 2),  # mid-epoch with worker processes reading ahead of the model
    ],
)
def test_resumed_fit_trains_on_the_batches_of_the_uninterrupted_run(
    token_file: Path, tmp_path: Path, resume_step: int, num_workers: int
) -> None:
    full = _fit(token_file, tmp_path / "full", num_workers).seen
    assert len(full) == MAX_STEPS
    assert not torch.equal(full[0], full[STEPS_PER_EPOCH])  # epochs are shuffled differently

    resumed = _fit(
        token_file,
        tmp_path / "resumed",
        num_workers,
        ckpt_path=tmp_path / "full" / f"step={resume_step}.ckpt",
    ).seen
    assert len(resumed) == MAX_STEPS - resume_step
    for step, (got, want) in enumerate(zip(resumed, full[resume_step:], strict=True), start=resume_step):
        assert torch.equal(got, want), f"step {step} trained on other samples after resuming"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_blend_reads_the_batches_of_the_uninterrupted_run(
    token_file: Path, small_token_file: Path, tmp_path: Path, num_workers: int
) -> None:
    """Mid-epoch in the second epoch, where both sources are past a pass boundary of their own."""
    full_run = _fit(token_file, tmp_path / "full", num_workers, blend_with=small_token_file)
    full = full_run.seen
    blend_steps = (25 + 7) // 4  # 25 + 7 sequences a blend epoch, micro batch 4
    assert len(full) == MAX_STEPS
    small = (torch.cat(full) < ord("a")).any(dim=1)  # upper-case letters come from the small file
    assert small.tolist() == [False, True] * (2 * MAX_STEPS)  # equal weights: every other sequence
    resume_step = blend_steps + 3
    resumed_run = _fit(
        token_file,
        tmp_path / "resumed",
        num_workers,
        ckpt_path=tmp_path / "full" / f"step={resume_step}.ckpt",
        blend_with=small_token_file,
    )
    resumed = resumed_run.seen
    assert len(resumed) == MAX_STEPS - resume_step
    for step, (got, want) in enumerate(zip(resumed, full[resume_step:], strict=True), start=resume_step):
        assert torch.equal(got, want), f"step {step} trained on other samples after resuming the blend"
    # The weights come back too (SGD, no optimizer state): the losses are the same floats.
    assert resumed_run.losses == full_run.losses[resume_step:]
