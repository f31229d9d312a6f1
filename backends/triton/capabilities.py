"""What the Triton backend runs (SPEC §11 "Triton (ours)" row), and its probe."""
from __future__ import annotations

import os
import re

import torch
from dsv4.backend import OP_NAMES, Capabilities

__all__ = ["CAPABILITIES", "MIN_TRITON", "probe_reasons"]

# The oldest Triton every kernel compiles with, for every target (tools/target_compile.py; docs/triton.md
# "Twenty-second round"): 3.5 lacks gl.num_warps (the sm_90 Gluon kernels) and rejects the chunked top-k's
# arange; pyproject's extras ask for the same floor.
MIN_TRITON = (3, 6)

# Any arch Triton targets (CUDA, ROCm, XPU) and the CPU interpreter; any head count and top-k.
# Formats: see backends/triton/layout.py (fp8_e4m3 rows and Ascend int8 keys are not implemented,
# hence no "ascend" profile: its indexer quantization is int8).
CAPABILITIES = Capabilities(
    ops=frozenset(OP_NAMES),
    device_types=frozenset({"cuda", "xpu", "cpu"}),
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"fp8_ds_mla", "bf16", "ascend_bf16", "ascend_a5"}),
    indexer_key_formats=frozenset({"indexer_fp8", "indexer_mxfp4"}),
    q_head_counts=None,
    topk_alignment=1,
    supports_sink=True,
    returns_lse=True,
    profiles=frozenset({"deepseek", "vllm"}),
    cuda_graphs=True,
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def probe_reasons() -> list[str]:
    """Empty when triton imports and a GPU is present, or TRITON_INTERPRET=1 (CPU tensors then)."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return [f"triton is not importable: {type(exc).__name__}: {exc}"]
    version = getattr(triton, "__version__", "0")
    if _release(version) < MIN_TRITON:
        return [f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest its kernels compile with"]
    if _interpreting():
        return []
    if torch.cuda.is_available():  # CUDA and ROCm (HIP torch reports device type cuda)
        return []
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return []
    return ["no GPU (cuda/hip/xpu) is present and TRITON_INTERPRET=1 is not set"]


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "3.7.0+git1a2b" ((0,) where unreadable)."""
    m = re.match(r"(\d+)(?:\.(\d+))?", version)
    return tuple(int(g) for g in m.groups() if g is not None) if m else (0,)
