"""XPU adapters: bf16 workspace + combined indices (top-k first, then SWA), width % 16 (SPEC §10, §11).

The XPU path (vLLM 0.33's Triton ``triton_bf16_mla_sparse_interface``) reads no paged cache: the
referenced fp8_ds_mla rows are dequantized into a bf16 workspace ``[M, 1, 512]`` and each token's
indices rewritten as workspace rows, compressed first, then SWA, -1 padded to a multiple of 16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from dsv4.specs.formats import round_up

__all__ = ["TOPK_ALIGNMENT", "Workspace", "build_workspace", "round_up"]

# SPEC §11: the XPU Triton kernel needs the index width K % 16 == 0 (an index count).
TOPK_ALIGNMENT = 16




@dataclass(frozen=True)
class Workspace:
    """kv [M, 1, 512] bf16; indices [T, 1, K] int32 workspace rows (-1 padded, K % 16 == 0);
    counts [T] int32 valid entries per token (0: the token attends to nothing)."""

    kv: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor


def build_workspace(swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                    extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                    extra_lens: torch.Tensor | None, *, kv_format: str = "fp8_ds_mla") -> Workspace:
    """Global-slot tables -> workspace rows and combined indices (compressed first, then SWA)."""
    from dsv4.codecs import get_codec

    codec = get_codec(kv_format)
    device = swa_indices.device
    num_tokens = swa_indices.shape[0]
    sources = [] if extra_indices is None else [(extra_cache, extra_indices, extra_lens)]
    sources.append((swa_cache, swa_indices, swa_lens))
    width = round_up(max(1, sum(s[1].shape[1] for s in sources)), TOPK_ALIGNMENT)
    combined = torch.full((num_tokens, width + 1), -1, dtype=torch.int32, device=device)
    filled = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    parts, offset = [], 0
    for cache, indices, lens in sources:
        cols = torch.arange(indices.shape[1], device=device)
        valid = (cols[None, :] < lens[:, None].to(torch.int64)) & (indices >= 0)
        unique, inverse = torch.unique(indices[valid].to(torch.int64), return_inverse=True)
        if unique.numel():
            parts.append(codec.read_rows(cache, unique).to(torch.bfloat16))
        position = filled[:, None] + torch.cumsum(valid.to(torch.int64), dim=1) - 1
        position = torch.where(valid, position, torch.full_like(position, width))
        values = torch.full(indices.shape, -1, dtype=torch.int32, device=device)
        values[valid] = (inverse + offset).to(torch.int32)
        combined.scatter_(1, position, values)
        combined[:, width] = -1
        filled = filled + valid.sum(dim=1)
        offset += unique.numel()
    if not parts:
        parts.append(torch.zeros((1, codec.row_dim), dtype=torch.bfloat16, device=device))
    return Workspace(kv=torch.cat(parts).unsqueeze(1), indices=combined[:, :width].unsqueeze(1).contiguous(),
                     counts=filled.to(torch.int32))
