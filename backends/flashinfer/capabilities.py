"""What the FlashInfer backends can run, as data (SPEC §11; research: vendor_backends.md §4).

``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` (flashinfer-python 0.7.2.post1):
- SM10x (sm_100 / sm_103 / sm_107, trtllm-gen cubins): plain rows, ``bf16`` or per-tensor
  ``fp8_e4m3``; fp8_ds_mla is refused. One combined table. 8/16/32/64/128 heads (padded).
- SM12x (sm_120 / sm_121, packed ``sparse`` backend): ``fp8_ds_mla`` pools, separate tables.
Neither path returns an LSE. sm_90 has no FlashInfer DSV4 path (FlashMLA serves it).
"""
from __future__ import annotations

import torch
from dsv4.backend import Capabilities

__all__ = ["SM100_ARCHS", "SM100_CAPABILITIES", "SM120_ARCHS", "SM120_CAPABILITIES"]

SM100_ARCHS = frozenset({"sm_100", "sm_103", "sm_107"})
SM120_ARCHS = frozenset({"sm_120", "sm_121"})

SM100_CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"cuda"}),
    archs=SM100_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"bf16", "fp8_e4m3"}),
    q_head_padding=(8, 16, 32, 64, 128),
    topk_alignment=1,  # the backend pads the compressed columns to a multiple of 4
    supports_sink=True,
    returns_lse=False,
    cuda_graphs=False,
)

SM120_CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"cuda"}),
    archs=SM120_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset({"fp8_ds_mla"}),
    q_head_padding=(8, 16, 32, 64, 128),
    topk_alignment=1,
    supports_sink=True,
    returns_lse=False,
    cuda_graphs=False,
)
