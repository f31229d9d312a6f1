"""FlashInfer adapters: head padding, the SM10x combined table, SM12x views (SPEC §9, §10, §11).

Pure torch, any device, no vendor import; proven on CPU against a model of the kernels
(``tests/backends/flashinfer/fake_flashinfer.py``) and against flashinfer's own input checks.

SM10x (trtllm-gen) reads plain rows (``bf16`` or per-tensor ``fp8_e4m3``, ``[nb, B, 512]``)
through ONE table: columns ``[0, 128)`` are SWA rows of the SWA pool, the rest compressed rows
of the compressed pool; ``sparse_topk_lens`` counts all 128 SWA columns; the SWA columns
actually attended are bounded by ``seq_lens`` (``clamp(seq_len - (q_len - 1 - q_off), 0, 128)``,
flashinfer 0.7.2.post1 docstring). We run every token as its own request of length 1, so
``seq_lens[t]`` is simply the number of SWA entries of token t, packed left.
SM12x (``sparse``) reads the fp8_ds_mla pages in place (``[nb, B, 1, token_bytes]`` NHD view) with
separate SWA / extra tables and lengths, like FlashMLA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from dsv4.specs.errors import CacheLayoutError, DSV4ValueError
from dsv4.specs.formats import round_up

__all__ = [
    "HEAD_BUCKETS",
    "SM120_INDEX_TILE",
    "SWA_COLUMNS",
    "TOPK_COLUMN_ALIGNMENT",
    "CombinedTable",
    "build_combined_table",
    "fp8_ds_mla_view",
    "pack_left",
    "pad_heads",
    "pad_sink",
    "padded_head_count",
    "round_up",
    "storage_offsets",
]

# SPEC §11: FlashInfer's DSV4 kernels exist for these query head counts.
HEAD_BUCKETS = (8, 16, 32, 64, 128)
# SPEC §10: the SM10x table holds 128 SWA columns first (the window, SPEC §2).
SWA_COLUMNS = 128
# SPEC §11: table widths are multiples of 4 (16-byte vector loads of int32 indices).
TOPK_COLUMN_ALIGNMENT = 4
# flashinfer's SM120 prefill reads index rows in whole 64-wide tiles (``_sparse_mla_sm120/_api.py``: "Ordinary
# prefill requires topk % 64 == 0"); its decode takes calibrated widths, padded rows included.
SM120_INDEX_TILE = 64




def padded_head_count(num_heads: int) -> int:
    """Smallest of 8/16/32/64/128 that holds ``num_heads``; more than 128 is refused."""
    for bucket in HEAD_BUCKETS:
        if num_heads <= bucket:
            return bucket
    raise DSV4ValueError.of("q.shape[1]", f"at most {HEAD_BUCKETS[-1]} heads (FlashInfer DSV4 kernels)", num_heads)


def pad_heads(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """q [T, H, D] -> [T, padded_heads, D], the new heads zero."""
    if q.shape[1] == padded_heads:
        return q
    out = q.new_zeros((q.shape[0], padded_heads, q.shape[2]))
    out[:, : q.shape[1]] = q
    return out


def pad_sink(sink: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """sink [H] fp32 -> [padded_heads], padding -inf (no effect, SPEC §7)."""
    if sink.shape[0] == padded_heads:
        return sink
    out = sink.new_full((padded_heads,), float("-inf"))
    out[: sink.shape[0]] = sink
    return out


def pack_left(indices: torch.Tensor, lens: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read entries of each row (first ``lens[t]``, not -1) moved left, -1 after; -> (rows, counts).

    indices [T, W] int32, lens [T] int32 -> ([T, width or W] int32, [T] int32). Stable order.
    """
    width = indices.shape[1] if width is None else width
    cols = torch.arange(indices.shape[1], device=indices.device)
    valid = (cols[None, :] < lens[:, None].to(torch.int64)) & (indices >= 0)
    counts = valid.sum(dim=1)
    position = torch.cumsum(valid.to(torch.int64), dim=1) - 1
    position = torch.where(valid, position, torch.full_like(position, width))   # spare column
    out = torch.full((indices.shape[0], width + 1), -1, dtype=torch.int32, device=indices.device)
    out.scatter_(1, position, torch.where(valid, indices, torch.full_like(indices, -1)).to(torch.int32))
    return out[:, :width].contiguous(), counts.to(torch.int32)


