"""Trace one training step's collectives (and count the model state after it) inside a Lightning run."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_ultrascale.utils.comm import CommTracer
from lightning_ultrascale.utils.memory import ModelStateBytes, model_state_bytes


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


class StepStateAndTraffic(L.Callback):
    """One whole optimizer step's collectives, and the model state this rank holds after it.

    Traces optimizer step ``step`` (1-based; the default 2 is past the first step's lazy
    allocations) from its batch's start to its end: forward, backward, the optimizer step and
    what the step launches (a sharded optimizer's parameter all-gathers), which
    :class:`StepCommTracer` stops before. ``state`` is the strategy's own count
    (``UltraScaleStrategy.model_state_bytes``: its engines' gradient buckets too) where it has one.

    Example:
        >>> measure = StepStateAndTraffic()
        >>> trainer = L.Trainer(callbacks=[measure], max_steps=2)  # doctest: +SKIP
        >>> measure.state.grads, measure.tracer.total("reduce_scatter")  # doctest: +SKIP
    """

    def __init__(self, step: int = 2) -> None:
        self.step = step
        self.tracer: CommTracer | None = None
        self.state: ModelStateBytes | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step - 1 and self.tracer is None:
            self.tracer = CommTracer().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.tracer is not None and self.state is None:
            self.tracer.__exit__(None, None, None)
            measure = getattr(trainer.strategy, "model_state_bytes", None)
            self.state = measure() if measure is not None else model_state_bytes(pl_module, trainer.optimizers)
