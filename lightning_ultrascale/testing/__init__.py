"""Tools for proving parallel layouts correct: a multi-process runner and a parity harness.

They live in the library, not under ``tests/``, because benchmarks and users' own tests need
them too.
"""

from lightning_ultrascale.testing.pool import fresh_workers, run_pooled, worker_pools
from lightning_ultrascale.testing.spawn import ForkWithThreadsWarning, WorkerError, run_workers

__all__ = ["ForkWithThreadsWarning", "WorkerError", "fresh_workers", "run_pooled", "run_workers", "worker_pools"]
