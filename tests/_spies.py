"""A spy shared by test folders (``tests/`` is on ``sys.path``: its conftest is loaded first)."""
from __future__ import annotations

from typing import Any


def first_args(monkeypatch: Any, owner: Any, name: str) -> list:
    """``owner.name`` still runs; each call's first argument is appended to the returned list."""
    real, seen = getattr(owner, name), []

    def spy(first, *args, **kwargs):
        seen.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen
