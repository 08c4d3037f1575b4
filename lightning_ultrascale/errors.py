"""Errors raised by lightning_ultrascale, and how they name the setting at fault.

Every configuration error names the option, the value it got and what would be valid, and is
raised before any process group exists, so that a 512-GPU job fails in seconds with one readable
line instead of a hang. A setting is named the way its user wrote it: the constructor argument in
Python (``TensorParallel(size=3)``), the config key under the CLI (``parallel.tp=3``), which
renders the same message inside :func:`config_keys`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

_NO_KEYS: Mapping[tuple[str, str], str] = {}
_KEYS: ContextVar[Mapping[tuple[str, str], str]] = ContextVar("ultrascale_config_keys", default=_NO_KEYS)


class ConfigError(ValueError):
    """A setting that cannot work: ``TensorParallel(size=3) must divide n_kv_heads=8; valid: 1, 2, 4, 8``."""


def option(owner: object, name: str, value: object) -> str:
    """A setting as an error names it: ``Owner(name=value)``, or ``key=value`` where a config key is known.

    ``owner`` is the object (its class names it) or the class name.

    Example:
        >>> option("TensorParallel", "size", 3)
        'TensorParallel(size=3)'
        >>> with config_keys({("TensorParallel", "size"): "parallel.tp"}):
        ...     option("TensorParallel", "size", 3)
        'parallel.tp=3'
    """
    owner_name = owner if isinstance(owner, str) else type(owner).__name__
    key = _KEYS.get().get((owner_name, name))
    return f"{key}={value!r}" if key else f"{owner_name}({name}={value!r})"


@contextlib.contextmanager
def config_keys(keys: Mapping[tuple[str, str], str]) -> Iterator[None]:
    """Inside this block errors name ``(owner class, argument)`` settings by their config ``keys``."""
    token = _KEYS.set({**_KEYS.get(), **keys})
    try:
        yield
    finally:
        _KEYS.reset(token)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, for "valid: ..." parts of error messages."""
    return [d for d in range(1, n + 1) if n % d == 0]


def require_positive_int(owner: object, name: str, value: object) -> None:
    """Raise ``ConfigError("TensorParallel(size=0) must be a positive integer")`` unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{option(owner, name, value)} must be a positive integer")


def nearby_multiples(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` just below and above ``value``, for "valid nearby: ..." parts.

    Example:
        >>> nearby_multiples(250, 4)
        '248, 252'
    """
    below = value - value % multiple
    return ", ".join(str(n) for n in (below, below + multiple) if n > 0)
