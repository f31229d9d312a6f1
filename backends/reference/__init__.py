"""The reference backend: ``dsv4.reference`` (plain torch, any device) behind the Backend interface.

It is the bar every other backend is measured against, the CPU default, and the float64 ideal
when given float64 inputs. Registered through the ``reference`` entry point like any plugin.
"""
from __future__ import annotations

from collections.abc import Callable

from dsv4.backend import Backend
from dsv4.backends.reference.backend import ReferenceBackend
from dsv4.backends.reference.capabilities import CAPABILITIES
from dsv4.hookspecs import hookimpl

__all__ = ["CAPABILITIES", "ReferenceBackend", "dsv4_register_backends"]


@hookimpl
def dsv4_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the one reference backend."""
    register(ReferenceBackend())
