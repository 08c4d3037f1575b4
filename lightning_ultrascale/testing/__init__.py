"""Tools for proving parallel layouts correct: a multi-process runner and a parity harness.

They live in the library, not under ``tests/``, because benchmarks and users' own tests need
them too.
"""

from lightning_ultrascale.testing.spawn import ForkWithThreadsWarning, WorkerError, run_workers

__all__ = ["ForkWithThreadsWarning", "WorkerError", "run_workers"]
