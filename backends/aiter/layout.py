"""AITER adapters: ragged CSR of global slots (SPEC §10) and the fp8_ds_mla kernel view.

AITER's sparse MLA (``aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd``, gfx950) reads both
paged caches in place; each token's main (SWA) and extra (compressed) segments are CSR rows of
global slot ids: ``indices[indptr[t]:indptr[t+1]]``, no -1 inside (vLLM drops them with
``build_ragged_indices_from_dense``, whose consumers do not check the sign).
"""
from __future__ import annotations

import torch
from dsv4.specs.errors import CacheLayoutError

__all__ = ["fp8_ds_mla_view", "ragged_csr"]


def ragged_csr(indices: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, W] int32 global slots, lens [T] int32 -> (indptr [T+1] int32, flat [nnz] int32).

    Keeps the first ``lens[t]`` entries of each row that are not -1, in row order.
    """
    cols = torch.arange(indices.shape[1], device=indices.device)
    valid = (cols[None, :] < lens[:, None].to(torch.int64)) & (indices >= 0)
    counts = valid.sum(dim=1)
    indptr = torch.zeros(indices.shape[0] + 1, dtype=torch.int32, device=indices.device)
    indptr[1:] = torch.cumsum(counts, dim=0).to(torch.int32)
    return indptr, indices[valid].to(torch.int32)


def fp8_ds_mla_view(cache: torch.Tensor) -> torch.Tensor:
    """uint8 [num_blocks, page_stride] -> [num_blocks, B, token_bytes] (stride(1) = token bytes), the 3-D
    block cache AITER reads as ``fp8_dsv4_mla`` (its 4-D form must be ``[slots, 1, 1, R]``)."""
    from dsv4.specs.formats import get_format

    fmt = get_format("fp8_ds_mla")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(1) != 1:
        raise CacheLayoutError.of("cache", "uint8 [num_blocks, page_stride] (fp8_ds_mla)",
                                  f"{cache.dtype} {tuple(cache.shape)}")
    block_size = cache.shape[1] // fmt.token_bytes
    if block_size < 1 or fmt.page_stride(block_size) != cache.shape[1] or cache.stride(0) != cache.shape[1]:
        raise CacheLayoutError.of("cache.shape[1]", "an fp8_ds_mla page stride", cache.shape[1])
    return cache.as_strided((cache.shape[0], block_size, fmt.token_bytes),
                            (cache.shape[1], fmt.token_bytes, 1))
