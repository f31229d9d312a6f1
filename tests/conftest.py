"""Session setup shared by every test: on a machine without a GPU the Triton backend runs under the CPU
interpreter, arranged here exactly as ``dsv4-conformance`` arranges it for itself, before any test imports a
kernel module (their constants read TRITON_INTERPRET at import), so every subset of the suite sees one mode."""
from __future__ import annotations

from dsv4.conformance.usage import interpret_triton_without_gpu

interpret_triton_without_gpu()
