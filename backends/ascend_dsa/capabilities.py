"""What the AscendDSA backend can run, as data (SPEC §11; research: vendor_backends.md §1).

vllm-ascend's ``_C_ascend.npu_sparse_attn_sharedkv`` (A2/A3: 910B / 910_93, bf16 rows) and
``npu_kv_quant_sparse_attn_sharedkv`` (A5: 950, fp8 token records): 64 query heads (A5: 64 or
128), compressed top-k 512 (A5: 512 or 1024), the sink required, no LSE, a tiling-metadata op
per step, numerics profile ``ascend`` (Hadamard on in the indexer).
"""
from __future__ import annotations

import torch
from dsv4.backend import Capabilities

__all__ = ["A2A3_ARCHS", "A5_ARCHS", "CAPABILITIES"]

A2A3_ARCHS = frozenset({"ascend910b", "ascend910_93"})
A5_ARCHS = frozenset({"ascend950"})

CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"npu"}),
    archs=A2A3_ARCHS | A5_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"ascend_bf16", "ascend_a5"}),
    q_head_counts=frozenset({64, 128}),
    topk_alignment=512,
    supports_sink=True,
    returns_lse=False,
    profiles=frozenset({"ascend"}),
    cuda_graphs=False,
)
