"""Warm gloo workers kept across jobs: :func:`run_pooled` runs a job on them, else on fresh processes.

A process that trains a layout for the first time pays for it: DTensor's sharding propagation
(one fake-tensor run per operator and placement), the corpus and model facts, Lightning's and
torch's first calls. Measured on the parity tests of tensor, pipeline, ZeRO and expert
parallelism: 20% of their time. Inside :func:`worker_pools`, :func:`run_pooled` runs each job on
``world_size`` processes that stay up between jobs (one set per world size, one process group
each), so the second job of a layout starts warm; outside it, and with ``fresh=True``, it is
:func:`run_workers`.

A pooled job must be a pure function of its arguments, like a parity run: the workers were
forked when the pool started, so they do not see what the parent changed since (a
``monkeypatch``, an environment variable: run such a test inside :func:`fresh_workers`). Between
jobs a worker restores its environment variables, working directory, warning filters and torch's
process-wide settings (default dtype, grad mode, deterministic algorithms, threads, the CPU random
state) and resets ``torch.compile``'s caches. Tests of the process itself (timeouts, crashes, hangs,
signals, peak RSS) belong on fresh processes. A job that raises, dies or hangs takes its pool
down (the other ranks may be blocked in a collective with it): the error is
:func:`run_workers`'s, and the next job starts a new pool.

Jobs travel with ``cloudpickle`` (lambdas and closures by value; functions of modules the
workers have imported, by reference), a test dependency (the ``dev`` extra).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from lightning_ultrascale.testing.spawn import (
    _collect,
    become_rank,
    before_fork,
    free_port,
    on_a_free_port,
    port_taken,
    run_workers,
)

#: The pools of the innermost :func:`worker_pools`, by world size; None outside one.
_pools: dict[int, _Pool] | None = None


def _forget_pools_in_child() -> None:
    # A forked process (a command's rank, a pooled worker) is a program of its own: the parent's pools
    # are not its to use (their pipes are the parent's) and the pools it would start must not outlive
    # it (it ends in ``os._exit``, past the exit of the ``worker_pools`` that would close them).
    global _pools
    _pools = None


os.register_at_fork(after_in_child=_forget_pools_in_child)

#: A worker reports its open file descriptors after each job; its pool is replaced beyond this many.
#: Every job's process groups (a mesh's dimensions) stay open: the warm sharding caches refer to them.
MAX_OPEN_FILES = 1000

#: The process group's timeout inside pooled workers; each job's own ``timeout_s`` is kept by the parent.
_GROUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def worker_pools() -> Iterator[None]:
    """Within it, :func:`run_pooled` keeps its workers between jobs; on exit they are killed.

    Example:
        >>> import torch.distributed as dist
        >>> def rank_and_pid():
        ...     return dist.get_rank(), os.getpid()
        >>> with worker_pools():
        ...     first, second = run_pooled(rank_and_pid, 2), run_pooled(rank_and_pid, 2)
        >>> [r for r, _ in first], first == second  # the same two processes both times
        ([0, 1], True)
    """
    global _pools
    outer, _pools = _pools, {}
    try:
        yield
    finally:
        pools, _pools = _pools, outer
        for pool in pools.values():
            pool.close()


@contextlib.contextmanager
def fresh_workers() -> Iterator[None]:
    """Within it, :func:`run_pooled` starts new processes (they see what the parent changed: a ``monkeypatch``).

    The enclosing :func:`worker_pools` keeps its workers for after it.
    """
    global _pools
    outer, _pools = _pools, None
    try:
        yield
    finally:
        _pools = outer


def run_pooled(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, fresh: bool = False, **kwargs: Any
) -> list[Any]:
    """:func:`run_workers`, on the warm workers of the enclosing :func:`worker_pools` if there is one.

    ``fresh=True`` (or no enclosing :func:`worker_pools`): new processes, as :func:`run_workers`.

    Raises:
        WorkerError: as :func:`run_workers`; the pool is then replaced at the next job.
    """
    if fresh or _pools is None:
        return run_workers(fn, world_size, *args, timeout_s=timeout_s, **kwargs)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    import cloudpickle  # (a test dependency: only pooled jobs need it)

    job = cloudpickle.dumps((os.getcwd(), fn, args, kwargs))  # run where the parent is now
    pool = _pools.get(world_size)
    if pool is None or not pool.usable:
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = on_a_free_port(lambda: _Pool(world_size), "the pooled workers")
    try:
        return pool.run(job, timeout_s)
    except BaseException:
        pool.close()  # a rank that failed may leave the others in a collective: none is reused
        raise


class _Pool:
    """``world_size`` forked workers in one gloo process group, running the jobs sent to them one at a time."""

    def __init__(self, world_size: int) -> None:
        before_fork()
        self.world_size, self.usable = world_size, True
        ctx = mp.get_context("fork")
        port = free_port()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_serve, args=(rank, world_size, port, child_end), name=f"ultrascale-pooled-{rank}", daemon=True
            )
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        try:  # every rank in the group before a job is sent (a rank that failed to join has exited)
            _collect(dict(zip(self.conns, range(world_size))), self.procs, _GROUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def run(self, job: bytes, timeout_s: float) -> list[Any]:
        for conn in self.conns:
            conn.send_bytes(job)
        # Each reply: (this rank's result, what _agree needs); spawn's collector raises for a rank that failed.
        replies = _collect(dict(zip(self.conns, range(self.world_size))), self.procs, timeout_s)
        healths = {rank: health for rank, (_, health) in replies.items()}
        self.usable = _agree(healths)
        return [replies[r][0] for r in range(self.world_size)]

    def close(self) -> None:
        """Kill the workers (a worker may be blocked in a collective: nothing waits for it)."""
        self.usable = False
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()


def _agree(healths: dict[int, dict[str, Any]]) -> bool:
    """Whether the workers may take another job: every group at one count on all its ranks, no failure, files left."""
    counts: dict[str, set[int]] = {}
    for health in healths.values():
        for group, issued in health["issued"].items():
            counts.setdefault(group, set()).add(issued)
    return (
        all(len(issued) == 1 for issued in counts.values())
        and not any(h["failed"] for h in healths.values())
        and all(h["open_files"] < MAX_OPEN_FILES for h in healths.values())
    )


def _serve(rank: int, world_size: int, port: int, conn: Connection) -> None:
    """A pooled worker: join the group, then run each job received and send back its result."""
    become_rank(rank, world_size, port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    except BaseException as err:
        # (another process bound the free port first, as run_workers also meets: the parent tries another)
        _reply(conn, ("port_taken", str(err)) if port_taken(err) else ("error", traceback.format_exc()))
        return
    _reply(conn, ("ready", None))
    import cloudpickle

    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:  # the parent is gone
            return
        environ, cwd, torch_state = dict(os.environ), os.getcwd(), _torch_state()
        try:
            with warnings.catch_warnings():
                where, fn, args, kwargs = cloudpickle.loads(job)
                os.chdir(where)
                result = fn(*args, **kwargs)
        except BaseException:
            _reply(conn, ("error", traceback.format_exc()))
            continue  # (the parent closes this pool)
        finally:
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            _restore_torch_state(torch_state)
            torch._dynamo.reset()  # compiled graphs and their counters start empty for the next job
        _reply(conn, ("ok", (result, _reusable())))


def _torch_state() -> tuple[Any, ...]:
    """torch's process-wide settings a job may change and not restore (it ran alone in a fresh process)."""
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
        torch.random.get_rng_state(),
    )


