"""A memo that lives for one planner search: the facts it derives from one meta model, computed once.

A search prices thousands of layouts of the same meta model, and each asks the plugins which
parameters a rank holds (``plan_shards``): the model's parameter shapes, its tied weights, the
pipeline's stage split and the tensor-parallel plan's shards, recomputed per layout, were most of
a 512-GPU search's time. Inside :func:`planning` they are computed once per model and key; outside
it :func:`memoized` just computes (a model may change between two calls there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["memoized", "planning"]

T = TypeVar("T")
_MEMO: ContextVar[dict[Hashable, Any] | None] = ContextVar("ultrascale_planning_memo", default=None)


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Memoize :func:`memoized` calls until the block ends (the models they name must not change in it).

    Example:
        >>> calls = []
        >>> def shapes():
        ...     calls.append(1)
        ...     return {"w": (2, 2)}
        >>> with planning():
        ...     _ = memoized(("shapes", 1), shapes), memoized(("shapes", 1), shapes)
        >>> len(calls)
        1
    """
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def memoized(key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, remembered under ``key`` inside :func:`planning` (keys name the model by ``id``)."""
    memo = _MEMO.get()
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]
