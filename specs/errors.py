"""The one error family of dsv4 (SPEC §12).

Every error names the argument, what was expected and what came::

    raise DSV4ValueError.of("positions", "dtype torch.int64", positions.dtype)
    # -> positions: expected dtype torch.int64, got torch.int32

``DSV4ValueError`` and ``DSV4TypeError`` subclass ``ValueError``/``TypeError`` so that callers that
catch the builtin types keep working.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "BackendUnavailableError",
    "CacheLayoutError",
    "ConfigError",
    "DSV4Error",
    "DSV4TypeError",
    "DSV4ValueError",
    "NoBackendError",
    "format_expectation",
]


def format_expectation(argument: str, expected: str, received: Any, hint: str = "") -> str:
    """``"<argument>: expected <expected>, got <received>[; <hint>]"``."""
    message = f"{argument}: expected {expected}, got {received}"
    return f"{message}; {hint}" if hint else message


class DSV4Error(Exception):
    """Base of every error raised by dsv4."""

    def __init__(self, message: str, *, argument: str | None = None, expected: Any = None, received: Any = None):
        super().__init__(message)
        self.argument = argument
        self.expected = expected
        self.received = received

    @classmethod
    def of(cls, argument: str, expected: str, received: Any, hint: str = "") -> DSV4Error:
        """Build the error from its three parts (and an optional hint)."""
        return cls(format_expectation(argument, expected, received, hint),
                   argument=argument, expected=expected, received=received)


class DSV4ValueError(DSV4Error, ValueError):
    """A value (shape, range, layout, configuration) is not what the contract needs."""


class DSV4TypeError(DSV4Error, TypeError):
    """A dtype or Python type is not what the contract needs."""


class ConfigError(DSV4ValueError):
    """A model configuration cannot describe a DSV4 attention layer (SPEC §1-§2)."""


class CacheLayoutError(DSV4ValueError):
    """A cache format, page size, profile tag or layout disagrees between writer and reader (SPEC §9, §12)."""


class BackendUnavailableError(DSV4Error, RuntimeError):
    """A backend was asked for but cannot run here (its probe says why). A ``RuntimeError``: the
    machine (hardware, vendor package), not an argument, is what is missing."""


class NoBackendError(DSV4ValueError, RuntimeError):
    """No backend fits an op request; the message lists every candidate with its reasons. A
    ``ValueError`` (the request's values: format, heads, top-k, device) and, as before, a ``RuntimeError``."""
