"""Run a function on N gloo processes and collect what each returns.

Forking is ~40x faster than spawning (measured: 0.25 s vs 10 s for two processes), so workers
are forked from a parent that has already imported torch. Fork copies only the thread that calls
it: a parent with other threads hands its workers whatever those threads were halfway through.
``run_workers`` pins torch's intra-op pool to one thread and warns
(:class:`ForkWithThreadsWarning`, an error in this project's suite) when the parent has any
thread besides its main one. Seen so far: tokenizers' Rust thread pool after a batch encode
(``TOKENIZERS_PARALLELISM=false`` keeps it from starting), tqdm's monitor thread, and the
OpenMP pool that ``import torch`` starts unless ``OMP_NUM_THREADS=1`` is set before it.

A worker that dies of a signal (a native crash) writes every thread's Python stack first
(``faulthandler``, to a file per rank), and the parent's error carries it: where it happened.

Every worker initialises the default group with a timeout and always destroys it; a worker that
raises sends its traceback to the parent, which stops the others (they may be blocked in a
collective waiting for the dead rank) and raises :class:`WorkerError` with that rank's message.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_T = TypeVar("_T")


class WorkerError(RuntimeError):
    """A worker process raised, died or ran past its deadline."""


class ForkWithThreadsWarning(RuntimeWarning):
    """:func:`run_workers` forked a parent that runs threads besides its main one (see the module docstring)."""


def native_threads() -> int:
    """How many threads this process runs, native ones (OpenMP, Rust, C++) included (Python's own count off Linux).

    Example:
        >>> native_threads() >= 1
        True
    """
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own view
        import threading

        return threading.active_count()


def thread_names() -> str:
    """The threads besides the calling one: Python's names for the threads Python started, and the
    kernel's names (``/proc/self/task/*/comm``) of every other task, which native pools' threads show as.

    Example:
        >>> thread_names()
        'python: []; kernel: []'
    """
    import threading

    python = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
        kernel = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in tasks]
    except OSError:
        kernel = []
    return f"python: {python}; kernel: {kernel}"


def before_fork() -> None:
    """The parent's rules for forking (the module docstring), once before it forks workers: one intra-op
    thread (a fork after torch's intra-op pool started deadlocks the children), and
    :class:`ForkWithThreadsWarning` where another thread runs (blamed on the forking helper's caller)."""
    torch.set_num_threads(1)
    threads = native_threads()
    if threads > 1:
        warnings.warn(
            f"forking a parent that runs {threads - 1} thread(s) besides its main one ({thread_names()}); "
            "the forked processes "
            "inherit whatever those threads were halfway through (a heap a thread was changing: a crash in "
            "malloc). Known sources: tokenizers' thread pool (set TOKENIZERS_PARALLELISM=false), tqdm's "
            "monitor (tqdm.tqdm.monitor_interval = 0), the OpenMP pool of `import torch` (set "
            "OMP_NUM_THREADS=1 before importing torch), transformers' weight-loading pool after from_pretrained "
            "(set HF_DEACTIVATE_ASYNC_LOAD=1)",
            ForkWithThreadsWarning,
            stacklevel=3,
        )


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    """Send ``message`` to the parent with its tensors' data in it.

    Not ``conn.send``: torch makes multiprocessing's pickler put tensors in shared memory, which
    the parent maps only while this process lives, and a worker exits as soon as it has sent
    (measured: 50 of 50 receptions failed with ``FileNotFoundError``). Plain pickle copies them.
    """
    conn.send_bytes(pickle.dumps(message))


#: Where this process writes its stacks on a native crash (kept open while it lives).
_CRASH_LOG: Any = None


def become_rank(rank: int, world_size: int, port: int, crash_log: str | None = None) -> None:
    """In a forked worker: torchrun's variables for ``rank`` of ``world_size``, and a stack dump on a native
    crash, to ``crash_log`` (a file the parent reads into its error) or else to stderr."""
    global _CRASH_LOG
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # A native crash (SIGSEGV, SIGABRT from malloc's checks) writes every thread's Python stack first.
    _CRASH_LOG = open(crash_log, "w") if crash_log else sys.stderr  # (open while the process lives)
    faulthandler.enable(file=_CRASH_LOG, all_threads=True)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: Connection,
    crash_log: str,
) -> None:
    become_rank(rank, world_size, port, crash_log)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        except Exception as err:
            if port_taken(err):
                _send(conn, ("port_taken", str(err)))  # (fn has not run: the parent may try another port)
                return
            raise
        result = fn(*args, **kwargs)
        _send(conn, ("ok", result))
    except BaseException:  # report everything, KeyboardInterrupt included, then die
        _send(conn, ("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked gloo processes; return results by rank.

    Inside ``fn`` the default process group exists and ``RANK``/``WORLD_SIZE``/``MASTER_*`` are set,
    as under torchrun. Results travel back pickled, tensors with their data.

    Example:
        >>> import torch.distributed as dist
        >>> def rank_sum():
        ...     t = torch.ones(1) * dist.get_rank()
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> run_workers(rank_sum, 2)
        [1.0, 1.0]

    Raises:
        WorkerError: a worker raised (its traceback is in the message), died without a word, or
            the run passed ``timeout_s`` (the ranks still running are named).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    before_fork()
    return on_a_free_port(lambda: _run_once(fn, world_size, free_port(), timeout_s, args, kwargs), "the workers")


_PORT_ATTEMPTS = 3


def on_a_free_port(start: Callable[[], _T], what: str) -> _T:
    """``start()`` (workers that pick a free port and join a group there), again where :class:`_PortTaken` says
    another process bound the port between ``free_port()`` and rank 0's store: up to :data:`_PORT_ATTEMPTS` tries."""
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return start()
        except _PortTaken:
            if attempt == _PORT_ATTEMPTS - 1:
                raise WorkerError(f"no free port for {what}' store after {_PORT_ATTEMPTS} tries") from None
    raise AssertionError("unreachable")


def port_taken(err: BaseException) -> bool:
    """Whether joining a process group failed because rank 0's store port was taken."""
    return "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()


class _PortTaken(Exception):
    """Rank 0's store found its port taken before the workers ran anything."""


def _run_once(
    fn: Callable[..., Any], world_size: int, port: int, timeout_s: float, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Any]:
    ctx = mp.get_context("fork")
    procs: list[mp.process.BaseProcess] = []
    conns: dict[Connection, int] = {}
    with tempfile.TemporaryDirectory(prefix="ultrascale-ranks-") as logs:
        crash_logs = {rank: os.path.join(logs, f"rank{rank}.stacks") for rank in range(world_size)}
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, port, timeout_s, args, kwargs, child_end, crash_logs[rank]),
                name=f"ultrascale-worker-{rank}",
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns[parent_end] = rank
        try:
            results = _collect(conns, procs, timeout_s, crash_logs)
        finally:
            _stop(procs)
    return [results[r] for r in range(world_size)]


def _stop(procs: list[mp.process.BaseProcess]) -> None:
    """Join every worker; kill those still running after 5 s in all (blocked in a collective with a dead rank)."""
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(
    conns: dict[Connection, int],
    procs: list[mp.process.BaseProcess],
    timeout_s: float,
    crash_logs: dict[int, str] | None = None,
) -> dict[int, Any]:
    """Every rank's result, or a :class:`WorkerError` for the first rank that raised, died or hung (a rank
    that died of a signal: with the stacks it wrote to its ``crash_logs`` file)."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while conns:
        ready = wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise WorkerError(
                f"timed out after {timeout_s:.0f}s waiting for ranks {sorted(conns.values())} "
                f"of {world_size} (a hang in a collective, or a too-small timeout_s)"
            )
        for conn in ready:
            rank = conns.pop(conn)  # type: ignore[call-overload]
            try:
                # A message from a process this one forked, in memory: unpickled as multiprocessing does.
                status, payload = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
            except EOFError:
                # The pipe closes a moment before the process is reaped: wait for its exit code.
                procs[rank].join(timeout=10)
                died = f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                stacks = _read_text((crash_logs or {}).get(rank))
                raise WorkerError(died + (f"; its stacks when it died:\n{stacks}" if stacks else "")) from None
            if status == "error":
                raise WorkerError(f"rank {rank} of {world_size} raised:\n{payload}")
            if status == "port_taken":
                raise _PortTaken(payload)
            results[rank] = payload
    return results


def _read_text(path: str | None) -> str:
    try:
        return Path(path).read_text().strip() if path else ""
    except OSError:
        return ""