def _page_span(cache: torch.Tensor) -> tuple[int, bool]:
    # Rows of a page, and whether the pool has gaps between pages (a padded page stride).
    if cache.dim() != 3 or cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
        raise CacheLayoutError.of("cache", "rows [num_blocks, B, 512] with contiguous rows",
                                  f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if cache.stride(0) % cache.stride(1):
        raise CacheLayoutError.of("cache.stride(0)", f"a multiple of the row stride {cache.stride(1)}",
                                  cache.stride(0))
    span = cache.stride(0) // cache.stride(1)
    return span, span != cache.shape[1]


def storage_offsets(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Global slots (``block * B + offset``) -> storage rows ``block * span + offset`` (-1 kept).

    ``span = stride(0) / stride(1)`` rows per page including padding (vLLM ``_packed_block_span``).
    """
    span, _ = _page_span(cache)
    block_size = cache.shape[1]
    rows = torch.div(slots, block_size, rounding_mode="floor") * span + slots % block_size
    return torch.where(slots >= 0, rows, slots).to(torch.int32)


@dataclass(frozen=True)
class CombinedTable:
    """The SM10x metadata (every token its own request of one query).

    sparse_indices: [T, 128 + round_up(K, 4)] int32; SWA columns first, then compressed.
    sparse_topk_lens: [T] int32 = 128 + compressed count (counts all 128 SWA columns).
    seq_lens: [T] int32 = SWA count, at least 1 (flashinfer requires seq_len >= q_len).
    cum_seq_lens_q: [T + 1] int32 = 0..T (varlen query, one token each).
    storage_offsets: True when the indices were remapped for padded pages.
    """

    sparse_indices: torch.Tensor
    sparse_topk_lens: torch.Tensor
    seq_lens: torch.Tensor
    cum_seq_lens_q: torch.Tensor
    storage_offsets: bool


def build_combined_table(swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                         extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                         extra_lens: torch.Tensor | None) -> CombinedTable:
    """Global-slot tables -> the SM10x combined table (SPEC §10).

    Valid entries are packed left in both segments, so the SWA columns attended
    (``seq_lens``) and the compressed columns read (``lens - 128``) hold no -1.
    """
    if swa_indices.shape[1] > SWA_COLUMNS:
        raise DSV4ValueError.of("swa_indices.shape[1]", f"at most {SWA_COLUMNS} (the window)", swa_indices.shape[1])
    num_tokens = swa_indices.shape[0]
    device = swa_indices.device
    swa_rows, swa_counts = pack_left(swa_indices, swa_lens, SWA_COLUMNS)
    _, swa_strided = _page_span(swa_cache)
    extra_width = 0 if extra_indices is None else extra_indices.shape[1]
    width = SWA_COLUMNS + round_up(extra_width, TOPK_COLUMN_ALIGNMENT)
    table = torch.full((num_tokens, width), -1, dtype=torch.int32, device=device)
    extra_strided = False
    topk_lens = torch.full((num_tokens,), SWA_COLUMNS, dtype=torch.int32, device=device)
    if extra_indices is not None:
        assert extra_cache is not None and extra_lens is not None
        extra_rows, extra_counts = pack_left(extra_indices, extra_lens)
        _, extra_strided = _page_span(extra_cache)
        table[:, SWA_COLUMNS: SWA_COLUMNS + extra_width] = storage_offsets(extra_rows, extra_cache)
        topk_lens = topk_lens + extra_counts
    table[:, :SWA_COLUMNS] = storage_offsets(swa_rows, swa_cache)
    return CombinedTable(
        sparse_indices=table, sparse_topk_lens=topk_lens, seq_lens=swa_counts.clamp_min(1),
        cum_seq_lens_q=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        storage_offsets=swa_strided or extra_strided)


def _kv_format(name: str) -> Any:
    from dsv4.specs.formats import get_format

    return get_format(name)


def fp8_ds_mla_view(cache: torch.Tensor) -> torch.Tensor:
    """uint8 [num_blocks, page_stride] fp8_ds_mla -> [num_blocks, B, 1, token_bytes] (NHD view).

    ``stride(1) == token_bytes``, ``stride(0) == page_stride`` (SPEC §9.1); same storage.
    """
    fmt = _kv_format("fp8_ds_mla")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(1) != 1:
        raise CacheLayoutError.of("cache", "uint8 [num_blocks, page_stride] (fp8_ds_mla)",
                                  f"{cache.dtype} {tuple(cache.shape)}")
    page_stride = cache.shape[1]
    block_size = page_stride // fmt.token_bytes
    if block_size < 1 or fmt.page_stride(block_size) != page_stride or cache.stride(0) != page_stride:
        raise CacheLayoutError.of("cache.shape[1]", "an fp8_ds_mla page stride", page_stride)
    return cache.as_strided((cache.shape[0], block_size, 1, fmt.token_bytes),
                            (page_stride, fmt.token_bytes, fmt.token_bytes, 1))
