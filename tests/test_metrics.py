"""TrainingMetrics logs throughput and memory on CPU, and leaves MFU out where there is no known peak."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ultrascale.callbacks import TrainingMetrics, UltraScaleProgressBar, peak_tflops

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
    assert len(tokens_per_s) == 4  # 5 steps, the first left out as warm-up
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
