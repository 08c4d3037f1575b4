"""TrainingMetrics logs throughput and memory on CPU, and leaves MFU out where there is no known peak."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from llama_runs import SGD
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ultrascale import LlamaModule, PipelineParallel, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.training.callbacks import TrainingMetrics, UltraScaleProgressBar, peak_tflops

SEQ, VOCAB = 8, 32


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(i, i + SEQ) % VOCAB}


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.head(self.embed(ids[:, :-1]))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


def test_cpu_fit_logs_tokens_per_s_and_tflops_but_no_mfu(tmp_path: Path) -> None:
    model = TinyLM()
    bar = UltraScaleProgressBar()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        callbacks=[TrainingMetrics(window=2), bar],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(Tokens(), batch_size=4))

    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    tokens_per_s = _column(rows, "train/tokens_per_s")
    tflops = _column(rows, "train/tflops_per_device")
    # 5 steps: the first left out as warm-up, then 2 windows of 2 (each value stays until the next)
    assert len(set(tokens_per_s)) == 2 and tokens_per_s[0] == tokens_per_s[1]
    assert all(v > 0 for v in tokens_per_s + tflops)
    flops_per_token = model.flops_per_token(SEQ)
    for t, f in zip(tokens_per_s, tflops):
        assert math.isclose(f * 1e12, flops_per_token * t, rel_tol=1e-5)
    assert "train/mfu" not in rows[0]

    param_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    assert _column(rows, "memory/params_mib") == [pytest.approx(param_mib)]
    assert _column(rows, "memory/optimizer_mib")[0] > 2 * param_mib  # AdamW m and v, plus steps

    shown = bar.get_metrics(trainer, model)
    assert shown["mfu"] == "n/a"
    assert float(str(shown["tok/s"]).replace(",", "")) > 0
    assert "loss" in shown


def test_bar_keeps_a_train_loss_the_module_already_shows(tmp_path: Path) -> None:
    class LoggingLM(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss, prog_bar=True)
            return loss

    model, bar = LoggingLM(), UltraScaleProgressBar()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        callbacks=[bar],
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(Tokens(), batch_size=4))
    shown = bar.get_metrics(trainer, model)
    assert "train/loss" in shown and "loss" not in shown
    assert shown["tok/s"] == "n/a"  # no TrainingMetrics callback


def test_peak_table() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_tflops("NVIDIA L40S") == 362.0
    assert peak_tflops("NVIDIA GB200") == 2500.0
    assert peak_tflops("cpu") is None


def test_unknown_batch_layout_is_refused_with_its_shape() -> None:
    callback = TrainingMetrics()
    with pytest.raises(ValueError, match=r"got \(2, 3, 4\)"):
        callback.on_train_batch_start(None, None, torch.zeros(2, 3, 4), 0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ logged loss
class _Logged(Logger):
    """Every metric the trainer writes, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "logged"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class _MaskedLabels(UltraScaleDataModule):
    """Labels of tokens whose id is a multiple of 3 are ignored: ranks and micro-batches hold unequal counts."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        labels = batch["labels"].clone()
        labels[batch["input_ids"] % 3 == 0] = -100
        return {**batch, "labels": labels}


def _logged_losses(plugins: Any, world_size: int, micro_batch_size: int, accumulate: int, masked: bool):
    def worker() -> tuple[list[tuple[int, float]], list[float], float]:
        L.seed_everything(0, verbose=False)
        logger = _Logged()
        # Validation interval and batches count micro-batches: the same 16 sequences every 2 steps.
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()) if plugins else "auto",
            max_steps=4, accumulate_grad_batches=accumulate, logger=logger, log_every_n_steps=1,
            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
            limit_val_batches=2 * accumulate, val_check_interval=2 * accumulate, num_sanity_val_steps=0,
        )  # fmt: skip
        data = (_MaskedLabels if masked else UltraScaleDataModule)(seq_len=64, micro_batch_size=micro_batch_size)
        trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data)
        train = [(step, m["train/loss"]) for step, m in logger.rows if "train/loss" in m]
        val = [m["val/loss"] for _, m in logger.rows if "val/loss" in m]
        return train, val, float(trainer.progress_bar_metrics["train/loss"])

    return run_pooled(worker, world_size)


@pytest.mark.parametrize("masked", [False, True], ids=["packed", "ignored-labels"])
def test_logged_losses_are_the_global_batch_cross_entropy_in_every_layout(masked: bool) -> None:
    # Before: train/loss was the last micro-batch's mean (pp2 with accumulation 2 logged 5.80233
    # at step 0 where one process logged 5.80159), and a sync_dist mean of per-rank means.
    (train, val, bar), *_ = _logged_losses(None, 1, 8, 1, masked)
    assert [step for step, _ in train] == [0, 1, 2, 3] and len(val) == 2 and bar == train[-1][1]
    layouts = {"dp2": (lambda: [ZeRO(stage=1)], 2, 4, 1)}
    # The token weighting over accumulation micro-steps is by micro-batch (Lightning's mean of means):
    # with ignored labels the two micro-batches' gradients differ from one process; their logged loss does not.
    pp = (lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 2, 4 if not masked else 8, 2 if not masked else 1)
    layouts["pp2"] = pp
    for name, (plugins, world_size, micro, accumulate) in layouts.items():
        for rank_train, rank_val, rank_bar in _logged_losses(plugins, world_size, micro, accumulate, masked):
            assert [s for s, _ in rank_train] == [s for s, _ in train], name
            for (_, got), (_, want) in zip(rank_train, train):
                assert abs(got - want) <= 1e-5 * want, (name, rank_train, train)
            for got, want in zip(rank_val, val, strict=True):
                assert abs(got - want) <= 1e-5 * want, (name, rank_val, val)
            assert rank_bar == rank_train[-1][1]
