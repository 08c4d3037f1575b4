"""Context parallelism: ring, zig-zag ring and all-to-all attention over the ``cp`` mesh dim."""

from lightning_ultrascale.parallel.context.parallel import ContextParallel

__all__ = ["ContextParallel"]
