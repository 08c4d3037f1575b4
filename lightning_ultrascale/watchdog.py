"""No orphan ranks: when one rank of a job fails, every rank ends within a few seconds, whatever it is doing.

A rank that fails (an exception, a collective timing out) writes why into the job's rendezvous
store, waits a moment for other ranks to fail with it, and names the ranks that did not: the ones
hung outside any collective, which a timeout never reaches. Every rank runs a daemon thread that
polls the store and ends its process (``os._exit``) once a failure is written, once the store is
gone for longer than a grace period (rank 0, which hosts it, died), or once the process that
started it is gone (Lightning's launcher starts ranks 1.. from rank 0). The thread runs while the
main thread is stuck in Python, which is exactly the rank that would otherwise live on holding
its memory (on a GPU node, the GPU) after the job has failed. torchrun's agent and SLURM's srun
also end the other ranks of a failed job; this covers Lightning's own launcher and any rank
that ignores SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

log = logging.getLogger(__name__)

_ABORT = "ultrascale/abort"
_FAILED = "ultrascale/failed/"
_ENDED = "ultrascale/ended/"


class Watchdog:
    """Ends this rank's process when the job has failed elsewhere (see the module docstring).

    Args:
        store: the job's store (the default process group's).
        rank, world_size: this rank and the job's size.
        poll_s: how often the store is read.
        grace_s: how long an unreachable store (or the wait for fellow failures) is tolerated.
    """

    def __init__(self, store: Any, rank: int, world_size: int, poll_s: float = 1.0, grace_s: float = 5.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_s, self.grace_s = poll_s, grace_s
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"ultrascale-watchdog-{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def fail(self, exception: BaseException) -> str:
        """Tell every rank that this one failed; return the message, which names the ranks that did not fail."""
        self.stop()  # this rank is failing on its own account
        reason = (str(exception).strip().splitlines() or [type(exception).__name__])[0][:300]
        try:
            self.store.set(f"{_FAILED}{self.rank}", reason)
            deadline = time.monotonic() + min(self.grace_s, 2.0)  # fellow ranks in the same timeout fail alike
            while time.monotonic() < deadline and len(self._failed()) < self.world_size:
                time.sleep(0.1)
            silent = [r for r in range(self.world_size) if r not in self._failed()]
            message = f"rank {self.rank} failed: {type(exception).__name__}: {reason}"
            if silent:
                why = "hung, or waiting for it in a collective"
                message += f"; ranks that did not fail with it ({why}): {_ranks(silent)}"
            if not self.store.check([_ABORT]):
                self.store.set(_ABORT, message)
            # Rank 0 hosts the store: keep it up until the silent ranks' watchdogs have read why
            # (they poll every poll_s), or they would only learn that their parent is gone.
            deadline = time.monotonic() + 2 * self.poll_s + 1.0
            while time.monotonic() < deadline and not all(self.store.check([f"{_ENDED}{r}"]) for r in silent):
                time.sleep(0.1)
        except Exception:  # the store may be gone already: this rank fails anyway
            message = f"rank {self.rank} failed: {type(exception).__name__}: {reason}"
        return message

    def _failed(self) -> set[int]:
        return {r for r in range(self.world_size) if self.store.check([f"{_FAILED}{r}"])}

    def _watch(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self._parent:
                self._end("the process that started this rank is gone")
            try:
                aborted = self.store.check([_ABORT])
                unreachable_since = None
            except Exception:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > self.grace_s:
                    self._end("the job's store (hosted by rank 0) is gone: rank 0 ended")
                continue
            if aborted:
                why = self.store.get(_ABORT).decode()
                with contextlib.suppress(Exception):
                    self.store.set(f"{_ENDED}{self.rank}", "")
                self._end(why)

    def _end(self, why: str) -> None:
        if self._stop.is_set():  # stopped meanwhile: the job is ending normally
            return
        print(f"[rank {self.rank}] lightning_ultrascale watchdog: ending this rank: {why}", file=sys.stderr, flush=True)
        os._exit(1)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


class WatchedRanks(ModelParallelStrategy):
    """The strategy's part: a watchdog on every rank of a multi-process job."""

    _watchdog: Watchdog | None = None

    @override
    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        if self._watchdog is None and dist.get_world_size() > 1:
            store = dist.distributed_c10d._get_default_store()
            self._watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size()).start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._watchdog is not None:
            log.error("%s", self._watchdog.fail(exception))
            self._watchdog = None

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            # Every rank gets here before any stops watching: none ends while another still finishes.
            self.barrier()
            self._watchdog.stop()
            self._watchdog = None
        super().teardown()
