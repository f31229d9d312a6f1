"""The Triton backend: one set of kernels for NVIDIA, ROCm, Intel XPU and the CPU interpreter.

Kernel modules (and ``triton`` itself) are imported on first use, so this entry point loads
even where Triton is missing; ``probe()`` then says why it cannot run.
"""
from __future__ import annotations

from collections.abc import Callable

from dsv4.backend import Backend
from dsv4.backends.triton.backend import TritonBackend
from dsv4.backends.triton.capabilities import CAPABILITIES
from dsv4.hookspecs import hookimpl

__all__ = ["CAPABILITIES", "TritonBackend", "dsv4_register_backends"]


@hookimpl
def dsv4_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the one Triton backend (even when its probe fails; the probe explains)."""
    register(TritonBackend())
