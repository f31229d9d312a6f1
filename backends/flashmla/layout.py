"""FlashMLA adapters: kernel cache views, head padding, index tables (SPEC §9.1, §10, §11).

Pure torch, any device, no vendor import: everything here is proven on CPU by feeding it to a
CPU model of the kernel (``tests/backends/flashmla/fake_flash_mla.py``).

Decode (``flash_mla_with_kvcache``) reads the fp8_ds_mla pages in place through a 4-D view
``[num_blocks, B, 1, token_bytes]`` uint8 whose ``stride(1) == token_bytes`` and
``stride(0) == page_stride``; an index is the global slot ``block * B + offset`` (SPEC §10), the
same number our metadata carries, so decode indices need only padding. Prefill
(``flash_mla_sparse_fwd``) has no paged mode: the referenced rows are dequantized into a bf16
workspace and the indices rewritten as workspace rows, compressed first, then SWA.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from dsv4.specs.errors import CacheLayoutError, DSV4ValueError
from dsv4.specs.formats import round_up

__all__ = [
    "DECODE_TOPK_ALIGNMENT",
    "PREFILL_TOPK_ALIGNMENT",
    "PrefillInputs",
    "build_prefill_inputs",
    "cache_block_size",
    "kernel_cache_view",
    "pad_heads",
    "pad_index_width",
    "pad_sink",
    "padded_head_count",
    "round_up",
]

# SPEC §11: decode top-k widths are multiples of 64 (B_TOPK on sm_90 and sm_100 head64);
# prefill widths multiples of 128 (sm_90: 2 * B_TOPK). These are index counts, not bytes.
DECODE_TOPK_ALIGNMENT = 64
PREFILL_TOPK_ALIGNMENT = 128
# SPEC §11: the kernels exist for 64 and 128 query heads only.
_HEAD_BUCKETS = (64, 128)




def padded_head_count(num_heads: int) -> int:
    """64 for 1..64 heads, 128 for 65..128 (SPEC §11); more than 128 is refused."""
    for bucket in _HEAD_BUCKETS:
        if num_heads <= bucket:
            return bucket
    raise DSV4ValueError.of("q.shape[1]", f"at most {_HEAD_BUCKETS[-1]} heads (FlashMLA kernels)", num_heads)


def pad_heads(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """q [T, H, D] -> [T, padded_heads, D], new heads zero (their output is dropped)."""
    num_heads = q.shape[1]
    if num_heads == padded_heads:
        return q
    out = q.new_zeros((q.shape[0], padded_heads, q.shape[2]))
    out[:, :num_heads] = q
    return out


def pad_sink(sink: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """sink [H] fp32 -> [padded_heads] fp32, padding -inf (no effect on a softmax, SPEC §7)."""
    num_heads = sink.shape[0]
    if num_heads == padded_heads:
        return sink
    out = sink.new_full((padded_heads,), float("-inf"))
    out[:num_heads] = sink
    return out


def pad_index_width(indices: torch.Tensor, alignment: int) -> torch.Tensor:
    """indices [T, W] int32 -> [T, max(alignment, round_up(W, alignment))], new columns -1.

    Returned unchanged (no copy) when the width is already aligned and the rows contiguous.
    """
    width = indices.shape[1]
    target = max(alignment, round_up(width, alignment))
    if target == width and indices.is_contiguous():
        return indices
    out = indices.new_full((indices.shape[0], target), -1)
    out[:, :width] = indices
    return out


@functools.cache
def _kv_format(name: str) -> Any:
    from dsv4.specs.formats import get_format

    return get_format(name)


@functools.lru_cache(maxsize=64)
def _block_size_of_stride(format_name: str, page_stride: int) -> int:
    fmt = _kv_format(format_name)
    block_size = page_stride // fmt.token_bytes
    if block_size < 1 or fmt.page_stride(block_size) != page_stride:
        raise CacheLayoutError.of("cache.shape[1]", f"a {format_name} page stride", page_stride)
    return block_size


def cache_block_size(cache: torch.Tensor, format_name: str = "fp8_ds_mla") -> int:
    """Tokens per page of a ``uint8 [num_blocks, page_stride]`` byte cache (SPEC §9.1).

    ``page_stride = round_up(B * token_bytes, alignment)`` is less than ``(B + 1) * token_bytes``
    whenever the alignment is at most one token record (true for fp8_ds_mla), so
    ``page_stride // token_bytes`` recovers B; the result is checked against the format.
    """
    if cache.dtype != torch.uint8 or cache.dim() != 2:
        raise CacheLayoutError.of("cache", f"uint8 [num_blocks, page_stride] ({format_name})",
                                  f"{cache.dtype} {tuple(cache.shape)}")
    page_stride = cache.shape[1]
    block_size = _block_size_of_stride(format_name, page_stride)  # cached: asked on every call
    if cache.stride(1) != 1 or cache.stride(0) != page_stride:
        raise CacheLayoutError.of("cache.stride()", f"({page_stride}, 1) (contiguous pages)", cache.stride())
    return block_size


def kernel_cache_view(cache: torch.Tensor, format_name: str = "fp8_ds_mla") -> torch.Tensor:
    """uint8 [num_blocks, page_stride] -> the kernel's [num_blocks, B, 1, token_bytes] view.

    ``stride(1) == token_bytes`` (FlashMLA asserts it), ``stride(0) == page_stride``. The view is
    only an address scheme: the kernel reads token data at ``t * data_bytes`` and the scale rows
    after all data rows (SPEC §9.1), not at ``t * token_bytes``. Same storage, no copy.
    """
    fmt = _kv_format(format_name)
    block_size = cache_block_size(cache, format_name)
    token_bytes = fmt.token_bytes
    return cache.as_strided((cache.shape[0], block_size, 1, token_bytes),
                            (cache.shape[1], token_bytes, token_bytes, 1))


@dataclass(frozen=True)
class PrefillInputs:
    """What ``flash_mla_sparse_fwd`` consumes.

    workspace: [M, 1, 512] bf16 dequantized rows, compressed rows first, then SWA rows.
    indices: [T, 1, CW] int32 workspace rows, valid first (compressed, then SWA), -1 padded;
        ``CW = round_up(K + W, 128)`` for extra width K and SWA width W (SPEC §10).
    lengths: [T] int32 number of valid entries per row.
    """

    workspace: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor


def _valid_mask(indices: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    # ARCHITECTURE §3: only the first lens[t] columns are read, and -1 is skipped there.
    cols = torch.arange(indices.shape[1], device=indices.device)
    return (cols[None, :] < lens[:, None].to(torch.int64)) & (indices >= 0)


def _gather_unique(cache: torch.Tensor, slots: torch.Tensor, codec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # Rows referenced by several tokens (the SWA window overlaps between neighbours) are
    # dequantized once; torch.unique syncs, which prefill can afford.
    unique, inverse = torch.unique(slots.to(torch.int64), return_inverse=True)
    rows = codec.read_rows(cache, unique) if unique.numel() else cache.new_zeros((0, 0))
    return rows, inverse


def build_prefill_inputs(swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                         extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                         extra_lens: torch.Tensor | None, *, kv_format: str = "fp8_ds_mla",
                         head_dim: int = 512) -> PrefillInputs:
    """Global-slot tables -> bf16 workspace + combined indices for ``flash_mla_sparse_fwd``.

    swa_indices [T, W] int32 global slots of ``swa_cache``, swa_lens [T] int32; extra_* the same
    for the compressed cache (or None). Compressed entries come first, then SWA (SPEC §10, as
    vLLM's ``combine_topk_swa_indices``); each row is packed left, so ``lengths`` counts only
    real rows and the kernel skips nothing it did not need to.
    """
    from dsv4.codecs import get_codec

    codec = get_codec(kv_format)
    device = swa_indices.device
    num_tokens = swa_indices.shape[0]
    parts: list[torch.Tensor] = []
    row_offset = 0
    extra_width = 0 if extra_indices is None else extra_indices.shape[1]
    width = round_up(extra_width + swa_indices.shape[1], PREFILL_TOPK_ALIGNMENT)
    # One spare column absorbs the scatter of masked entries; it is dropped below.
    combined = torch.full((num_tokens, width + 1), -1, dtype=torch.int32, device=device)
    filled = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    sources = []
    if extra_indices is not None:
        assert extra_cache is not None and extra_lens is not None
        sources.append((extra_cache, extra_indices, extra_lens))
    sources.append((swa_cache, swa_indices, swa_lens))
    for cache, indices, lens in sources:
        valid = _valid_mask(indices, lens)
        rows, inverse = _gather_unique(cache, indices[valid], codec)
        if rows.numel():
            parts.append(rows.to(torch.bfloat16))
        position = filled[:, None] + torch.cumsum(valid.to(torch.int64), dim=1) - 1
        position = torch.where(valid, position, torch.full_like(position, width))
        values = torch.full(indices.shape, -1, dtype=torch.int32, device=device)
        values[valid] = (inverse + row_offset).to(torch.int32)
        combined.scatter_(1, position, values)
        # The spare column received masked entries; restore it before the next source.
        combined[:, width] = -1
        filled = filled + valid.sum(dim=1)
        row_offset += rows.shape[0] if rows.numel() else 0
    if not parts:
        # The kernel needs s_kv >= 1; a zero row that no index names keeps every query empty.
        parts.append(torch.zeros((1, head_dim), dtype=torch.bfloat16, device=device))
    workspace = torch.cat(parts, dim=0).unsqueeze(1)
    return PrefillInputs(workspace=workspace, indices=combined[:, :width].unsqueeze(1).contiguous(),
                         lengths=filled.to(torch.int32))