def _restore_torch_state(state: tuple[Any, ...]) -> None:
    dtype, grad, deterministic, threads, rng = state
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)


def _reusable() -> dict[str, Any]:
    """What the parent needs to decide whether this worker's group can take another job.

    The collectives each group has issued here (a job that ended with its ranks at different
    counts, e.g. after an error it caught, would pair the next job's collectives wrongly); whether
    a watchdog saw a rank fail (its keys stay in the store, and the next job's watchdog would end
    its rank); and how many files are open (every job's groups stay open).
    """
    from torch.distributed import distributed_c10d as c10d

    from lightning_ultrascale.core.watchdog import FAILURE_KEYS

    issued = {}
    for group in list(c10d._world.pg_map):
        with contextlib.suppress(Exception):  # (a group of other ranks, or one without the counter)
            issued[c10d._world.pg_names[group]] = group._get_sequence_number_for_group()
    store = c10d._get_default_store()
    failed = any(store.check([key]) for key in FAILURE_KEYS)
    open_files = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    return {"issued": issued, "failed": failed, "open_files": open_files}


def _reply(conn: Connection, message: tuple[Any, ...]) -> None:
    """Send with the tensors' data in the message (spawn.py's ``_send`` says why not ``conn.send``)."""
    try:
        data = pickle.dumps(message)
    except Exception:  # a result that does not pickle: say so, rather than die without a word
        data = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(data)
