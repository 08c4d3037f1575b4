"""Callbacks that prove a run survives a cluster: an exact per-step loss log, signals and SIGKILLs on cue.

Add them to any run (``ultrascale-train +callbacks.chaos={_target_: lightning_ultrascale.testing.chaos.ChaosMonkey,
...}``) to test your own cluster's restarts, as ``tests/e2e/test_resilience.py`` and ``benchmarks/chaos.py`` do:

- :class:`StepLossLog`: rank 0 appends each optimizer step's global-batch loss to a JSON-lines file
  (floats written exactly), so runs that were killed and resumed compare bit for bit with one that was not;
- :class:`SignalAt`: a rank sends itself a signal at a chosen step, in its forward or after it (preemption);
- :class:`ChaosMonkey`: ranks SIGKILL themselves at chosen steps, or in the middle of a checkpoint save,
  each kill once per run directory (a file records the kills done, so a restarted job goes on).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L

__all__ = ["ChaosMonkey", "SignalAt", "StepLossLog", "draw_kills", "read_losses"]


class StepLossLog(L.Callback):
    """Rank 0 appends ``{"step", "loss"}`` (the step's global-batch ``train/loss``, exact) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = getattr(pl_module, "_step_metrics", None) or {}
        if trainer.is_global_zero and "train/loss" in metrics:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(metrics["train/loss"])}) + "\n")


def read_losses(path: str | Path, last: bool = True) -> Any:
    """``{step: loss}`` of a :class:`StepLossLog` file (a step redone after a resume: its last value), or with
    ``last=False`` every ``(step, loss)`` line in order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not last:
        return [(r["step"], r["loss"]) for r in rows]
    return {r["step"]: r["loss"] for r in rows}


class SignalAt(L.Callback):
    """Rank ``r`` sends itself ``signum`` at step ``at[r]``: in that step's forward (``when[r]="start"``) or
    after it (``"end"``, the default; ``global_step`` then counts the step just taken)."""

    def __init__(self, at: dict[int, int], signum: str = "SIGUSR1", when: dict[int, str] | None = None) -> None:
        self.at = {int(k): int(v) for k, v in at.items()}
        self.signum = signum
        self.when = {int(k): v for k, v in (when or {}).items()}

    def _maybe(self, trainer: L.Trainer, moment: str) -> None:
        rank = trainer.global_rank
        if self.at.get(rank) == trainer.global_step and self.when.get(rank, "end") == moment:
            os.kill(os.getpid(), getattr(signal, self.signum))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._maybe(trainer, "start")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._maybe(trainer, "end")


def draw_kills(seed: int, n: int, steps: int, ranks: int, saves: list[int]) -> list[dict[str, Any]]:
    """``n`` kills at steps drawn from ``random.Random(seed)`` in ``2..steps-1``, each on a drawn rank, the first
    inside the save of a drawn step of ``saves`` (``{"step", "rank", "during": "step" | "save"}``), by step."""
    rng = random.Random(seed)
    kills = [{"step": rng.choice(saves), "rank": rng.randrange(ranks), "during": "save"}]
    while len(kills) < n:
        step = rng.randrange(2, steps)
        if all(k["step"] != step for k in kills):
            kills.append({"step": step, "rank": rng.randrange(ranks), "during": "step"})
    return sorted(kills, key=lambda k: k["step"])


class ChaosMonkey(L.Callback):
    """SIGKILL rank ``k["rank"]`` at each kill ``k``: after its step ``k["step"]`` (``during="step"``) or 50 ms into
    the checkpoint save of that step (``"save"``, a save some ranks have begun writing). ``state`` records
    the kills done (written before each one), so the job its launcher restarts runs on to the next."""

    def __init__(self, kills: list[dict[str, Any]], state: str) -> None:
        self.kills = [dict(k) for k in kills]
        self.state = Path(state)

    def _done(self) -> list[int]:
        return json.loads(self.state.read_text()) if self.state.is_file() else []

    def _due(self, trainer: L.Trainer, during: str) -> int | None:
        done = self._done()
        for i, kill in enumerate(self.kills):
            hit = kill["step"] == trainer.global_step and kill["rank"] == trainer.global_rank
            if hit and kill["during"] == during and i not in done:
                return i
        return None

    def _kill(self, index: int, delay: float = 0.0) -> None:
        self.state.write_text(json.dumps([*self._done(), index]))
        if delay:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        index = self._due(trainer, "step")
        if index is not None:
            self._kill(index)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        index = self._due(trainer, "save")
        if index is not None:
            self._kill(index, delay=0.05)  # the save goes on: the rank dies while writing (or waiting for) it
