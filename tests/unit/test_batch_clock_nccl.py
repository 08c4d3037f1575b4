"""BatchClock's CUDA path without a GPU: batches timed by (fake) CUDA events, collective time read from (synthetic)
entries of NCCL's flight recorder. The real path ran on an H100 (`pytest -m gpu`,
``test_batch_clock_counts_the_nccl_collectives_issued_inside_a_batch``); NCCL's completion hook, used before,
never fired there and its ``_wait_for_pending_works`` hung."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from lightning_ultrascale.utils import waits


class _Event:
    """A CUDA event stand-in: records the host clock; elapsed_time in milliseconds."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3


def _entry(record_id: int, at_s: float, ms: float | None, retired: bool = True) -> dict:
    entry = {"record_id": record_id, "time_created_ns": int(at_s * 1e9), "retired": retired}
    return entry if ms is None else {**entry, "duration_ms": ms}


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    entries: list[dict] = []
    monkeypatch.setattr(waits, "_nccl_entries", lambda: list(entries))
    monkeypatch.setattr(waits, "_RETIRE_WAIT_S", 0.3)
    clock = waits.BatchClock(torch.device("cuda"))
    yield clock, entries


def test_only_the_collectives_issued_inside_a_batch_count(clock):
    clock, entries = clock
    entries.append(_entry(0, time.time(), 50.0))  # before the batch
    clock.begin()
    inside = time.time()
    time.sleep(0.01)
    clock.end()
    entries += [_entry(1, inside, 2.0), _entry(2, inside, None)]  # the second: its group was not timed
    entries.append(_entry(3, time.time() + 1, 70.0))  # after the batch
    batch_s, collective_s = clock.take()
    assert batch_s >= 0.01 and collective_s == pytest.approx(0.002)
    assert clock.take() == (0.0, 0.0)  # a take starts anew


def test_a_collective_not_retired_yet_is_waited_for_then_counted_as_compute(clock, monkeypatch):
    clock, entries = clock
    clock.begin()
    inside = time.time()
    clock.end()
    entries.append(_entry(0, inside, None, retired=False))
    reads = iter([[_entry(0, inside, None, retired=False)], [_entry(0, inside, 3.0)]])
    monkeypatch.setattr(waits, "_nccl_entries", lambda: next(reads))
    assert clock.take()[1] == pytest.approx(0.003)  # retired by the watchdog at the second read

    clock.begin()
    inside = time.time()
    clock.end()
    monkeypatch.setattr(waits, "_nccl_entries", lambda: [_entry(1, inside, None, retired=False)])
    start = time.monotonic()
    assert clock.take()[1] == 0.0  # never retired: counted as compute after the bounded wait
    assert time.monotonic() - start < 1.0


def test_a_window_longer_than_the_flight_recorder_warns(clock, caplog):
    clock, entries = clock
    waits._warn_once.cache_clear()
    clock.begin()
    time.sleep(0.01)
    entries += [_entry(i, time.time(), 1.0) for i in range(5, 8)]  # ids 0-4 were dropped
    clock.end()
    with caplog.at_level(logging.WARNING, logger=waits.__name__):
        assert clock.take()[1] == pytest.approx(0.003)
    assert "TORCH_FR_BUFFER_SIZE" in caplog.text
