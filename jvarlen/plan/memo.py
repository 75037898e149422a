"""A bounded memo for the planner's pure functions (cost terms, tick tables).

A planning call simulates the same chunks, schedules and buckets many times, and a run plans on
the same cost models for thousands of iterations, so memos live on long-lived objects and must
not grow without end: :class:`BoundedMemo` empties itself when full (cheap, and a planning call's
working set is far below the limit, so what it reuses stays in). :func:`method_cache` keeps one
per object and method (``functools.lru_cache`` on a method keys one module-wide cache by ``self``
and so holds every object it saw: the planners' per-call cost objects, ~70 KB per FlexSP call on a
small instance, for the whole run).
"""

from __future__ import annotations

import functools
from typing import Callable

_PREFIX = "_memo_"


class BoundedMemo(dict):
    """A dict emptied when it reaches ``limit`` entries (no LRU bookkeeping)."""

    def __init__(self, limit: int = 1 << 16):
        super().__init__()
        self.limit = int(limit)

    def put(self, key, value):
        """Stores and returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


class MethodCaches:
    """Base of a class with :func:`method_cache` methods: pickles without its memos (an object sent
    to a planning worker starts with empty ones there)."""

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith(_PREFIX)}


def method_cache(limit: int = 1 << 16) -> Callable:
    """Memoizes a method of a :class:`MethodCaches` per object, in a :class:`BoundedMemo` of
    ``limit`` entries (its arguments must be hashable)."""

    def decorate(method: Callable) -> Callable:
        slot = _PREFIX + method.__name__

        @functools.wraps(method)
        def cached(self, *args, **kwargs):
            memo = self.__dict__.get(slot)
            if memo is None:
                memo = self.__dict__[slot] = BoundedMemo(limit)
            key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
            try:
                return memo[key]
            except KeyError:
                return memo.put(key, method(self, *args, **kwargs))

        return cached

    return decorate
