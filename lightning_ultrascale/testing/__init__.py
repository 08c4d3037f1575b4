"""Tools for proving parallel layouts correct: a multi-process runner and a parity harness.

They live in the library, not under ``tests/``, because benchmarks and users' own tests need
them too.
"""

from lightning_ultrascale.testing.spawn import WorkerError, run_workers

__all__ = ["WorkerError", "run_workers"]
