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
  and each NCCL group's completion hook (``_register_on_completion_hook``, collective timing on: one
  more CUDA event per collective, no host synchronisation) reports the time every collective ran on
  the GPU: waiting for its peers plus the transfer. A collective counts for the batch during which
  the host issued it. Collectives overlapping compute (gradient buckets during backward, FSDP2
  prefetches) are subtracted too, so compute is a lower bound where communication overlaps it;
  groups created after :meth:`BatchClock.install` are not hooked. Reading a window synchronises
  the device once.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: list[BatchClock] = []
_originals: dict[str, Callable[..., Any]] = {}
#: Names of the NCCL groups whose completion hook reports to the installed clocks (a hook is for life).
_hooked: dict[str, dist.ProcessGroup] = {}


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


def _on_nccl_completion(info: Any) -> None:
    # Runs on the group's hook thread: the enqueue time (host wall clock) and the GPU duration.
    record = (info.time_started.timestamp(), info.active_duration.total_seconds())
    with _lock:
        for clock in _installed:
            clock._nccl.append(record)


def _hook_nccl_groups() -> bool:
    """Hook every NCCL group of this process (registry of torch's: no public listing); False if none can be."""
    live = dist.distributed_c10d._world.pg_map
    for name in [n for n, g in _hooked.items() if g not in live]:  # destroyed (a sweep's earlier job): names recur
        del _hooked[name]
    for group in list(live):
        if group.group_name in _hooked or "nccl" not in str(dist.get_backend(group)):
            continue
        try:
            group._enable_collectives_timing()
            group._register_on_completion_hook(_on_nccl_completion)
        except (RuntimeError, ValueError) as err:
            log.warning("collective time of group %s is not measured (%s): it counts as compute", group, err)
            continue
        _hooked[group.group_name] = group
    return bool(_hooked)


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
        #: NCCL: each completed collective's (host enqueue time, GPU seconds).
        self._nccl: list[tuple[float, float]] = []

    def install(self) -> BatchClock:
        """Start observing collectives (the waits patched for the first clock, NCCL groups hooked once)."""
        with _lock:
            if not _installed:
                _patch_waits()
            _installed.append(self)
        self._thread = threading.get_ident()
        if self.device.type == "cuda" and dist.is_initialized() and not _hook_nccl_groups():
            log.warning("no NCCL group could be hooked: compute time includes the time spent in collectives")
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
        for group in _hooked.values():
            group._wait_for_pending_works()  # until every completed collective's hook has run
        batch_s = sum(start.elapsed_time(stop) for start, stop, _, _ in events) / 1e3
        with _lock:
            records, self._nccl = self._nccl, []
        return batch_s, in_intervals(records, [(a, b) for _, _, a, b in events])


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
