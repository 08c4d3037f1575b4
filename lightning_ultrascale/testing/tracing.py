"""Trace one training step's collectives inside a Lightning run (tests and benchmarks)."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_ultrascale.utils.comm import CommTracer


class StepCommTracer(L.Callback):
    """A :class:`CommTracer` around each step's forward and backward (batch start to optimizer step).

    ``tracer`` holds the last step's records. Use with ``max_steps=1`` for one step's bytes.

    Example:
        >>> trace = StepCommTracer()
        >>> trainer = L.Trainer(callbacks=[trace], max_steps=1)  # doctest: +SKIP
        >>> trace.tracer.total("all_gather")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.tracer = CommTracer()

    def on_train_batch_start(self, *args: Any) -> None:
        self.tracer = CommTracer().__enter__()

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.tracer.__exit__(None, None, None)
