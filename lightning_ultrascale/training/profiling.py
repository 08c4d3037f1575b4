"""``profiler=torch``: a Chrome trace of chosen optimizer steps on chosen ranks and, on a GPU, a CUDA memory snapshot.

A callback rather than Lightning's ``Trainer(profiler=PyTorchProfiler(...))``, which counts its
schedule in ``training_step`` calls (micro-batches, not optimizer steps), profiles every rank,
names its trace after the *local* rank (ranks of two nodes writing to one directory overwrite each
other) and wraps every Lightning hook in a ``record_function``. :class:`TraceProfiler` steps
torch's schedule once per optimizer step, runs on the ranks asked for only, and names each file
after its global rank and steps. Our gradient syncs are named in the trace (``ultrascale/grad_sync``,
``ultrascale/grad_sync_wait``, ``ultrascale/param_all_gather``), beside torch's own ``c10d::`` ops,
the backend's (``gloo:all_reduce``, ``nccl:all_reduce``) and FSDP2's (``FSDP::...``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_ultrascale.errors import ConfigError, option, require_positive_int

__all__ = ["TraceProfiler"]

log = logging.getLogger(__name__)

#: Allocation events the CUDA memory history keeps (torch's default); older ones are dropped.
MEMORY_HISTORY_ENTRIES = 100_000


class TraceProfiler(L.Callback):
    """Profile optimizer steps ``wait + warmup + 1`` to ``wait + warmup + active`` (counted from the fit's start).

    Each rank of ``ranks`` writes ``<dirpath>/rank<r>-steps<a>-<b>.json`` (a Chrome trace: open it in
    https://ui.perfetto.dev or chrome://tracing) and, on a GPU with ``memory_snapshot``, the CUDA
    caching allocator's history from the start of warm-up, ``rank<r>-steps<a>-<b>.memory.pickle``
    (https://pytorch.org/memory_viz). On a CPU the snapshot is skipped, with a log line.

    Args:
        dirpath: the directory the files go to (the CLI: ``<run dir>/profiler``).
        wait: optimizer steps not profiled first (the first step carries one-off warm-up costs).
        warmup: steps profiled and discarded (the profiler's own start-up cost stays out).
        active: steps recorded.
        ranks: the global ranks that profile.
        memory_snapshot: on a GPU, also dump the CUDA memory snapshot.

    Example:
        >>> profiler = TraceProfiler("runs/x/profiler", wait=1, warmup=1, active=2, ranks=[0])
        >>> trainer = L.Trainer(callbacks=[profiler], max_steps=10)  # doctest: +SKIP
    """

    def __init__(
        self,
        dirpath: str,
        wait: int = 1,
        warmup: int = 1,
        active: int = 2,
        ranks: Sequence[int] = (0,),
        memory_snapshot: bool = True,
    ) -> None:
        for name, value in (("wait", wait), ("warmup", warmup)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{option(self, name, value)} must be an integer >= 0 (optimizer steps)")
        require_positive_int(self, "active", active)
        ranks = list(ranks)
        if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise ConfigError(f"{option(self, 'ranks', ranks)} must list global ranks (integers >= 0), e.g. [0]")
        self.dirpath, self.wait, self.warmup, self.active = str(dirpath), wait, warmup, active
        self.ranks, self.memory_snapshot = ranks, bool(memory_snapshot)
        self._profile: torch.profiler.profile | None = None
        self._cuda = False
        self._rank = self._steps = self._last_step = self._first_active = 0

    def check_world_size(self, world_size: int) -> None:
        """Refuse ranks the job does not have (the CLI calls this before any process group exists)."""
        beyond = [r for r in self.ranks if r >= world_size]
        if beyond:
            raise ConfigError(
                f"{option(self, 'ranks', self.ranks)} names ranks beyond the job's {world_size}; "
                f"valid: 0..{world_size - 1}"
            )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.check_world_size(trainer.world_size)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank not in self.ranks:
            return
        self._rank, self._cuda = trainer.global_rank, trainer.strategy.root_device.type == "cuda"
        self._steps, self._last_step = 0, trainer.global_step
        self._first_active = trainer.global_step + self.wait + self.warmup + 1
        if self.memory_snapshot and not self._cuda:
            log.info("profiler: no CUDA memory snapshot on rank %d: it runs on the CPU", self._rank)
        Path(self.dirpath).mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1)
        self._profile = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write)
        self._profile.start()
        self._record_memory_at_warmup()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._profile is None or trainer.global_step == self._last_step:  # not profiling, or accumulating
            return
        self._last_step = trainer.global_step
        self._steps += 1
        self._record_memory_at_warmup()
        self._profile.step()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profile is None:
            return
        if self._steps <= self.wait + self.warmup:
            log.warning(
                "profiler: training ended after %d steps, before the recorded ones (wait=%d, warmup=%d): no trace",
                self._steps, self.wait, self.warmup,
            )  # fmt: skip
        self._profile.stop()  # writes a partial window of active steps
        self._profile = None
        if self._cuda and self.memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)  # a no-op where _write stopped it

    def _record_memory_at_warmup(self) -> None:
        if self._cuda and self.memory_snapshot and self._steps == self.wait:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def _write(self, profile: torch.profiler.profile) -> None:
        stem = Path(self.dirpath) / f"rank{self._rank}-steps{self._first_active}-{self._last_step}"
        profile.export_chrome_trace(f"{stem}.json")
        log.info("profiler: rank %d wrote %s.json", self._rank, stem)
        if self._cuda and self.memory_snapshot:
            torch.cuda.memory._dump_snapshot(f"{stem}.memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("profiler: rank %d wrote %s.memory.pickle", self._rank, stem)
