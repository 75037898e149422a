"""A bounded memo for the planner's pure functions (cost terms, tick tables).

A planning call simulates the same chunks, schedules and buckets many times, and a run plans on
the same cost models for thousands of iterations, so memos live on long-lived objects and must
not grow without end: :class:`BoundedMemo` empties itself when full (cheap, and a planning call's
working set is far below the limit, so what it reuses stays in).
"""

from __future__ import annotations


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
