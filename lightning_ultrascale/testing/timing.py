"""Timing for benchmarks: the wall clock at the end of every training batch, and speed comparisons run
as alternated rounds whose paired ratios carry a bootstrap confidence interval."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np


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


#: The fewest values :func:`median_interval` gives an interval for.
MIN_VALUES = 6


@dataclass(frozen=True)
class PairedRatio:
    """How much faster one arm ran than the baseline: the median of the per-round ratios (arm / baseline,
    measured side by side in the same round) and a bootstrap confidence interval of that median.

    Example:
        >>> r = PairedRatio.of("ours/ddp", [1.02, 0.98, 1.05, 1.01, 0.99, 1.03])
        >>> round(r.median, 3), r.straddles_one
        (1.015, True)
    """

    name: str
    ratios: tuple[float, ...]
    median: float
    low: float
    high: float
    level: float = 0.95

    @classmethod
    def of(cls, name: str, ratios: Sequence[float], level: float = 0.95) -> PairedRatio:
        low, high = median_interval(ratios, level)
        return cls(name, tuple(ratios), statistics.median(ratios), low, high, level)

    @property
    def straddles_one(self) -> bool:
        """The interval holds 1.0: these pairs cannot tell the two arms apart."""
        return self.low <= 1.0 <= self.high

    @property
    def halfwidth(self) -> float:
        """Half the interval's width relative to the median (0.015: resolves differences of about 3%)."""
        return (self.high - self.low) / 2 / self.median

    def describe(self) -> str:
        verdict = "straddles 1.0: no difference resolved" if self.straddles_one else "excludes 1.0"
        return (
            f"{self.name} = {self.median:.3f} ({self.level:.0%} CI {self.low:.3f}-{self.high:.3f}, "
            f"{len(self.ratios)} pair{'' if len(self.ratios) == 1 else 's'}; {verdict})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "ci_low": self.low if math.isfinite(self.low) else None,  # one pair: no interval
            "ci_high": self.high if math.isfinite(self.high) else None,
            "ci_level": self.level,
            "pairs": len(self.ratios),
            "straddles_1": self.straddles_one,
            "ratios": list(self.ratios),
        }


def median_interval(values: Sequence[float], level: float = 0.95, resamples: int = 10_000) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of ``values`` (seeded: the same values give the same
    interval). At few values it is a little narrow: a nominal 95% held the true median 91-92% of the time
    at 8 to 30 normal values (``tests/unit/test_timing.py``); below :data:`MIN_VALUES` it would be the
    range of a handful of values (2 values: the true median inside half the time), so there is none: ``(-inf, inf)``.

    Example:
        >>> low, high = median_interval([0.9, 1.0, 1.1, 1.0, 0.95, 1.05])
        >>> 0.9 <= low <= 1.0 <= high <= 1.1
        True
    """
    if len(values) < MIN_VALUES:
        return -math.inf, math.inf
    rng = np.random.default_rng(0)
    data = np.asarray(values, dtype=np.float64)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


@dataclass
class Alternation:
    """Runs several arms of a speed comparison in rounds until every arm's ratio to the baseline is resolved.

    Each round runs every arm once, the order rotated each round (A B, then B A, ...) so that drift and
    order effects hit every arm alike; an arm's ratio in a round is its figure over the baseline's figure
    of that same round. Rounds go on until each ratio's confidence interval is narrower than
    ``halfwidth`` of its median (after ``min_rounds``), or ``max_rounds`` or ``max_seconds`` run out.
    A measurement returns a float (higher is faster: tokens/s) or a string saying why it measured
    nothing; such an arm leaves the comparison with that reason (``not_measured``), and a baseline that
    measured nothing ends it with no ratios.

    Example:
        >>> alternation = Alternation({"ddp": lambda: 100.0, "ours": lambda: 102.0}, baseline="ddp", log=None)
        >>> ratio = alternation.run()["ours"]  # a steady 2%: the interval is narrow after the fewest rounds
        >>> round(ratio.median, 3), len(ratio.ratios), ratio.straddles_one
        (1.02, 6, False)
    """

    arms: Mapping[str, Callable[[], float | str]]
    baseline: str
    min_rounds: int = MIN_VALUES
    max_rounds: int = 30
    halfwidth: float = 0.015
    max_seconds: float = math.inf
    level: float = 0.95
    log: Callable[[str], None] | None = print
    samples: dict[str, list[float]] = field(default_factory=dict)
    not_measured: dict[str, str] = field(default_factory=dict)

    def run(self) -> dict[str, PairedRatio]:
        if self.baseline not in self.arms:
            raise ValueError(f"baseline {self.baseline!r} is not one of the arms {sorted(self.arms)}")
        began = time.perf_counter()
        self.samples = {name: [] for name in self.arms}
        for round_ in range(self.max_rounds):
            self._round(round_)
            if self.baseline in self.not_measured:  # nothing to compare with: no ratios, the reason kept
                return {}
            ratios = self.ratios()
            done = round_ + 1 >= self.min_rounds and all(r.halfwidth <= self.halfwidth for r in ratios.values())
            if self.log is not None:
                self.log(f"round {round_ + 1}: " + "; ".join(r.describe() for r in ratios.values()))
            if done or time.perf_counter() - began > self.max_seconds:
                break
        return self.ratios()

    def _round(self, round_: int) -> None:
        names = [self.baseline] + [n for n in self.arms if n != self.baseline and n not in self.not_measured]
        shift = round_ % len(names)  # round 0 starts with the baseline: one that cannot run stops it at once
        for name in names[shift:] + names[:shift]:
            figure = self.arms[name]()
            if isinstance(figure, str):
                self.not_measured[name] = figure
                self.samples.pop(name, None)
                if name == self.baseline:
                    return
            else:
                self.samples[name].append(float(figure))

    def ratios(self) -> dict[str, PairedRatio]:
        """Each measured arm's paired ratio over the baseline, from the rounds so far."""
        base = self.samples[self.baseline]
        return {
            name: PairedRatio.of(f"{name}/{self.baseline}", [a / b for a, b in zip(values, base)], self.level)
            for name, values in self.samples.items()
            if name != self.baseline
        }


def fit_tokens_per_s(
    module: L.LightningModule,
    strategy: Any,
    *,
    devices: int,
    steps: int,
    seq_len: int,
    micro_batch: int,
    data_ranks: int,
    warmup: int = 2,
    callbacks: Sequence[L.Callback] = (),
) -> float:
    """Train ``module`` for ``steps`` batches of the bundled corpus under ``strategy`` on ``devices`` CPU
    processes and return the tokens per second after ``warmup`` steps: the one speed worker of the
    benchmarks' side-by-side tables (run it on every rank, through ``run_workers``).

    ``data_ranks`` is how many ranks read different samples (the data-parallel size: 1 for pure TP);
    ``callbacks``: the Trainer's besides the timer.
    """
    from lightning_ultrascale.data.datamodule import UltraScaleDataModule
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer, *callbacks],
        **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro_batch))
    return data_ranks * micro_batch * seq_len * timer.steps_per_s(warmup)
