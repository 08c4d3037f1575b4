"""Run a console entry point as its ranks would run, forked from this process instead of started afresh.

A fresh interpreter pays ``import torch`` and ``import lightning`` again (~7.5 s on a 2-core
machine) for every process of every run, which is most of what a short training run costs. A
process forked from one that has already imported them starts at once. ``world_size`` ranks are
forked with the variables torchrun sets, so Lightning finds its TorchElastic environment and
launches nothing itself: what runs is the command line's own code, with the default
(``cluster=local``) config. Tests of the launchers themselves (Lightning's, torchrun, srun) start
real processes instead.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_ultrascale.testing.spawn import before_fork, free_port


@dataclass(frozen=True)
class Completed:
    """What a run left: its exit status (rank 0's, or the first failing rank's), and every rank's output."""

    returncode: int
    stdout: str
    stderr: str


def run_command(
    main: Callable[[], object],
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    world_size: int = 1,
    cwd: str | Path | None = None,
    timeout_s: float = 300.0,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
) -> Completed:
    """Run ``main()`` with ``sys.argv = argv`` and ``os.environ = env`` on ``world_size`` forked ranks.

    Each rank also gets torchrun's variables, or ``rank_env(rank)`` instead (e.g. SLURM's, as srun
    starts a job's tasks).

    Example:
        >>> out = run_command(lambda: print("hello"), ["prog"], {})
        >>> out.returncode, out.stdout
        (0, 'hello\\n')
    """
    before_fork()
    ctx, port = mp.get_context("fork"), free_port()
    with tempfile.TemporaryDirectory(prefix="ultrascale-command-") as tmp:
        procs = []
        for rank in range(world_size):
            if rank_env is not None:
                ranks = dict(rank_env(rank))
            else:
                ranks = {} if world_size == 1 else _torchrun_variables(rank, world_size, port)
            target = Path(tmp) / str(rank)
            proc = ctx.Process(target=_run, args=(main, list(argv), {**env, **ranks}, cwd, target))
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        codes = [proc.exitcode if proc.exitcode is not None else -9 for proc in procs]
        failed = next((c for c in codes if c != 0), 0)
        read = lambda rank, kind: (Path(tmp) / f"{rank}.{kind}").read_text(errors="replace")  # noqa: E731
        return Completed(
            failed,
            "".join(read(r, "out") for r in range(world_size)),
            "".join(read(r, "err") for r in range(world_size)),
        )


def _torchrun_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def _run(main: Callable[[], object], argv: list[str], env: dict[str, str], cwd: str | Path | None, to: Path) -> None:
    """A forked rank: its own environment, arguments, directory and output files; exits with main's status."""
    code = 1
    out, err = open(f"{to}.out", "w"), open(f"{to}.err", "w")
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        streams = {id(sys.stdout): out, id(sys.stderr): err, id(sys.__stdout__): out, id(sys.__stderr__): err}
        sys.stdout, sys.stderr = out, err
        for handler in _stream_handlers():  # they hold the parent's streams, some closed since: no flush
            handler.stream = streams.get(id(handler.stream), err)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv
        if cwd is not None:
            os.chdir(cwd)
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (out, err):
            stream.flush()
        os._exit(code)  # no atexit handlers of the parent (pytest's) in a forked child


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in logging.root.manager.loggerDict)]
    handlers = {id(h): h for lg in loggers for h in getattr(lg, "handlers", [])}
    return [h for h in handlers.values() if type(h) is logging.StreamHandler]
