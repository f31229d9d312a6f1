"""A cache for the planner tests, which run no layer: each step counts as written by every layer as soon
as it is planned (a plain ``PagedKVCache`` refuses to plan a request past a step some layer has not run)."""
from __future__ import annotations

from dsv4 import PagedKVCache


class PlannedOnly(PagedKVCache):
    """``PagedKVCache`` whose ``plan_step`` also calls ``mark_written(step)`` (every layer)."""

    def plan_step(self, requests, **kwargs):
        step = super().plan_step(requests, **kwargs)
        self.mark_written(step)
        return step
