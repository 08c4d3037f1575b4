"""How long a rank's training batches took, and how much of it was spent in collectives rather than its own compute.

A rank that computes slowly makes every other rank wait for it in the next collective, so every
rank's step takes as long; what differs is the time each spent waiting. :class:`BatchClock`
measures both over chosen intervals (the training batches):

- **gloo (CPU)**: a rank blocks on the host until a collective completes, in ``Work.wait()``
  (every ``torch.distributed`` call: blocking ones wait inside, asynchronous ones where they are
  waited for: our gradient buckets, FSDP2, pipeline send/recv) or in the functional collectives'
  ``wait_tensor`` (DTensor redistributions, tensor parallelism). While a clock is installed both
  are wrapped by a timer that counts on the clock's thread (CPU autograd runs there too). Not
  seen, so counted as compute: waits issued from C++ without passing through Python (the backward
  of ``all_to_all_single_autograd``, i.e. expert parallelism's return all-to-all; compiled graphs).
- **NCCL (GPU)**: the host does not block; the GPU stream waits. Batches are timed with CUDA events
  and NCCL's flight recorder (on by default, ``TORCH_FR_BUFFER_SIZE`` entries; collective timing
  switched on for every NCCL group at :meth:`BatchClock.install`: two CUDA events per collective, no
  host synchronisation) gives the time every collective ran on the GPU: waiting for its peers plus
  the transfer. A collective counts for the batch during which the host issued it. Collectives
  overlapping compute (gradient buckets during backward, FSDP2 prefetches) are subtracted too, so
  compute is a lower bound where communication overlaps it; groups created after install are not
  timed. Reading a window synchronises the device once and waits (at most a second) for NCCL's
  watchdog to retire the window's last collectives. A window with more collectives than the recorder
  keeps is counted from the ones it kept, with a warning. (NCCL's completion hook, which this used
  before, never fired on torch 2.11 and its ``_wait_for_pending_works`` then waited forever: seen on
  an H100.)
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C import _distributed_c10d as c10d

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: list[BatchClock] = []
_originals: dict[str, Callable[..., Any]] = {}


def _timed(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``wait`` adding its duration to every installed clock counting on this thread (once when nested)."""

    @functools.wraps(wait)
    def timed(*args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        clocks = [c for c in _installed if c._open and c._thread == me and not c._in_wait]
        if not clocks:
            return wait(*args, **kwargs)
        for c in clocks:
            c._in_wait = True
        start = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            for c in clocks:
                c._host_wait_s += elapsed
                c._in_wait = False

    return timed


def _patch_waits() -> None:
    _originals["work"] = dist.Work.wait
    _originals["wait_tensor"] = funcol.wait_tensor
    dist.Work.wait = _timed(dist.Work.wait)  # type: ignore[method-assign]
    funcol.wait_tensor = _timed(funcol.wait_tensor)


def _restore_waits() -> None:
    dist.Work.wait = _originals.pop("work")  # type: ignore[method-assign]
    funcol.wait_tensor = _originals.pop("wait_tensor")


def _time_nccl_groups() -> bool:
    """Switch collective timing on for every NCCL group of this process; False if there is none."""
    timed = False
    for group in list(dist.distributed_c10d._world.pg_map):
        if "nccl" not in str(dist.get_backend(group)):
            continue
        try:
            group._enable_collectives_timing()
            timed = True
        except (RuntimeError, ValueError) as err:
            log.warning("collective time of group %s is not measured (%s): it counts as compute", group, err)
    return timed


def _nccl_entries() -> list[dict[str, Any]]:
    """NCCL's flight-recorder entries of this process (empty without NCCL, or without a process group)."""
    dump = getattr(c10d, "_dump_nccl_trace_json", None)  # exists in CUDA builds only
    if dump is None or not dist.is_initialized():
        return []
    try:
        return json.loads(dump(True, False)).get("entries", [])
    except RuntimeError as err:  # the recorder is off (TORCH_FR_BUFFER_SIZE=0) or unreadable: time counts as compute
        _warn_once("NCCL's flight recorder cannot be read (%s): collective time counts as compute", str(err))
        return []


def nccl_records(entries: list[dict[str, Any]], since_ns: int, until_ns: int) -> tuple[list[tuple[float, float]], int]:
    """``(host issue time s, GPU seconds)`` of the timed entries issued between ``since_ns`` and ``until_ns``; and
    how many of those NCCL's watchdog has not retired yet (their duration is not known yet). A retired entry
    without a duration was not timed (its group was created after the clock was installed).

    Example:
        >>> done = {"time_created_ns": 2_000_000_000, "duration_ms": 1.5, "retired": True}
        >>> untimed = {"time_created_ns": 2_500_000_000, "retired": True}
        >>> running = {"time_created_ns": 3_000_000_000, "retired": False}
        >>> nccl_records([done, untimed, running], since_ns=1_000_000_000, until_ns=4_000_000_000)
        ([(2.0, 0.0015)], 1)
    """
    records, pending = [], 0
    for e in entries:
        if not since_ns <= e["time_created_ns"] <= until_ns:
            continue
        if not e.get("retired"):
            pending += 1
        elif e.get("duration_ms") is not None:
            records.append((e["time_created_ns"] / 1e9, e["duration_ms"] / 1e3))
    return records, pending


class BatchClock:
    """Seconds of training batches and, within them, seconds in collectives, on this rank (module docstring).

    Example:
        >>> clock = BatchClock(torch.device("cpu")).install()
        >>> clock.begin(); clock.end()
        >>> batch_s, collective_s = clock.take()
        >>> batch_s >= collective_s == 0.0
        True
        >>> clock.uninstall()
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._thread = threading.get_ident()
        self._open = self._in_wait = False
        self._host_wait_s = self._host_s = 0.0
        self._started = 0.0
        #: CUDA: each batch's (start event, end event, host start, host end).
        self._events: list[tuple[Any, Any, float, float]] = []
        #: NCCL: the flight recorder's newest record id at the last take (a gap after it: records were dropped).
        self._last_record_id = max((e.get("record_id", 0) for e in _nccl_entries()), default=-1)

    def install(self) -> BatchClock:
        """Start observing collectives (the waits patched for the first clock, NCCL groups hooked once)."""
        with _lock:
            if not _installed:
                _patch_waits()
            _installed.append(self)
        self._thread = threading.get_ident()
        if self.device.type == "cuda" and dist.is_initialized() and not _time_nccl_groups():
            log.warning("no NCCL group is timed: compute time includes the time spent in collectives")
        return self

    def uninstall(self) -> None:
        with _lock:
            if self in _installed:
                _installed.remove(self)
                if not _installed:
                    _restore_waits()

    def begin(self) -> None:
        """A counted interval (a training batch) starts."""
        self._open = True
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None, time.time(), 0.0))
        else:
            self._started = time.perf_counter()

    def end(self) -> None:
        """The interval ends (a no-op without :meth:`begin`)."""
        if not self._open:
            return
        self._open = False
        if self.device.type == "cuda":
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            start, _, host_start, _ = self._events[-1]
            self._events[-1] = (start, stop, host_start, time.time())
        else:
            self._host_s += time.perf_counter() - self._started

    def take(self) -> tuple[float, float]:
        """``(batch seconds, collective seconds)`` of the intervals since the last take, and start anew."""
        if self.device.type != "cuda":
            taken = (self._host_s, self._host_wait_s)
            self._host_s = self._host_wait_s = 0.0
            return taken
        return self._take_cuda()

    def _take_cuda(self) -> tuple[float, float]:
        events, self._events = [e for e in self._events if e[1] is not None], []
        if not events:
            return 0.0, 0.0
        events[-1][1].synchronize()
        batch_s = sum(start.elapsed_time(stop) for start, stop, _, _ in events) / 1e3
        since_ns, until_ns = int(events[0][2] * 1e9), int(events[-1][3] * 1e9)
        deadline = time.monotonic() + _RETIRE_WAIT_S
        while True:  # NCCL's watchdog retires finished collectives (and times them) every 100 ms or so
            entries = _nccl_entries()
            records, pending = nccl_records(entries, since_ns, until_ns)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if pending:
            log.debug("%d collectives of this window are not timed yet: they count as compute", pending)
        oldest = min((e["time_created_ns"] for e in entries), default=0)
        first_id = min((e.get("record_id", 0) for e in entries), default=0)
        if entries and oldest > since_ns and first_id > self._last_record_id + 1:
            _warn_once(
                "NCCL's flight recorder kept fewer collectives than this straggler window issued: the collective "
                "time counts the last %d only (raise TORCH_FR_BUFFER_SIZE, or report over fewer steps)",
                len(entries),
            )
        self._last_record_id = max((e.get("record_id", 0) for e in entries), default=self._last_record_id)
        return batch_s, in_intervals(records, [(a, b) for _, _, a, b in events])


_RETIRE_WAIT_S = 1.0


@functools.cache
def _warn_once(message: str, *args: Any) -> None:
    log.warning(message, *args)


def in_intervals(records: list[tuple[float, float]], intervals: list[tuple[float, float]]) -> float:
    """Sum of the durations of ``(time, duration)`` records whose time falls in one of the sorted ``intervals``.

    Example:
        >>> in_intervals([(0.5, 2.0), (1.5, 4.0), (2.5, 8.0)], [(0.0, 1.0), (2.0, 3.0)])
        10.0
    """
    starts = [a for a, _ in intervals]
    total = 0.0
    for at, seconds in records:
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0 and at <= intervals[i][1]:
            total += seconds
    return total
