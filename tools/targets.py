"""The GPU targets that ``tools/target_isa.py`` and ``tools/target_compile.py`` compile for on a CPU: target name
-> (Triton backend, arch, warp size, the ``torch.cuda`` device properties that ``_common.facts_of`` reads).
No side effects on import (the tests import it beside the interpreter's kernels)."""
from __future__ import annotations

from types import SimpleNamespace

__all__ = ["CUDA_SMEM", "TARGETS"]

CUDA_SMEM = 232448  # shared_memory_per_block_optin of sm_90 / sm_100 / sm_103 (227 KiB)
TARGETS = {
    "sm_90": ("cuda", 90, 32, SimpleNamespace(major=9, minor=0, multi_processor_count=132,
                                              shared_memory_per_block_optin=CUDA_SMEM)),
    "sm_100": ("cuda", 100, 32, SimpleNamespace(major=10, minor=0, multi_processor_count=148,
                                                shared_memory_per_block_optin=CUDA_SMEM)),
    "sm_103": ("cuda", 103, 32, SimpleNamespace(major=10, minor=3, multi_processor_count=148,
                                                shared_memory_per_block_optin=CUDA_SMEM)),
    "sm_120": ("cuda", 120, 32, SimpleNamespace(major=12, minor=0, multi_processor_count=188,
                                                shared_memory_per_block_optin=101376)),
    "gfx950": ("hip", "gfx950", 64, SimpleNamespace(major=9, minor=5, multi_processor_count=256,
                                                   gcnArchName="gfx950:sramecc+:xnack-")),
    "gfx942": ("hip", "gfx942", 64, SimpleNamespace(major=9, minor=4, multi_processor_count=304,
                                                   gcnArchName="gfx942:sramecc+:xnack-")),
}
