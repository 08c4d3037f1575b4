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

The first rank to fail also names who a hung collective waits for (``forensics.py``): it asks
every rank's watchdog for its recent collectives through the store, and each answers from its
own thread even while its main thread is stuck; the failing rank logs the hung collective and the
ranks that never arrived or skipped it, and writes every rank's answer to ``collective-hang.json``
in the run directory (the Trainer's ``default_root_dir``, which ``ultrascale-train`` sets to the run
directory; the working directory without a Trainer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_ultrascale.core.forensics import REPORT_FILE, diagnose, snapshot, summary, timed_out, write_report

log = logging.getLogger(__name__)

_ABORT = "ultrascale/abort"
_FAILED = "ultrascale/failed/"
_ENDED = "ultrascale/ended/"
_REPORTER = "ultrascale/reporter"  # the first failing rank; once set, every watchdog posts its collectives
_STATE = "ultrascale/collectives/"
#: What a failing rank leaves in the job's store (a process group kept for another job must not keep it).
FAILURE_KEYS = (_ABORT, _REPORTER)


class Watchdog:
    """Ends this rank's process when the job has failed elsewhere (see the module docstring).

    Args:
        store: the job's store (the default process group's).
        rank, world_size: this rank and the job's size.
        poll_s: how often the store is read.
        grace_s: how long an unreachable store (or the wait for fellow failures) is tolerated.
        report_dir: where the first failing rank writes ``collective-hang.json`` (default: the working directory).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        poll_s: float = 1.0,
        grace_s: float = 5.0,
        report_dir: str | Path | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_s, self.grace_s = poll_s, grace_s
        self.report_dir = Path(report_dir or ".")
        self._since_ns = time.time_ns()  # collectives of an earlier job in this process are not ours
        self._posted = False
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"ultrascale-watchdog-{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def fail(self, exception: BaseException) -> str:
        """Tell every rank that this one failed; return the message, which names the ranks that did not fail.

        The first rank to fail adds a second line: the hung collective and who never arrived (or skipped it).
        """
        self.stop()  # this rank is failing on its own account
        reason = (str(exception).strip().splitlines() or [type(exception).__name__])[0][:300]
        message = f"rank {self.rank} failed: {type(exception).__name__}: {reason}"
        try:
            self._post_soon(reason).join(timeout=self.grace_s)
            self.store.set(f"{_FAILED}{self.rank}", reason)
            reporter = self.store.compare_set(_REPORTER, "", str(self.rank)).decode() == str(self.rank)
            # Fellow ranks in the same timeout fail alike; the others' watchdogs post within poll_s.
            started = time.monotonic()
            wait_s = max(min(self.grace_s, 2.0), self.poll_s + 0.5 if reporter else 0.0)
            while time.monotonic() < started + wait_s and len(self._failed()) < self.world_size:
                time.sleep(0.1)
            if reporter:  # and every rank's post, which a loaded machine's watchdog may make later than poll_s
                states = [f"{_STATE}{r}" for r in range(self.world_size)]  # (one that never posts: gone or stuck)
                while time.monotonic() < started + max(self.grace_s, wait_s) and not self.store.check(states):
                    time.sleep(0.1)
            silent = [r for r in range(self.world_size) if r not in self._failed()]
            if silent:
                why = "hung, or waiting for it in a collective"
                message += f"; ranks that did not fail with it ({why}): {_ranks(silent)}"
            # Before the abort: the ranks it ends may include rank 0, which hosts the posted collectives.
            line = self._report(reason) if reporter else ""
            if not self.store.check([_ABORT]):
                self.store.set(_ABORT, message)
            message += line
            # Rank 0 hosts the store: keep it up until the silent ranks' watchdogs have read why
            # (they poll every poll_s), or they would only learn that their parent is gone.
            deadline = time.monotonic() + 2 * self.poll_s + 1.0
            while time.monotonic() < deadline and not all(self.store.check([f"{_ENDED}{r}"]) for r in silent):
                time.sleep(0.1)
        except Exception:  # the store may be gone already: this rank fails anyway
            pass
        return message

    def _post_soon(self, failed: str | None) -> threading.Thread:
        """:meth:`_post` on its own thread: NCCL's recorder queries CUDA events, which a broken GPU may not answer."""
        self._posted = True
        thread = threading.Thread(target=self._post, args=(failed,), name=f"ultrascale-post-{self.rank}", daemon=True)
        thread.start()
        return thread

    def _post(self, failed: str | None) -> None:
        """Post this rank's recent collectives for the reporting rank, and say them on this rank's stderr."""
        try:
            state = snapshot(self.rank, failed, self._since_ns)
        except Exception as err:  # torch's recorder is a private API: its loss must not stop the failure path
            state = {"rank": self.rank, "failed": failed, "records": [], "groups": {}, "error": repr(err)}
        with contextlib.suppress(Exception):  # the store may be gone: rank 0 ended
            self.store.set(f"{_STATE}{self.rank}", json.dumps(state))
        print(f"[rank {self.rank}] collectives: {summary(state)}", file=sys.stderr, flush=True)

    def _report(self, reason: str) -> str:
        """A line naming the hung collective and its absent ranks (and the report file), or nothing."""
        keys = [f"{_STATE}{r}" for r in range(self.world_size)]
        posted = [r for r, key in enumerate(keys) if self.store.check([key])]
        values = self.store.multi_get([keys[r] for r in posted]) if posted else []
        states: dict[int, dict[str, Any] | None] = dict.fromkeys(range(self.world_size))
        states.update({r: json.loads(v) for r, v in zip(posted, values)})
        found = diagnose(states, self.rank)
        if found is None:
            return ""
        line, details = found
        line = f"collective {'timed out' if timed_out(reason) else 'failed'}: {line}"
        try:
            where = write_report(self.report_dir / REPORT_FILE, line, details, states)
        except OSError as err:
            return f"\n{line} (every rank's collectives could not be written: {err})"
        return f"\n{line} (every rank's collectives: {where})"

    def _failed(self) -> set[int]:
        return {r for r in range(self.world_size) if self.store.check([f"{_FAILED}{r}"])}

    def _watch(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self._parent:
                self._end("the process that started this rank is gone")
            try:
                # A failing rank claims the report before it aborts: one read a poll while all is well.
                failing = self.store.check([_REPORTER])
                aborted = failing and self.store.check([_ABORT])
                if failing and not self._posted:
                    self._post_soon(None)
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
            trainer = self.lightning_module._trainer if self.lightning_module is not None else None
            run_dir = trainer.default_root_dir if trainer is not None else None  # ultrascale-train: the run directory
            self._watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), report_dir=run_dir).start()

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
