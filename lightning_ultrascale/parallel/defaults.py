"""What a strategy runs for a technique the user did not list: plain data parallelism for the data dim."""

from __future__ import annotations

from lightning_ultrascale.parallel.data import DataParallel
from lightning_ultrascale.parallel.plugin import ParallelPlugin


def with_defaults(plugins: tuple[ParallelPlugin, ...]) -> tuple[ParallelPlugin, ...]:
    """``plugins`` plus :class:`DataParallel` over the ranks left over, when no plugin owns the data dims.

    Example:
        >>> with_defaults(())
        (DataParallel(stage=0, dp_replicate=None),)
    """
    if any(p.applies_at == "data" for p in plugins):
        return plugins
    return (*plugins, DataParallel())
