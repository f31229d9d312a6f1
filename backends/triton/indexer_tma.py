"""fp8 indexer key tiles through tensor-memory-accelerator copies (NVIDIA sm_90+; SPEC §6.3, §9.3).

``indexer._indexer_logits_kernel`` scores a token's range of entries in ``BN``-key tiles. When a tile lies
in one page (``BN`` divides the page's entry count), its e4m3 codes are one box ``[1, BN, value_bytes]`` of
the cache seen as ``[num_pages, block_size, value_bytes]`` (``key_descriptor``): one asynchronous bulk copy
into shared memory, the A operand of the fp8 MMA as it lands. Triton's software pipeline multi-buffers the
boxes with mbarriers (``num_stages`` 8: four boxes in flight a program) instead of holding the next tile in
registers, which is what bounded the pointer path (``indexer._fp8_tiles``) at ~59% of copy bandwidth on the
H200. An unmapped page (-1) is an out-of-bounds box: the copy fills zeros and the entries are masked to
-inf, as on the pointer path.

mxfp4 keys stay on the pointer path: boxes in the same pipeline (also boxed in the kernel's load order, so
the decoded keys stay in their operand registers) timed 230-300 us against 223 us; their loop is bound by
the decode, not the loads (docs/triton.md, sixth round).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import INTERPRET, decode_e4m3
from dsv4.backends.triton.layout import KeyLayout

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

__all__ = ["key_descriptor", "tma_usable"]


def tma_usable(key_cache: torch.Tensor, layout: KeyLayout, block_entries: int) -> bool:
    """Whether ``key_descriptor`` can describe ``key_cache``'s codes in ``block_entries``-key boxes: fp8 keys,
    a tile never crosses a page, page stride and base 16-byte aligned (TMA), a row of whole 16-byte units of
    at most 256 codes, one fp32 scale a key at a 4-byte aligned offset."""
    return (TensorDescriptor is not None and layout.format_name == "indexer_fp8"
            and layout.block_size % block_entries == 0 and layout.page_stride % 16 == 0
            and key_cache.data_ptr() % 16 == 0 and layout.value_bytes % 16 == 0 and layout.value_bytes <= 256
            and block_entries <= 256 and key_cache.is_contiguous() and layout.scale_bytes == 4
            and layout.scale_offset % 4 == 0)


def key_descriptor(key_cache: torch.Tensor, layout: KeyLayout, block_entries: int):
    """TMA descriptor of the e4m3 codes of ``key_cache`` (uint8 [num_pages, page_stride], ``indexer_fp8``) as
    ``[num_pages, block_size, value_bytes]`` float8_e4m3fn (uint8 under the interpreter), boxes
    ``[1, block_entries, value_bytes]``."""
    codes = key_cache if INTERPRET else key_cache.view(torch.float8_e4m3fn)
    vb = layout.value_bytes
    return TensorDescriptor(codes, [key_cache.shape[0], layout.block_size, vb], [layout.page_stride, vb, 1],
                            [1, block_entries, vb])


@triton.jit
def _fp8_tiles_tma(q0, w2, bt_row, f32_ptr, desc, block_size, page_stride, scale_offset, out_row, lo, scored_end,
                   hi, D: tl.constexpr, BN: tl.constexpr, IMPRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``indexer._fp8_tiles`` with each tile's e4m3 codes [BN, D] one TMA box (fp8 [1, BN, D]; uint8 under the
    interpreter), multi-buffered by Triton's pipeline (``num_stages``; a box that feeds the dot is pipelined).
    The tile's fp32 scales [BN] (a plain load: Triton 3.6 pipelines only loads feeding the dot, and a scale
    box would be waited on where it is issued) are used one iteration later: tile i's head sums are scaled
    and stored in iteration i + 1, so the load has a whole tile to land. score = scale * sum_h w2_h
    relu(acc_h), equal to scaling each product first: the scales are powers of two (SPEC §9.3). q0: the token's
    q codes as the dot's B operand [D, HP] (``indexer._q_operand``)."""
    offs = tl.arange(0, BN)
    sum_p = tl.zeros([BN], tl.float32)  # the previous tile: head sums, scales, entries, validity, store mask
    scale_p = tl.zeros([BN], tl.float32)
    j_p = lo - BN + offs
    valid_p = offs < 0
    store_p = offs < 0  # nothing before lo
    for start in range(lo, scored_end, BN):
        page = tl.load(bt_row + start // block_size)
        in_page = start % block_size
        j = start + offs
        valid = j < tl.where(page >= 0, scored_end, start)  # an unmapped page: nothing valid
        base = (tl.maximum(page, 0).to(tl.int64) * page_stride + scale_offset) // 4 + in_page
        scale = tl.load(f32_ptr + base + offs, mask=valid, other=0.0)
        codes = tl.reshape(desc.load([page, in_page, 0]), (BN, D))  # page -1: an out-of-bounds box, zeros
        if DOT_DTYPE == tl.float32:
            acc = tl.dot(decode_e4m3(codes), q0)
        else:
            acc = tl.dot(codes, q0, max_num_imprecise_acc=IMPRECISE)
        tl.store(out_row + j_p, tl.where(valid_p, sum_p * scale_p, float("-inf")), mask=store_p)
        sum_p = tl.sum(tl.maximum(acc, 0.0) * w2[None, :], 1)
        scale_p = scale
        j_p = j
        valid_p = valid
        store_p = j < hi
    tl.store(out_row + j_p, tl.where(valid_p, sum_p * scale_p, float("-inf")), mask=store_p)
