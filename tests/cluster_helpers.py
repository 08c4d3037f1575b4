"""Callbacks the cluster tests add to CLI runs (``+callbacks.<name>={_target_: cluster_helpers....}``,
with ``tests/`` on PYTHONPATH): a per-step loss log, and signals a rank sends itself at a chosen moment."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import lightning as L


class LossLog(L.Callback):
    """Rank 0 appends ``{"step", "loss"}`` (the step's global-batch loss, exact) to ``path`` after every step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = getattr(pl_module, "_step_metrics", None) or {}
        if trainer.is_global_zero and "train/loss" in metrics:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(metrics["train/loss"])}) + "\n")


class SignalAt(L.Callback):
    """Rank ``r`` sends itself ``signum`` at step ``at[r]``: in that step's forward (``when="start"``) or after it."""

    def __init__(self, at: dict[int, int], signum: str = "SIGUSR1", when: dict[int, str] | None = None) -> None:
        self.at, self.signum, self.when = {int(k): int(v) for k, v in at.items()}, signum, when or {}

    def _maybe(self, trainer: L.Trainer, moment: str) -> None:
        rank = trainer.global_rank
        if self.at.get(rank) == trainer.global_step and self.when.get(rank, "end") == moment:
            os.kill(os.getpid(), getattr(signal, self.signum))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._maybe(trainer, "start")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # (global_step counts the step just taken: "end" of step n fires with global_step n)
        self._maybe(trainer, "end")


def read_losses(path: str) -> dict[int, float]:
    """The loss logged for each step; a step logged twice (redone after a resume) keeps the last."""
    out: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out[row["step"]] = row["loss"]
    return out
