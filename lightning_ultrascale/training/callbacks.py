"""Throughput, MFU and model-state memory as training runs: the playbook's headline numbers, logged.

:class:`TrainingMetrics` logs, per optimizer step, ``train/tokens_per_s`` (global, all data-parallel
ranks), ``train/tflops_per_device`` and ``train/mfu`` (model FLOPs utilisation, the playbook's
"MFU": achieved model FLOPs over the hardware's dense peak), and once, at the first optimizer step,
the model-state memory of rank 0. :class:`UltraScaleProgressBar` shows loss, tokens/s and MFU.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.tensor import DTensor

from lightning_ultrascale.utils.memory import ModelStateBytes, format_bytes, model_state_bytes

__all__ = ["PEAK_TFLOPS", "TrainingMetrics", "UltraScaleProgressBar", "peak_tflops"]

# (substring of torch.cuda.get_device_name(), bf16 dense TFLOPS, fp8 dense TFLOPS or None).
# Dense tensor-core peaks from the vendors' datasheets; NVIDIA prints the 2:4-sparse figure with an
# asterisk, which is twice these. First match wins, so a more specific name precedes its prefix.
PEAK_TFLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("GB200", 2500.0, 5000.0),  # GB200 NVL72 datasheet, per GPU: 5 / 10 PFLOPS sparse
    ("B200", 2250.0, 4500.0),  # HGX B200 datasheet, per GPU: 4.5 / 9 PFLOPS sparse
    ("H200 NVL", 835.0, 1670.0),  # H200 datasheet, NVL: 1,671* / 3,341* TFLOPS
    ("H200", 989.0, 1979.0),  # H200 datasheet, SXM: 1,979* / 3,958* TFLOPS
    ("H100 NVL", 835.0, 1670.0),  # H100 datasheet, NVL: 1,671* / 3,341* TFLOPS
    ("H100 PCIe", 756.0, 1513.0),  # H100 datasheet, PCIe: 1,513* / 3,026* TFLOPS
    ("H100", 989.0, 1979.0),  # H100 datasheet, SXM ("NVIDIA H100 80GB HBM3"): 1,979* / 3,958*
    ("A100", 312.0, None),  # A100 datasheet, SXM and PCIe: 312 (624*); Ampere has no FP8
    ("L40S", 362.0, 733.0),  # L40S datasheet: 362.05 (733*) / 733 (1,466*)
    ("L4", 121.0, 242.0),  # L4 datasheet: 242* / 485*
    ("MI300X", 1307.4, 2614.9),  # AMD Instinct MI300X datasheet, dense
    ("MI325X", 1307.4, 2614.9),  # AMD Instinct MI325X datasheet, dense (same CDNA3 compute)
)


def peak_tflops(device_name: str, dtype: Literal["bf16", "fp8"] = "bf16") -> float | None:
    """Dense peak TFLOPS of a device from :data:`PEAK_TFLOPS`, or None when unknown (CPU included).

    Example:
        >>> peak_tflops("NVIDIA H100 80GB HBM3"), peak_tflops("NVIDIA H100 80GB HBM3", "fp8")
        (989.0, 1979.0)
        >>> peak_tflops("cpu") is None
        True
    """
    for key, bf16, fp8 in PEAK_TFLOPS:
        if key in device_name:
            return bf16 if dtype == "bf16" else fp8
    return None


def _tokens_and_seq_len(batch: Any) -> tuple[int, int]:
    input_ids = batch["input_ids"] if isinstance(batch, dict) else batch
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(batch).__name__
        raise ValueError(
            f"TrainingMetrics needs a batch that is a dict with 'input_ids' [batch, seq] or a tensor"
            f" [batch, seq]; got {got}"
        )
    return input_ids.numel(), input_ids.shape[1]


class TrainingMetrics(L.Callback):
    """Log global tokens/s, TFLOPS per device, MFU and model-state memory.

    Per optimizer step (through ``pl_module.log``, so only rank 0's logger writes):

    - ``train/tokens_per_s``: tokens of the micro batches of a step (as Lightning hands them to the
      module) times the data-parallel size, over the step's wall time. The data-parallel size is
      ``strategy.distributed_sampler_kwargs["num_replicas"]`` for a ``ParallelStrategy``, else 1.
    - ``train/tflops_per_device``: ``pl_module.flops_per_token(seq_len)`` times global tokens/s over
      the world size; skipped when the module has no ``flops_per_token``.
    - ``train/mfu``: that over the device's dense peak (:func:`peak_tflops`); only on a GPU listed
      in :data:`PEAK_TFLOPS`.
    - ``train/skipped_steps``: optimizer steps skipped for a non-finite loss or gradient, under a
      strategy with a ``guard`` (``UltraScaleStrategy``'s :class:`~lightning_ultrascale.core.guard.NonFiniteGuard`).
    - ``data/<source>/tokens`` and ``data/<source>/pass``: for a blend of token files, each
      source's training tokens read so far over all ranks and which pass over it the run is on
      (2 once a source has wrapped), from the datamodule's ``tokens_by_source()``
      (:class:`~lightning_ultrascale.data.datamodule.UltraScaleDataModule`). Counted from the
      loader's position, so they need no collective.

    Throughput is measured over windows of ``window`` optimizer steps and logged at the end of
    each (with ``train/skipped_steps``), and the first step is left out: it carries warm-up
    (allocator, kernel autotuning, compilation) that later steps do not. Validation time between
    two steps is left out too. On CUDA the clock is read after a device synchronisation, so a
    window's time includes its queued kernels; synchronising at every step would stall the
    GPU's queue every step, so it happens once per window (and around validation).

    Once, after the first optimizer step (when gradients and optimizer states exist), it writes
    rank 0's ``memory/params_mib``, ``memory/grads_mib`` and, when the optimizer has state,
    ``memory/optimizer_mib`` to the trainer's loggers, and prints the same on one line.

    Args:
        window: number of steps the throughput is averaged over.
        peak_dtype: which peak MFU divides by: "bf16", or "fp8" for FP8 training.

    Example:
        >>> trainer = L.Trainer(callbacks=[TrainingMetrics(), UltraScaleProgressBar()])  # doctest: +SKIP
    """

    def __init__(self, window: int = 10, peak_dtype: Literal["bf16", "fp8"] = "bf16") -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.peak_dtype = peak_dtype
        self.window = window
        self._peak: float | None = None
        self._window_start: float | None = None
        self._val_start: float | None = None
        self._last_global_step = 0
        self._steps_seen = 0
        self._window_steps = 0
        self._tokens = 0
        self._seq_len = 0
        self._flops_cache: dict[int, float | None] = {}

    def _clock(self, trainer: L.Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self._peak = peak_tflops(torch.cuda.get_device_name(device), self.peak_dtype) if device.type == "cuda" else None
        # A fresh start for every fit (a resumed run starts at its restored step, warm-up again).
        self._last_global_step = trainer.global_step
        self._window_start, self._val_start = None, None
        self._steps_seen = self._window_steps = self._tokens = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens, self._seq_len = _tokens_and_seq_len(batch)
        self._tokens += tokens

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._last_global_step:  # accumulating gradients: no step yet
            return
        self._last_global_step = trainer.global_step
        self._steps_seen += 1
        if self._steps_seen == 1:  # the warm-up step: memory now, the first window from here
            self._log_memory(trainer, pl_module)
            self._window_start, self._window_steps, self._tokens = self._clock(trainer), 0, 0
            return
        self._window_steps += 1
        if self._window_steps < self.window:
            return
        now = self._clock(trainer)
        assert self._window_start is not None
        self._log_throughput(trainer, pl_module, self._tokens * self._dp_size(trainer), now - self._window_start)
        guard = getattr(trainer.strategy, "guard", None)  # UltraScaleStrategy's NonFiniteGuard
        if guard is not None:
            pl_module.log("train/skipped_steps", float(guard.skipped), on_step=True, on_epoch=False)
        self._log_sources(trainer, pl_module)
        self._window_start, self._window_steps, self._tokens = now, 0, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._window_start is not None:
            self._val_start = self._clock(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is not None and self._window_start is not None:
            self._window_start += self._clock(trainer) - self._val_start
        self._val_start = None

    @staticmethod
    def _log_sources(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokens_by_source = getattr(getattr(trainer, "datamodule", None), "tokens_by_source", None)
        if not callable(tokens_by_source):
            return
        for name, (tokens, passes) in tokens_by_source().items():
            pl_module.log(f"data/{name}/tokens", float(tokens), on_step=True, on_epoch=False)
            pl_module.log(f"data/{name}/pass", float(passes), on_step=True, on_epoch=False)

    @staticmethod
    def _dp_size(trainer: L.Trainer) -> int:
        strategy = trainer.strategy
        if isinstance(strategy, ParallelStrategy):
            return int((strategy.distributed_sampler_kwargs or {}).get("num_replicas", 1))
        return 1

    def _log_throughput(self, trainer: L.Trainer, pl_module: L.LightningModule, tokens: int, seconds: float) -> None:
        tokens_per_s = tokens / seconds
        pl_module.log("train/tokens_per_s", tokens_per_s, on_step=True, on_epoch=False)
        flops_per_token = self._flops_per_token(pl_module)
        if flops_per_token is None:
            return
        tflops = flops_per_token * tokens_per_s / trainer.world_size / 1e12
        pl_module.log("train/tflops_per_device", tflops, on_step=True, on_epoch=False)
        if self._peak is not None:
            pl_module.log("train/mfu", tflops / self._peak, on_step=True, on_epoch=False)

    def _flops_per_token(self, pl_module: L.LightningModule) -> float | None:
        # Cached per sequence length: a module's count may be costly (e.g. built from a meta model).
        if self._seq_len not in self._flops_cache:
            count = getattr(pl_module, "flops_per_token", None)
            self._flops_cache[self._seq_len] = None if count is None else float(count(self._seq_len))
        return self._flops_cache[self._seq_len]

    @staticmethod
    def _expected_state(
        trainer: L.Trainer, pl_module: L.LightningModule, states: ModelStateBytes
    ) -> tuple[ModelStateBytes, int] | None:
        """The strategy's playbook formula for this layout (UltraScaleStrategy has one), with k measured.

        k, the optimizer's state bytes per parameter (8 for fp32 Adam), is read off this rank's
        states and its own shard of the optimizer's parameters, so the formula checks sharding.
        """
        formula = getattr(trainer.strategy, "expected_model_state_bytes", None)
        if formula is None:
            return None
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for optimizer in trainer.optimizers
            for group in optimizer.param_groups
            for p in group["params"]
        )
        k = round(states.optimizer_states / local) if local else 0
        expected = formula(sum(p.numel() for p in pl_module.parameters()), k)
        return (expected, k) if expected is not None else None

    def _log_memory(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        measure = getattr(trainer.strategy, "model_state_bytes", None)
        states = measure() if measure is not None else model_state_bytes(pl_module, trainer.optimizers)
        mib = 2**20
        metrics = {"memory/params_mib": states.params / mib, "memory/grads_mib": states.grads / mib}
        if states.optimizer_states:
            metrics["memory/optimizer_mib"] = states.optimizer_states / mib
        line = f"rank 0 {states.summary()}"
        expected = self._expected_state(trainer, pl_module, states)
        if expected is not None:
            formula, k = expected
            metrics["memory/formula_mib"] = formula.total / mib
            line += (
                f"; playbook formula {format_bytes(formula.total)} (k={k}),"
                f" measured/formula {states.total / formula.total:.3f}"
            )
        rank_zero_info(line)
        if not trainer.is_global_zero:
            return
        # Straight to the loggers: a value given to pl_module.log once is re-emitted at every later
        # step of the epoch, and only reaches the logger at the next log_every_n_steps boundary.
        # Lightning's loggers count steps from 0: the step just taken is global_step - 1.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)


class UltraScaleProgressBar(TQDMProgressBar):
    """A TQDM bar showing the step's loss, global tokens/s and MFU ("n/a" where not measured).

    Reads ``train/tokens_per_s`` and ``train/mfu`` as :class:`TrainingMetrics` logs them, and the
    loss from what ``training_step`` returned, unless the module already shows a ``train...loss``
    metric on the bar (``self.log("train/loss", loss, prog_bar=True)``).

    Example:
        >>> trainer = L.Trainer(callbacks=[TrainingMetrics(), UltraScaleProgressBar()])  # doctest: +SKIP
        Epoch 0:  40%|████      | 40/100 [00:12<00:18, loss=3.21, tok/s=51,200, mfu=41.3%]
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._loss: torch.Tensor | None = None

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss = loss.detach()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        items = super().get_metrics(trainer, pl_module)
        metrics = trainer.callback_metrics
        # A module that puts its own training loss on the bar (synced over ranks) keeps it.
        logs_own_loss = any(k == "loss" or (k.startswith("train") and k.endswith("loss")) for k in items)
        if self._loss is not None and not logs_own_loss:
            items["loss"] = f"{self._loss.item():.4g}"
        tokens_per_s = metrics.get("train/tokens_per_s")
        items["tok/s"] = f"{float(tokens_per_s):,.0f}" if tokens_per_s is not None else "n/a"
        mfu = metrics.get("train/mfu")
        items["mfu"] = f"{100 * float(mfu):.1f}%" if mfu is not None else "n/a"
        return items
