"""Step timing for benchmarks: the wall clock at the end of every training batch."""

from __future__ import annotations

import time
from typing import Any

import lightning as L


class StepTimer(L.Callback):
    """Records when each training batch ends; :meth:`steps_per_s` leaves the warm-up steps out.

    Example:
        >>> timer = StepTimer()
        >>> trainer = L.Trainer(callbacks=[timer], max_steps=20)  # doctest: +SKIP
        >>> tokens_per_s = timer.steps_per_s() * tokens_per_step  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def steps_per_s(self, warmup: int = 2) -> float:
        """Batches per second after ``warmup`` batches (allocation, thread start-up, DTensor caches)."""
        warm = self.ends[warmup:]
        if len(warm) < 2:
            raise ValueError(f"{len(self.ends)} timed batches leave fewer than 2 after {warmup} warm-up ones")
        return (len(warm) - 1) / (warm[-1] - warm[0])
