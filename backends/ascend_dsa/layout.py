"""Ascend adapters (SPEC §9.2, §10; research: vendor_backends.md §1.4-§1.5). Pure torch.

A2/A3 scatters take slots as ``[block, offset]`` int32 pairs, A5 takes flat slots; mixing the two
is silent corruption, so the conversion lives here, once.
"""
from __future__ import annotations

import torch

__all__ = ["slots_to_block_offset"]


def slots_to_block_offset(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """slots [N] int64 (``block * B + offset``, -1 skip) -> [N, 2] int32 ``[block, offset]`` (-1 rows kept)."""
    pairs = torch.stack([torch.div(slots, block_size, rounding_mode="floor"), slots % block_size], dim=1)
    return torch.where((slots >= 0)[:, None], pairs, torch.full_like(pairs, -1)).to(torch.int32)
