"""What the AITER backend can run, as data (SPEC §11; research: vendor_backends.md §2).

AITER's Triton sparse MLA fast path: gfx950 only (gfx942 writes its SWA cache in FNUZ e4m3,
which fp8_ds_mla here, OCP, does not describe), fp8_ds_mla caches, any head count (no padding),
ragged CSR indices, the sink; no LSE. It does not scrub NaN: caches must come from the
canonical writer (vLLM disables it when a KV connector is configured).
"""
from __future__ import annotations

import torch
from dsv4.backend import Capabilities

__all__ = ["CAPABILITIES", "SUPPORTED_ARCHS"]

SUPPORTED_ARCHS = frozenset({"gfx950"})

CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"cuda"}),   # ROCm torch reports device type "cuda"
    archs=SUPPORTED_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"fp8_ds_mla"}),
    topk_alignment=1,
    supports_sink=True,
    returns_lse=False,
    cuda_graphs=False,
)
