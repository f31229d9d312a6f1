"""Triton backend tests run under the CPU interpreter (TRITON_INTERPRET=1), set before triton loads."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
