"""What the Intel XPU backend can run, as data (SPEC §11; research: vendor_backends.md §3).

torch's XPU device + Triton (vLLM 0.33's ``triton_bf16_mla_sparse_interface``): fp8_ds_mla caches
through a bf16 workspace, any head count, index widths padded to a multiple of 16. vLLM drops the
sink on XPU; this backend applies it from the kernel's LSE (SPEC §7), so ``supports_sink`` holds.
"""
from __future__ import annotations

import torch
from dsv4.backend import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"xpu"}),
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"fp8_ds_mla"}),
    topk_alignment=1,  # padded inside to the kernel's 16
    supports_sink=True,
    returns_lse=True,
    cuda_graphs=False,
)
