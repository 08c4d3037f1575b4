"""Which rank holds the others back, and how much memory each holds: every rank's figures, every ``log_every_n_steps``.

In synchronous training the slowest rank sets every rank's pace: the others wait for it in the
next collective, so step times are equal and say nothing. Each rank's *compute* time, its batches'
time minus its time in collectives (:class:`~lightning_ultrascale.utils.waits.BatchClock` says what
is and is not counted on gloo and on NCCL), tells them apart: the straggler waits least. Every
``log_every_n_steps`` optimizer steps every rank hands its compute time per step, its memory peak
(:func:`~lightning_ultrascale.utils.memory.process_peak_bytes`) and its pipeline stage to one
``all_gather`` of three numbers; rank 0 names, in a warning and in the metrics, each rank slower
than ``slow_ratio`` times the median of the ranks of its pipeline stage (stages run different
layers, so they are not compared with each other) and by more than ``min_gap_s``.
"""

from __future__ import annotations

import collections
import functools
import logging
import socket
import statistics
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.utils.comm import collective_device
from lightning_ultrascale.utils.memory import process_peak_bytes
from lightning_ultrascale.utils.waits import BatchClock

__all__ = ["RankFigures", "StragglerMonitor"]

log = logging.getLogger(__name__)

#: Per-rank metrics (two per rank) are logged up to this many ranks; beyond, the extremes only.
PER_RANK_METRICS_UP_TO = 8
#: torch >= 2.12 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class RankFigures:
    """Every rank's figures over one window of optimizer steps (index: global rank).

    Example:
        >>> figures = RankFigures(step=20, steps=10, compute_s=(1.0, 1.0, 1.6, 1.1),
        ...                       peak_bytes=(2**30,) * 4, stages=(0, 0, 0, 0), hosts=("a", "a", "b", "b"))
        >>> figures.slow(slow_ratio=1.25, min_gap_s=0.1)
        [2]
        >>> print(figures.describe(2))
        rank 2 (host b) computed 1.600 s per step over steps 11-20, 1.60x the median 1.000 s of all 4 ranks
    """

    step: int
    steps: int
    compute_s: tuple[float, ...]
    peak_bytes: tuple[int, ...]
    stages: tuple[int, ...]
    hosts: tuple[str, ...]

    @functools.cached_property
    def _by_stage(self) -> dict[int, list[float]]:
        by_stage: dict[int, list[float]] = collections.defaultdict(list)
        for c, s in zip(self.compute_s, self.stages):
            by_stage[s].append(c)
        return by_stage

    @functools.cached_property
    def _medians(self) -> dict[int, float]:
        return {s: statistics.median_low(c) for s, c in self._by_stage.items()}  # once: a job may have 10^4 ranks

    def peers_median(self, rank: int) -> float:
        """The median compute time of the ranks at ``rank``'s pipeline stage (the lower middle one of an even count)."""
        return self._medians[self.stages[rank]]

    def over_median(self, rank: int) -> float:
        median = self.peers_median(rank)
        return self.compute_s[rank] / median if median > 0 else 1.0

    def slow(self, slow_ratio: float, min_gap_s: float) -> list[int]:
        """Ranks slower than ``slow_ratio`` x their peers' median and by more than ``min_gap_s`` seconds per step."""
        return [
            r
            for r, c in enumerate(self.compute_s)
            if c > slow_ratio * self.peers_median(r) and c - self.peers_median(r) > min_gap_s
        ]

    def describe(self, rank: int) -> str:
        peers = len(self._by_stage[self.stages[rank]])
        among = f"of all {peers} ranks" if peers == len(self.stages) else f"of the {peers} ranks of its pipeline stage"
        return (
            f"rank {rank} (host {self.hosts[rank]}) computed {self.compute_s[rank]:.3f} s per step over steps "
            f"{self.step - self.steps + 1}-{self.step}, {self.over_median(rank):.2f}x the median "
            f"{self.peers_median(rank):.3f} s {among}"
        )

    def metrics(self, slow: list[int]) -> dict[str, float]:
        """What rank 0 logs: medians, extremes, the slowest rank when flagged, per-rank values for small jobs."""
        n, mib = len(self.compute_s), [b / 2**20 for b in self.peak_bytes]
        ratios = [self.over_median(r) for r in range(n)]
        out = {
            "straggler/compute_s_median": statistics.median_low(self.compute_s),
            "straggler/compute_s_max": max(self.compute_s),
            "straggler/slowest_over_median": max(ratios),
            "straggler/flagged": float(len(slow)),
            "memory/peak_max_mib": max(mib),
            "memory/peak_min_mib": min(mib),
            "memory/peak_max_rank": float(mib.index(max(mib))),
        }
        if slow:
            out["straggler/slowest_rank"] = float(max(slow, key=ratios.__getitem__))
        if n <= PER_RANK_METRICS_UP_TO:
            for r in range(n):
                out[f"straggler/rank{r}_compute_s"] = self.compute_s[r]
                out[f"memory/rank{r}_peak_mib"] = mib[r]
        return out


