"""Errors raised by lightning_ultrascale, and how they name the setting at fault.

Every configuration error names the option, the value it got and what would be valid, and is
raised before any process group exists, so that a 512-GPU job fails in seconds with one readable
line instead of a hang. A setting is named the way its user wrote it: the constructor argument in
Python (``TensorParallel(size=3)``), the config key under the CLI (``parallel.tp=3``), which
renders the same message inside :func:`config_keys`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

_NO_KEYS: Mapping[tuple[str, str], str] = {}
_KEYS: ContextVar[Mapping[tuple[str, str], str]] = ContextVar("ultrascale_config_keys", default=_NO_KEYS)


class ConfigError(ValueError):
    """A setting that cannot work: ``TensorParallel(size=3) must divide n_kv_heads=8; valid: 1, 2, 4, 8``."""


class ContractError(TypeError):
    """A model or batch lacks what the chosen layout needs; the message lists each missing hook."""


#: A user's mistake in a setting, a model or a batch: the command line prints it as one line, no traceback.
USER_ERRORS = (ConfigError, ContractError)


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


def is_positive_int(value: object) -> bool:
    """Whether ``value`` is an int >= 1; a bool is not (``True`` would pass as 1).

    Example:
        >>> is_positive_int(2), is_positive_int(0), is_positive_int(True), is_positive_int(2.0)
        (True, False, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def require_positive_int(owner: object, name: str, value: object) -> None:
    """Raise ``ConfigError("TensorParallel(size=0) must be a positive integer")`` unless ``value`` is an int >= 1."""
    if not is_positive_int(value):
        raise ConfigError(f"{option(owner, name, value)} must be a positive integer")


def nearby_multiples(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` just below and above ``value``, for "valid nearby: ..." parts.

    Example:
        >>> nearby_multiples(250, 4)
        '248, 252'
    """
    below = value - value % multiple
    return ", ".join(str(n) for n in (below, below + multiple) if n > 0)


# ----------------------------------------------------------------------------- command lines
class UsageError(SystemExit):
    """``prog: message`` for a setting, model or batch that cannot work; exit status 2, as argparse's.

    Example:
        >>> str(UsageError("ultrascale-train", "parallel.tp=3 must divide n_heads=4; valid: 1, 2, 4"))
        'ultrascale-train: parallel.tp=3 must divide n_heads=4; valid: 1, 2, 4'
    """

    def __init__(self, prog: str, error: BaseException | str) -> None:
        super().__init__(2)
        self.message = f"{prog}: {error}"
        self.printed = False

    def __str__(self) -> str:
        return self.message


def user_error(err: BaseException | None) -> BaseException | None:
    """``err`` or the user error (:data:`~lightning_ultrascale.errors.USER_ERRORS`) it was raised from.

    OmegaConf wraps what its resolvers raise, Hydra what a job raises.
    """
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, USER_ERRORS):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


@contextlib.contextmanager
def reported(prog: str) -> Iterator[None]:
    """Turn a user error inside into a :class:`UsageError`, printed on stderr once."""
    try:
        try:
            yield
        except UsageError:
            raise
        except Exception as err:
            cause = user_error(err)
            if cause is None:
                raise
            raise UsageError(prog, cause) from None
    except UsageError as usage:
        if not usage.printed:  # (an inner reported() may have printed it already)
            print(usage, file=sys.stderr, flush=True)
            usage.printed = True
        raise
