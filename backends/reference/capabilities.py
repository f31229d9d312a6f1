"""What the reference backend supports: everything, on any device (SPEC §6.6, §9, §11)."""
from __future__ import annotations

import torch
from dsv4.backend import OP_NAMES, Capabilities

__all__ = ["CAPABILITIES"]

# Every op, device, format, head count and profile: the reference is plain torch. It accepts
# float64 activations too (the ideal of ARCHITECTURE.md §3) and float32 for convenience.
CAPABILITIES = Capabilities(
    ops=frozenset(OP_NAMES),
    device_types=None,
    dtypes=frozenset({torch.bfloat16, torch.float32, torch.float64}),
    kv_formats=None,
    indexer_key_formats=None,
    q_head_counts=None,
    topk_alignment=1,
    supports_sink=True,
    returns_lse=True,
    profiles=None,
    cuda_graphs=False,
)
