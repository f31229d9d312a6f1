"""What the AscendDSA backend can run, as data (SPEC §11; research: vendor_backends.md §1.3, §1.7).

vllm-ascend's ``_C_ascend.npu_sparse_attn_sharedkv`` (A2/A3: 910B / 910_93, ``ascend_bf16`` rows) and
``npu_kv_quant_sparse_attn_sharedkv`` (A5: 950, ``ascend_a5`` token records), each with its
``*_metadata`` tiling op. Per the operators' READMEs: 64 query heads (A5: 64 or 128), compressed
top-k width 512 (A5: 512 or 1024), the sink required, no LSE, the SWA band ``ori_win_left = 127``,
page sizes a multiple of 16 and at most 1024 (tiling check). Numerics profile ``ascend``.

The op request carries the compressed-table width but not the layer kind, so the top-k rule
also admits HCA lists (dense over the compressed entries, widths a multiple of 128 from
``dsv4.metadata``): an HCA list runs dense whatever its width; a CSA top-k must have one of the
widths above (see ``AscendFamily.topk_widths``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from dsv4.backend import Capabilities, OpRequest
from dsv4.metadata import INDEX_ALIGNMENT
from dsv4.specs.errors import CacheLayoutError

__all__ = [
    "A2A3",
    "A2A3_ARCHS",
    "A5",
    "A5_ARCHS",
    "BLOCK_SIZE_MULTIPLE",
    "CAPABILITIES",
    "FAMILIES",
    "MAX_BLOCK_SIZE",
    "WINDOW",
    "AscendFamily",
    "family_for",
    "request_reasons",
]

A2A3_ARCHS = frozenset({"ascend910b", "ascend910_93"})
A5_ARCHS = frozenset({"ascend950"})

# The operators' SWA band: ori_mask_mode 4 with ori_win_left = WINDOW - 1 = 127 (README: required),
# ori_win_right 0. SPEC §1: the model's sliding window is 128 tokens including the query.
WINDOW = 128
# Tiling check of the sparse-attention ops: kernel page sizes a multiple of 16, at most 1024.
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class AscendFamily:
    """One Ascend generation: its cache format, head counts, top-k widths and operator names."""

    name: str
    archs: frozenset[str]
    kv_format: str
    q_heads: frozenset[int]
    topk_widths: frozenset[int]
    op: str
    metadata_op: str
    quantized_kv: bool


A2A3 = AscendFamily("A2/A3", A2A3_ARCHS, "ascend_bf16", frozenset({64}), frozenset({512}),
                    "npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata", False)
A5 = AscendFamily("A5", A5_ARCHS, "ascend_a5", frozenset({64, 128}), frozenset({512, 1024}),
                  "npu_kv_quant_sparse_attn_sharedkv", "npu_kv_quant_sparse_attn_sharedkv_metadata", True)
FAMILIES: dict[str, AscendFamily] = {A2A3.kv_format: A2A3, A5.kv_format: A5}

CAPABILITIES = Capabilities(
    ops=frozenset({"sparse_attention"}),
    device_types=frozenset({"npu"}),
    archs=A2A3_ARCHS | A5_ARCHS,
    dtypes=frozenset({torch.bfloat16}),
    kv_formats=frozenset(FAMILIES),
    q_head_counts=A2A3.q_heads | A5.q_heads,   # per family in request_reasons
    topk_alignment=1,                            # per family in request_reasons
    supports_sink=True,
    returns_lse=False,
    profiles=frozenset({"ascend"}),
    cuda_graphs=False,
)


def family_for(kv_format: str) -> AscendFamily:
    """The Ascend generation that reads ``kv_format`` (``ascend_bf16`` -> A2/A3, ``ascend_a5`` -> A5)."""
    family = FAMILIES.get(kv_format)
    if family is None:
        raise CacheLayoutError.of("kv_format", "ascend_bf16 (A2/A3) or ascend_a5 (A5)", kv_format)
    return family


def _names(values: frozenset[int]) -> str:
    return " or ".join(str(v) for v in sorted(values))


def request_reasons(request: OpRequest) -> list[str]:
    """Family-specific refusals beyond ``CAPABILITIES`` (heads, top-k width); empty: supported."""
    family = FAMILIES.get(request.kv_format or "")
    if family is None and request.arch is not None:
        family = next((f for f in FAMILIES.values() if request.arch in f.archs), None)
    if family is None:
        return []          # the kv_format / arch reasons of CAPABILITIES already say why
    reasons: list[str] = []
    if request.arch is not None and request.arch in CAPABILITIES.archs and request.arch not in family.archs:
        reasons.append(f"kv_format {family.kv_format} is read on {family.name} only, found {request.arch}")
    if request.heads is not None and request.heads not in family.q_heads:
        reasons.append(f"needs {_names(family.q_heads)} q heads on {family.name} "
                       f"(operator README), found {request.heads}")
    topk, kind = request.topk, dict(request.extra).get("extra_kind", "unknown")
    if topk is not None and kind == "topk" and topk not in family.topk_widths:
        reasons.append(f"needs an indexer top-k width of {_names(family.topk_widths)} on {family.name} "
                       f"(operator README), found {topk}")
    elif topk is not None and kind == "dense" and topk % INDEX_ALIGNMENT != 0:
        reasons.append(f"needs an HCA list width a multiple of {INDEX_ALIGNMENT}, found {topk}")
    elif topk is not None and kind == "unknown" and topk not in family.topk_widths and topk % INDEX_ALIGNMENT:
        reasons.append(f"needs a compressed top-k width of {_names(family.topk_widths)} on {family.name}, "
                       f"or an HCA list (width a multiple of {INDEX_ALIGNMENT}), found {topk}")
    return reasons
