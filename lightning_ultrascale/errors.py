"""Errors raised by lightning_ultrascale.

Every configuration error names the option, the value it got and what would be valid, and is
raised before any process group exists, so that a 512-GPU job fails in seconds with one readable
line instead of a hang.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work, e.g. ``ConfigError("parallel.tp=3 must divide n_kv_heads=8; valid: 1, 2, 4, 8")``."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, for "valid: ..." parts of error messages."""
    return [d for d in range(1, n + 1) if n % d == 0]