def _pipeline_stage(strategy: Any) -> int:
    dims = getattr(strategy, "parallel_dims", None)  # UltraScaleStrategy's; other strategies have no stages
    if dims is None or dims.pp == 1:
        return 0
    return int(strategy.mesh["pp"].get_local_rank())


def _hosts() -> tuple[str, ...]:
    host = socket.gethostname()
    if not (dist.is_available() and dist.is_initialized()):
        return (host,)
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    return tuple(hosts)


def _gather(row: torch.Tensor) -> list[list[float]]:
    if not (dist.is_available() and dist.is_initialized()):
        return [row.tolist()]
    out = row.new_empty(dist.get_world_size() * row.numel())  # gloo wants the flat shape
    _all_gather_single(out, row)
    return out.view(-1, row.numel()).tolist()


class StragglerMonitor(L.Callback):
    """Name the ranks that compute slower than their peers, and log every rank's memory peak (module docstring).

    Every ``trainer.log_every_n_steps`` optimizer steps (the first step, a warm-up, left out), rank 0
    logs a warning naming each slow rank, its host and its time against the median, and writes to
    the trainer's loggers ``straggler/compute_s_median``, ``straggler/compute_s_max``,
    ``straggler/slowest_over_median``, ``straggler/flagged`` (how many ranks are slow),
    ``straggler/slowest_rank`` (only when one is), ``memory/peak_max_mib``, ``memory/peak_min_mib``,
    ``memory/peak_max_rank`` and, up to :data:`PER_RANK_METRICS_UP_TO` ranks, each rank's
    ``straggler/rank<r>_compute_s`` and ``memory/rank<r>_peak_mib``. Every rank keeps the last
    window's :class:`RankFigures` in ``figures`` and the slow ranks in ``stragglers``.

    Counted: the time from each training batch's start to its end (forward, backward, optimizer
    step), minus the time in collectives. Not counted: data loading, validation, checkpointing.

    Args:
        slow_ratio: a rank is slow above this multiple of its peers' median compute time.
        min_gap_s: and only if it is slower by more than this many seconds per step (noise on short steps).
    """

    def __init__(self, slow_ratio: float = 1.25, min_gap_s: float = 0.1) -> None:
        if not isinstance(slow_ratio, (int, float)) or isinstance(slow_ratio, bool) or slow_ratio <= 1:
            raise ConfigError(f"{option(self, 'slow_ratio', slow_ratio)} must be a number > 1 (e.g. 1.25)")
        if not isinstance(min_gap_s, (int, float)) or isinstance(min_gap_s, bool) or min_gap_s < 0:
            raise ConfigError(f"{option(self, 'min_gap_s', min_gap_s)} must be a number of seconds >= 0")
        self.slow_ratio, self.min_gap_s = float(slow_ratio), float(min_gap_s)
        self.figures: RankFigures | None = None
        self.stragglers: list[int] = []
        self._clock: BatchClock | None = None
        self._hosts: tuple[str, ...] = ()
        self._stage = self._last_step = self._steps = 0
        self._warm = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.log_every_n_steps:  # logging is off (barebones): so is the report
            return
        self._clock = BatchClock(trainer.strategy.root_device).install()
        self._hosts, self._stage = _hosts(), _pipeline_stage(trainer.strategy)
        self._last_step, self._steps, self._warm = trainer.global_step, 0, False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is not None:
            self._clock.begin()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        self._clock.end()
        if trainer.global_step == self._last_step:  # accumulating gradients: no step yet
            return
        self._last_step = trainer.global_step
        if not self._warm:  # allocator, autotuning, compilation: ranks may differ for reasons that pass
            self._warm = True
            self._clock.take()
            return
        self._steps += 1
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._report(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._clock is not None:
            self._clock.uninstall()
            self._clock = None

    def _report(self, trainer: L.Trainer) -> None:
        assert self._clock is not None
        batch_s, collective_s = self._clock.take()
        device = trainer.strategy.root_device
        compute = max(batch_s - collective_s, 0.0) / self._steps
        row = [compute, float(process_peak_bytes(device)), float(self._stage)]
        rows = _gather(torch.tensor(row, dtype=torch.float64, device=collective_device()))
        self.figures = RankFigures(
            step=trainer.global_step,
            steps=self._steps,
            compute_s=tuple(r[0] for r in rows),
            peak_bytes=tuple(int(r[1]) for r in rows),
            stages=tuple(int(r[2]) for r in rows),
            hosts=self._hosts,
        )
        self._steps = 0
        self.stragglers = self.figures.slow(self.slow_ratio, self.min_gap_s)
        if not trainer.is_global_zero:
            return
        for rank in self.stragglers:
            log.warning("straggler: %s", self.figures.describe(rank))
        # Lightning's loggers count steps from 0: the step just taken is global_step - 1.
        for logger in trainer.loggers:
            logger.log_metrics(self.figures.metrics(self.stragglers), step=trainer.global_step - 1)
