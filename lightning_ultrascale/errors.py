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


def require_positive_int(option: str, value: object) -> None:
    """Raise ``ConfigError("parallel.tp=0 must be a positive integer")`` unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{option}={value!r} must be a positive integer")


def nearby_multiples(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` just below and above ``value``, for "valid nearby: ..." parts.

    Example:
        >>> nearby_multiples(250, 4)
        '248, 252'
    """
    below = value - value % multiple
    return ", ".join(str(n) for n in (below, below + multiple) if n > 0)
