"""A rank slowed inside its forward is named by the straggler report; an even run names nobody; peaks are measured."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.loggers import Logger
from llama_runs import SGD

from lightning_ultrascale import (
    ConfigError,
    LlamaModule,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.training.stragglers import RankFigures, StragglerMonitor

# Well above what a busy shared CPU adds to one rank's short steps, as is the minimum gap below.
DELAY_S, MIN_GAP_S = 0.5, 0.25


class _SlowForward(L.Callback):
    """Rank ``rank``'s model sleeps in every forward: a slow GPU, as its peers see it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank:
            pl_module.model.register_forward_hook(lambda *args: time.sleep(DELAY_S))


class _Logged(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    name, version = "logged", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


LAYOUTS = {
    "zero0": lambda: ZeRO(stage=0),  # our gradient buckets: Work.wait
    "zero3": lambda: ZeRO(stage=3),  # FSDP2's all-gathers and reduce-scatters
    "tp2": lambda: TensorParallel(2),  # DTensor's functional collectives: wait_tensor
}


def _train(slow_rank: int | None, layout: str = "zero0") -> dict[str, Any]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("lightning_ultrascale.training.stragglers").addHandler(handler)
    monitor, logger = StragglerMonitor(slow_ratio=1.25, min_gap_s=MIN_GAP_S), _Logged()
    callbacks = [monitor] + ([_SlowForward(slow_rank)] if slow_rank is not None else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(LAYOUTS[layout]()), max_steps=4, log_every_n_steps=2,
        callbacks=callbacks, **{**QUIET_TRAINER, "logger": logger},
    )  # fmt: skip
    trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=2))
    return {
        "figures": monitor.figures,
        "stragglers": monitor.stragglers,
        "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING],
        "metrics": [r for r in logger.rows if "straggler/flagged" in r],
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_slow_in_its_forward_is_named_in_the_log_and_the_metrics(layout):
    rank0, rank1 = run_pooled(_train, 2, 1, layout)
    figures = rank0["figures"]
    assert isinstance(figures, RankFigures) and figures.step == 4 and figures.steps == 2
    # Rank 0 waited for rank 1 in collectives: its compute time leaves the waits out.
    assert figures.compute_s[1] - figures.compute_s[0] > 0.6 * DELAY_S, figures
    assert rank0["stragglers"] == rank1["stragglers"] == [1]
    [warning] = rank0["warnings"][-1:]
    assert warning.startswith("straggler: rank 1 (host ") and "x the median" in warning
    assert rank1["warnings"] == []  # rank 0 speaks for the job
    last = rank0["metrics"][-1]
    assert last["straggler/slowest_rank"] == 1.0 and last["straggler/flagged"] == 1.0
    assert last["straggler/slowest_over_median"] > 1.25
    assert min(last["memory/rank0_peak_mib"], last["memory/rank1_peak_mib"]) > 0
    assert last["memory/peak_min_mib"] > 0


def test_an_even_run_names_nobody_and_measures_every_rank_s_peak():
    rank0, _ = run_pooled(_train, 2, None)
    assert rank0["stragglers"] == [] and rank0["warnings"] == []
    assert [m["straggler/flagged"] for m in rank0["metrics"]] == [0.0, 0.0]
    assert all("straggler/slowest_rank" not in m for m in rank0["metrics"])
    assert all(b > 0 for b in rank0["figures"].peak_bytes)


def test_ranks_are_compared_within_their_pipeline_stage():
    # Stage 1 (the head) is slower by design: it is compared with stage 1 only.
    figures = RankFigures(step=10, steps=5, compute_s=(1.0, 1.1, 2.0, 2.9), peak_bytes=(1, 1, 1, 1),
                          stages=(0, 0, 1, 1), hosts=("a",) * 4)  # fmt: skip
    assert figures.slow(slow_ratio=1.25, min_gap_s=0.1) == [3]
    assert "of the 2 ranks of its pipeline stage" in figures.describe(3)
    # The minimum gap keeps short steps' noise quiet.
    assert figures.slow(slow_ratio=1.25, min_gap_s=1.0) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slow_ratio": 1.0}, r"StragglerMonitor\(slow_ratio=1.0\) must be a number > 1"),
        ({"min_gap_s": -1}, r"StragglerMonitor\(min_gap_s=-1\) must be a number of seconds >= 0"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StragglerMonitor(**kwargs)
