"""What the FlashMLA backend can run, as data (SPEC §11, research: reference_and_flashmla.md §B4).

FlashMLA's DSV4 ("MODEL1") sparse kernels: sm_90a and sm_100f only, 64 or 128 query heads
(fewer are padded), the fp8_ds_mla cache (SPEC §9.1), decode top-k widths a multiple of 64
(prefill widths 128, handled inside the backend), the sink, a real LSE.
"""
from __future__ import annotations

import torch
from dsv4.backend import Capabilities

__all__ = ["CAPABILITIES", "SUPPORTED_ARCHS"]

# device_arch() names: sm_90 (H100/H200/H800, built as sm_90a), sm_100 / sm_103 (the sm_100f family).
SUPPORTED_ARCHS = frozenset({"sm_90", "sm_100", "sm_103"})

CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"cuda"}),
    archs=SUPPORTED_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"fp8_ds_mla"}),
    q_head_padding=(64, 128),
    topk_alignment=1,  # any width: the backend pads with -1 to the kernel's 64 / 128
    supports_sink=True,
    returns_lse=True,
    profiles=None,
    cuda_graphs=True,  # H200: tools/check_flashmla.py graph rows, bench_layer graph == eager (its schedule: attention.py)
)
