"""Lightning Indexer (SPEC §6) scoring; the query prep (``indexer_q``) lives in ``indexer_query.py``.

``indexer_topk``: a Triton kernel writes
``logit[t, j] = sum_h w[t,h] relu(q[t,h] . k[j])`` for every request-local entry j (keys read in
place from the fp8 / mxfp4 pages through the block table, ``-inf`` past ``(p+1)//r``): one program
per (token, range of entries) holds q once and streams key tiles through the tensor cores. When q is
exactly e4m3 after a per-head power-of-two shift (FP4- or FP8-quantized q, as indexer_q leaves it):
fp8 keys as e4m3 codes on the fp8 MMAs; mxfp4 keys decoded with their block scales into bf16 by integer
ops, one K=128 bf16 MMA a tile (``_mx_tiles``), or, where the device has block-scaled MMAs, one
``tl.dot_scaled`` a tile on the packed keys (``_mx_tiles_scaled``). Otherwise dequantized bf16 operands. ``topk.py`` then
selects the top-k of each row. Rows whose visible count is <= topk skip scoring (SPEC §6.3
short-context shortcut).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import (
    INTERPRET,
    DeviceFacts,
    decode_e4m3,
    device_facts,
    encode_e4m3,
    pow2_from_exponent,
    word_bytes,
)
from dsv4.backends.triton.indexer_mx import _key_rows, _mx_tiles, _mx_tiles_scaled
from dsv4.backends.triton.indexer_query import indexer_q
from dsv4.backends.triton.indexer_tma import _fp8_tiles_tma, key_descriptor, tma_usable
from dsv4.backends.triton.layout import KeyLayout
from dsv4.backends.triton.topk import topk_indices

__all__ = ["default_block_entries", "indexer_logits", "indexer_q", "indexer_topk", "logits_launch", "mx_scaled_path",
           "page_shift", "q_codes", "topk_indices"]

TMA_STAGES = 8  # pipeline depth of the fp8 TMA key tiles: 4 boxes in flight (H200 sweep in docs/triton.md)


@triton.jit
def _key_tile(u8_ptr, f32_ptr, page, in_page, valid, page_stride, value_bytes, scale_offset, scale_bytes,
              BN: tl.constexpr, D: tl.constexpr, MXFP4: tl.constexpr, QBLOCK: tl.constexpr,
              HW_E4M3: tl.constexpr):
    """Keys [BN, D] fp32 of rows ``in_page`` of pages ``page`` (SPEC §9.3), read in place; invalid rows read 0.

    mxfp4 keys come back multiplied by 2**-14 (exact; the caller scales the score back): each
    nibble s.e1e0.m is placed in an fp16 as s.000e1e0.m000000000, whose value is the e2m1 value
    times 2**-14 for normal AND subnormal codes (e2m1 0.5 = fp16 subnormal), so the decode is
    4 integer ops + one exact cvt per element instead of a table walk.
    """
    page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride
    if MXFP4:
        NB: tl.constexpr = D // QBLOCK
        HB: tl.constexpr = QBLOCK // 2  # packed bytes per scale block
        value_base = page_base + in_page * value_bytes
        blk = tl.arange(0, NB)
        byte_idx = blk[None, :, None] * HB + tl.arange(0, HB)[None, None, :]
        raw = tl.load(u8_ptr + value_base[:, None, None] + byte_idx, mask=valid[:, None, None], other=0)
        b = raw.to(tl.int32)
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        scale_byte = tl.load(u8_ptr + (page_base + scale_offset + in_page * scale_bytes)[:, None] + blk[None, :],
                             mask=valid[:, None], other=127)
        factor = (scale_byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None]  # UE8M0 2**(s-127)
        # Low nibble first (SPEC §9.3): element 2i is the low nibble of byte i.
        return tl.reshape(tl.join(lo * factor, hi * factor), (BN, D))
    else:
        cols = tl.arange(0, D)
        raw = tl.load(u8_ptr + (page_base + in_page * value_bytes)[:, None] + cols[None, :], mask=valid[:, None],
                      other=0)
        if HW_E4M3:
            value = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # hardware cvt, exact
        else:
            value = decode_e4m3(raw)
        scale = tl.load(f32_ptr + (page_base + scale_offset + in_page * scale_bytes) // 4, mask=valid, other=0.0)
        return value * scale[:, None]


@triton.jit
def _bf16_tiles(q_ptr, stride_qt, stride_qh, t, heads, head_ok, w, bt_row, u8_ptr, f32_ptr, block_size,
                page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end, hi,
                D: tl.constexpr, BN: tl.constexpr, MXFP4: tl.constexpr, QBLOCK: tl.constexpr,
                HW_E4M3: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Scores of entries [lo, scored_end) with dequantized keys and q as bf16 tensor-core operands
    (any q); ``S^T = K q^T`` with the keys the register operand, relu and the weighted head sum fused."""
    cols = tl.arange(0, D)
    q_t = tl.trans(tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                           mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE))  # [D, HP]
    score_scale = 16384.0 if MXFP4 else 1.0  # undoes the 2**-14 of the fp16 nibble decode (exact)
    offs = tl.arange(0, BN)
    for start in range(lo, scored_end, BN):
        j = start + offs
        valid = j < scored_end
        page = tl.load(bt_row + j // block_size, mask=valid, other=-1)
        valid = valid & (page >= 0)
        keys = _key_tile(u8_ptr, f32_ptr, page, j % block_size, valid, page_stride, value_bytes,
                         scale_offset, scale_bytes, BN, D, MXFP4, QBLOCK, HW_E4M3)
        dots = tl.dot(keys.to(DOT_DTYPE), q_t)  # [BN, HP], fp32 accumulation
        score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1) * score_scale
        tl.store(out_row + j, tl.where(valid, score, float("-inf")), mask=j < hi)


@triton.jit
def _q_codes_kernel(q_ptr, stride_qt, stride_qh, w_ptr, num_heads, codes_ptr, w2_ptr, exact_ptr,
                    D: tl.constexpr, HP: tl.constexpr, W_EXP: tl.constexpr):
    """One program per token: q [heads, D] bf16 -> e4m3 codes q * 2**shift_h (uint8 [T, heads, D]),
    w2 = w * 2**(W_EXP - shift_h) (fp32 [T, heads]) and exact[t] (int32: 1 when every code is exact).

    shift_h puts the head's largest |q| in [256, 448] (or [128, 256) when 2**8 scaling would pass 448),
    so an FP4-simulated q (e2m1 times a power of two per 32, ``deepseek``) and a per-128 e4m3 q
    (``vllm``) are both exact; any other q gives exact 0 and the logits take the bf16 path.
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HP)
    head_ok = heads < num_heads
    base = q_ptr + t * stride_qt + heads[:, None] * stride_qh + tl.arange(0, 32)[None, :]
    amax = tl.zeros([HP], tl.float32)
    for c in tl.static_range(D // 32):
        q = tl.load(base + 32 * c, mask=head_ok[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(q), 1))
    floor_log2 = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    shift = tl.where(amax > 0, tl.minimum(tl.maximum(8 - floor_log2, -100), 100), 0)
    shift = tl.where(amax * pow2_from_exponent(shift) > 448.0, shift - 1, shift)
    w = tl.load(w_ptr + t * num_heads + heads, mask=head_ok, other=0.0)
    w2 = w * pow2_from_exponent(W_EXP - shift)
    tl.store(w2_ptr + t * num_heads + heads, w2, mask=head_ok)
    ok = tl.min(((w2 * pow2_from_exponent(shift - W_EXP)) == w).to(tl.int32), 0)
    out = codes_ptr + (t * num_heads + heads[:, None]) * D + tl.arange(0, 32)[None, :]
    for c in tl.static_range(D // 32):
        v = tl.load(base + 32 * c, mask=head_ok[:, None], other=0.0).to(tl.float32) * pow2_from_exponent(shift)[:, None]
        codes = encode_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
        ok = tl.minimum(ok, tl.min(tl.min((decode_e4m3(codes) == v).to(tl.int32), 1), 0))
        tl.store(out + 32 * c, codes, mask=head_ok[:, None])
    tl.store(exact_ptr + t, ok)


@triton.jit
def _e4m3_operand(codes, DOT_DTYPE: tl.constexpr):
    """uint8 e4m3 codes -> dot operand: the fp8 tensor itself on GPUs, exact fp32 values under the interpreter."""
    if DOT_DTYPE == tl.float32:
        return decode_e4m3(codes)
    else:
        return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _q_operand(codes_row, heads, head_ok, D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A token's q codes (uint8 [heads, D]) as the fp8 dot operand [D, HP]."""
    k = tl.arange(0, D)
    codes = tl.load(codes_row + heads[:, None] * D + k[None, :], mask=head_ok[:, None], other=0)
    return tl.trans(_e4m3_operand(codes, DOT_DTYPE))


@triton.jit
def _tile_rows(bt_row, start, scored_end, block_size, page_stride, value_bytes, scale_offset, scale_bytes,
               BN: tl.constexpr, PAGE_TILE: tl.constexpr):
    """Entries [start, start + BN): (valid [BN], value byte offsets int64 [BN], scale word index int64 [BN])."""
    offs = tl.arange(0, BN)
    j = start + offs
    if PAGE_TILE:  # the tile lies in one page: one page-table load, no per-entry division
        page = tl.load(bt_row + start // block_size, mask=start < scored_end, other=-1)
        valid = j < tl.where(page >= 0, scored_end, start)  # an unmapped page: nothing valid
        in_page = start % block_size + offs
        page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride
        row_base = page_base + in_page * value_bytes
        scale_idx = (page_base + scale_offset + in_page * scale_bytes) // 4
    else:
        valid, row_base, scale_idx = _key_rows(bt_row, j, scored_end, block_size, page_stride, value_bytes,
                                               scale_offset, scale_bytes)
    return valid, row_base, scale_idx


@triton.jit
def _tile_loads(i32_ptr, f32_ptr, valid, row_base, scale_idx, NW: tl.constexpr):
    """The tile's e4m3 bytes as int32 words [BN, NW] and its fp32 scales [BN]."""
    words = tl.load(i32_ptr + (row_base // 4)[:, None] + tl.arange(0, NW)[None, :], mask=valid[:, None], other=0)
    return words, tl.load(f32_ptr + scale_idx, mask=valid, other=0.0)


@triton.jit
def _fp8_tiles(codes_row, heads, head_ok, w2, bt_row, f32_ptr, block_size, page_stride, value_bytes,
               scale_offset, scale_bytes, out_row, lo, scored_end, hi, D: tl.constexpr, BN: tl.constexpr,
               IMPRECISE: tl.constexpr, PAGE_TILE: tl.constexpr, PREFETCH: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Scores of fp8-key entries [lo, scored_end) from e4m3 codes on the fp8 tensor cores (q exact, see
    _q_codes_kernel): one K=128 MMA on the stored codes (IMPRECISE: K elements per tensor-core partial
    sum) times the row's fp32 scale, then ``score = sum_h w2_h relu(acc)`` (q's shift folded into w2).
    PREFETCH (1 or 2): tiles whose bytes are loaded ahead into registers (the loop's latency hiding).
    """
    offs = tl.arange(0, BN)
    q0 = _q_operand(codes_row, heads, head_ok, D, DOT_DTYPE)
    i32_ptr = f32_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    geometry = (scored_end, block_size, page_stride, value_bytes, scale_offset, scale_bytes)
    va, ra, sa = _tile_rows(bt_row, lo, *geometry, BN, PAGE_TILE)
    aw, asc = _tile_loads(i32_ptr, f32_ptr, va, ra, sa, D // 4)
    if PREFETCH == 2:
        vb, rb, sb = _tile_rows(bt_row, lo + BN, *geometry, BN, PAGE_TILE)
        bw, bsc = _tile_loads(i32_ptr, f32_ptr, vb, rb, sb, D // 4)
    for start in range(lo, scored_end, BN):
        # issue the loads PREFETCH tiles ahead (masked off past the end), then score the current tile
        vc, rc, sc = _tile_rows(bt_row, start + PREFETCH * BN, *geometry, BN, PAGE_TILE)
        cw, csc = _tile_loads(i32_ptr, f32_ptr, vc, rc, sc, D // 4)
        codes = word_bytes(aw, BN, D // 4)
        acc = tl.dot(_e4m3_operand(codes, DOT_DTYPE), q0, max_num_imprecise_acc=IMPRECISE) * asc[:, None]
        score = tl.sum(tl.maximum(acc, 0.0) * w2[None, :], 1)
        j = start + offs
        tl.store(out_row + j, tl.where(va, score, float("-inf")), mask=j < hi)
        if PREFETCH == 2:
            va, aw, asc = vb, bw, bsc
            vb, bw, bsc = vc, cw, csc
        else:
            va, aw, asc = vc, cw, csc


@triton.jit
def _indexer_logits_kernel(q_ptr, stride_qt, stride_qh, w_ptr, positions, token_request, block_table, stride_bt,
                           u8_ptr, f32_ptr, block_size, page_stride, value_bytes, scale_offset, scale_bytes,
                           logits, max_entries, chunk, min_tiles, row_lens, ratio, topk, num_heads, codes_ptr,
                           w2_ptr, exact_ptr, key_desc, BOUNDED: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, MXFP4: tl.constexpr,
                           QBLOCK: tl.constexpr, HW_E4M3: tl.constexpr, FP8: tl.constexpr,
                           IMPRECISE: tl.constexpr, PAGE_TILE: tl.constexpr, PREFETCH: tl.constexpr,
                           W: tl.constexpr, MX_FP16: tl.constexpr, TMA: tl.constexpr, MX_SCALED: tl.constexpr,
                           PAGE_SHIFT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One program per (token, range of ``chunk`` entries): q loaded once, then a loop of BN-key tiles
    through the tensor cores with relu and the weighted head sum fused; keys are read once from their
    pages (the bytes floor), logits written once. FP8: when the token's q is exactly e4m3 after its shift
    (``exact_ptr``, see _q_codes_kernel; always for FP4- / FP8-quantized q) fp8 keys take the fp8 MMAs
    (``_fp8_tiles``) and mxfp4 keys one bf16 MMA a tile (``_mx_tiles``; MX_SCALED: one ``tl.dot_scaled``,
    ``_mx_tiles_scaled``); else the bf16 path. W: warps.

    BOUNDED: a row holds its first ``row_len = min(visible, max_entries)`` entries only, stored to
    ``row_lens`` [T] int32, no logit written past them and no page of a padded block table's extra
    entries read, and the ranges are the token's own: its tiles over at most the grid's splits, at least ``min_tiles`` tiles a
    range (the host's rule for a whole row, applied to this row); programs past the row exit. Else
    ``chunk`` entries a program over the whole row, -inf past the visible entries."""
    t = tl.program_id(0).to(tl.int64)
    visible = ((tl.load(positions + t) + 1) // ratio).to(tl.int32)  # SPEC §6.3: entries j < (p+1)//r
    if BOUNDED:
        row_len = tl.minimum(visible, max_entries)
        if tl.program_id(1) == 0:
            tl.store(row_lens + t, row_len)
        tiles = (row_len + BN - 1) // BN
        ranges = tl.maximum(1, tl.minimum(tl.num_programs(1), tiles // min_tiles))
        span = (tiles + ranges - 1) // ranges * BN  # whole tiles: the unbounded kernel's tiles, same values
        lo = tl.program_id(1) * span
        hi = tl.minimum(lo + span, row_len)
    else:
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, max_entries)
    out_row = logits + t * max_entries
    offs = tl.arange(0, BN)
    if visible <= topk:
        # Short-context shortcut: every visible entry is selected, no scoring needed.
        for start in range(lo, hi, BN):
            j = start + offs
            tl.store(out_row + j, tl.where(j < visible, 0.0, float("-inf")), mask=j < hi)
    elif lo < hi:  # (BOUNDED: a range past the row does nothing)
        scored_end = tl.minimum(hi, visible)
        bt_row = block_table + tl.load(token_request + t).to(tl.int64) * stride_bt
        heads = tl.arange(0, HP)
        head_ok = heads < num_heads
        if FP8:
            if tl.load(exact_ptr + t) != 0:
                w2 = tl.load(w2_ptr + t * num_heads + heads, mask=head_ok, other=0.0)
                if MXFP4 and MX_SCALED:
                    _mx_tiles_scaled(codes_ptr + t * num_heads * D, heads, head_ok, w2, bt_row, u8_ptr, block_size,
                                     page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end,
                                     hi, D, BN, PAGE_SHIFT)
                elif MXFP4:
                    _mx_tiles(codes_ptr + t * num_heads * D, heads, head_ok, w2, bt_row, f32_ptr, block_size,
                              page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end, hi,
                              D, BN, PAGE_TILE, W, PREFETCH, MX_FP16, DOT_DTYPE)
                elif TMA:
                    _fp8_tiles_tma(_q_operand(codes_ptr + t * num_heads * D, heads, head_ok, D, DOT_DTYPE), w2,
                                   bt_row, f32_ptr, key_desc, block_size, page_stride, scale_offset, out_row, lo,
                                   scored_end, hi, D, BN, IMPRECISE, DOT_DTYPE)
                else:
                    _fp8_tiles(codes_ptr + t * num_heads * D, heads, head_ok, w2, bt_row, f32_ptr, block_size,
                               page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end, hi,
                               D, BN, IMPRECISE, PAGE_TILE, PREFETCH, DOT_DTYPE)
            else:
                w = tl.load(w_ptr + t * num_heads + heads, mask=head_ok, other=0.0)
                _bf16_tiles(q_ptr, stride_qt, stride_qh, t, heads, head_ok, w, bt_row, u8_ptr, f32_ptr, block_size,
                            page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end, hi,
                            D, BN, MXFP4, QBLOCK, HW_E4M3, DOT_DTYPE)
        else:
            w = tl.load(w_ptr + t * num_heads + heads, mask=head_ok, other=0.0)
            _bf16_tiles(q_ptr, stride_qt, stride_qh, t, heads, head_ok, w, bt_row, u8_ptr, f32_ptr, block_size,
                        page_stride, value_bytes, scale_offset, scale_bytes, out_row, lo, scored_end, hi,
                        D, BN, MXFP4, QBLOCK, HW_E4M3, DOT_DTYPE)
        # Entries past the visible count (this range's tail): -inf.
        # (BOUNDED: none, hi <= row_len <= visible)
        if not BOUNDED:
            tail = tl.maximum(scored_end, lo)
            tail = lo + ((tail - lo) // BN) * BN  # tile-aligned; re-writes a partial tile's -inf, same values
            for start in range(tail, hi, BN):
                j = start + offs
                tl.store(out_row + j, tl.full([BN], float("-inf"), tl.float32), mask=(j < hi) & (j >= scored_end))


def q_codes(q: torch.Tensor, w: torch.Tensor, *, mxfp4: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, D] bf16, w [T, heads] fp32 -> (e4m3 codes uint8 [T, heads, D], w2 fp32 [T, heads],
    exact int32 [T]); see ``_q_codes_kernel`` (mxfp4: the 2**-6 of the nibble map folded into w2)."""
    num_tokens, heads, dim = q.shape
    codes = torch.empty((num_tokens, heads, dim), dtype=torch.uint8, device=q.device)
    w2 = torch.empty((num_tokens, heads), dtype=torch.float32, device=q.device)
    exact = torch.empty((num_tokens,), dtype=torch.int32, device=q.device)
    if num_tokens:
        _q_codes_kernel[(num_tokens,)](q, q.stride(0), q.stride(1), w, heads, codes, w2, exact, D=dim,
                                       HP=max(16, triton.next_power_of_2(heads)), W_EXP=6 if mxfp4 else 0)
    return codes, w2, exact


def mx_scaled_path(facts: DeviceFacts, layout: KeyLayout, dim: int, requested: bool | None) -> bool:
    """Whether ``indexer_logits`` scores mxfp4 keys through ``tl.dot_scaled`` (``_mx_tiles_scaled``):
    ``requested``, or by default where the device has microscaling MMAs (``facts.mx_mma``), and only for
    a geometry whose packed rows (D/2 bytes) start 16-byte aligned and whose D/32 UE8M0 bytes a key lie
    contiguous (SPEC §9.3's mxfp4 pages)."""
    if layout.format_name != "indexer_mxfp4" or not (facts.mx_mma if requested is None else requested):
        return False
    return layout.quant_block == 32 and layout.value_bytes == dim // 2 and layout.scale_bytes == dim // 32 \
        and layout.value_bytes % 16 == 0 and layout.page_stride % 16 == 0 and layout.scale_offset % 4 == 0


def page_shift(block_size: int) -> int:
    """log2(block_size) for a power-of-two block size above 1 (page slot and offset by shift and mask), else 0."""
    return block_size.bit_length() - 1 if block_size > 1 and block_size & (block_size - 1) == 0 else 0


def default_block_entries(mx_scaled: bool) -> int:
    """Key tile of ``indexer_logits``: 32 under the interpreter; 128 for ``tl.dot_scaled`` (sm_100's
    block-scaled MMA needs M >= 128: Triton lowers a smaller tile to a bf16 MMA on upcast operands); else 64."""
    return 32 if INTERPRET else 128 if mx_scaled else 64


def logits_launch(facts: DeviceFacts, layout: KeyLayout, key_cache: torch.Tensor, dim: int, heads: int, *,
                  block_entries: int | None = None, fp8: bool | None = None, imprecise: int | None = None,
                  prefetch: int = 1, mx_fp16: bool = False, tma: bool | None = None, mx_scaled: bool | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  maxnreg: int | None = None) -> tuple[dict, dict]:
    """(constexprs, launch options) of ``_indexer_logits_kernel`` for keys ``key_cache`` / ``layout`` on a
    device with ``facts``: every path choice of ``indexer_logits`` (its keywords, same meaning), in one
    place that ``tools/target_isa.py`` also compiles from."""
    hw_e4m3 = facts.hw_e4m3
    mxfp4 = layout.format_name == "indexer_mxfp4"
    mx_scaled = mx_scaled_path(facts, layout, dim, mx_scaled)
    if fp8 is None:
        fp8 = hw_e4m3 or INTERPRET or mx_scaled
    # The fp8 path reads 4-byte scale words and assumes four scale blocks a key (SPEC §9.3 geometry).
    fp8 = bool(fp8) and (hw_e4m3 or INTERPRET or mx_scaled) and key_cache.shape[1] % 4 == 0 \
        and layout.scale_offset % 4 == 0 and layout.value_bytes % 4 == 0 \
        and (not mxfp4 or (dim // layout.quant_block == 4 and layout.scale_bytes == 4))
    mx_scaled = mx_scaled and fp8
    bn = block_entries or default_block_entries(mx_scaled)
    use_tma = fp8 and (facts.tma or INTERPRET if tma is None else tma) and tma_usable(key_cache, layout, bn)
    # The pointer fp8 path prefetches its tiles itself (Triton's pipeliner waits on a single buffer right after
    # issuing it); TMA boxes are multi-buffered by the pipeliner.
    stages = num_stages or (TMA_STAGES if use_tma else 1 if fp8 and not mx_scaled else 3)
    extra = {} if INTERPRET else {"num_warps": num_warps or 4, "num_stages": stages}
    if maxnreg and not INTERPRET:
        extra["maxnreg"] = maxnreg
    meta = {"D": dim, "HP": max(16, triton.next_power_of_2(heads)), "BN": bn, "MXFP4": mxfp4,
            "QBLOCK": layout.quant_block, "HW_E4M3": hw_e4m3, "FP8": fp8, "IMPRECISE": imprecise or 32,
            "PAGE_TILE": layout.block_size % bn == 0, "PREFETCH": prefetch,
            "W": max(1, min(extra.get("num_warps", 4), bn // 16)), "MX_FP16": bool(mx_fp16), "TMA": use_tma,
            "MX_SCALED": mx_scaled, "PAGE_SHIFT": page_shift(layout.block_size) if mx_scaled else 0,
            "DOT_DTYPE": tl.float32 if INTERPRET else tl.bfloat16}
    return meta, extra


def indexer_logits(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                   key_cache: torch.Tensor, layout: KeyLayout, key_block_table: torch.Tensor, *,
                   topk: int, ratio: int, block_entries: int | None = None, num_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, fp8: bool | None = None,
                   imprecise: int | None = None, maxnreg: int | None = None,
                   prefetch: int = 1, mx_fp16: bool = False, tma: bool | None = None,
                   mx_scaled: bool | None = None, row_lens: torch.Tensor | None = None) -> torch.Tensor:
    """logits [T, mb*B] fp32: scores of visible entries, -inf elsewhere (0 on short-context rows).

    ``row_lens`` (int32 [T], written): each row's entry count ``min((p+1)//r, mb*B)``; the logits past it are
    then left unwritten (for ``topk_indices(row_lens=...)``) and each token's programs share its own entries,
    so the cost follows the visible entries, not the table's width (a block table padded for CUDA graphs).

    q [T, heads, 128] bf16, w [T, heads] fp32; keys read in place from ``key_cache`` (uint8 pages).
    ``fp8``: the e4m3-code path where q is exact (default: where the device has fp8 MMAs, and under the
    interpreter): fp8 keys on the fp8 tensor cores, mxfp4 keys decoded with their block scales to bf16
    (``mx_fp16``: fp16, exact within 24 binades of a key's largest block scale instead of 133);
    ``imprecise``: fp8 keys' K elements a tensor-core partial sum (default 32: fp32 sums of K=32 partial
    products, as DeepSeek's promotion; 128: one partial sum). ``block_entries`` (key tile),
    ``num_splits`` (entry ranges per token), ``num_warps``, ``num_stages``, ``maxnreg`` (registers a
    thread; 0: the compiler's choice) and ``prefetch`` (tiles loaded ahead, 1 or 2) are tuning knobs for
    benchmarks; the default grid fills the device. ``tma``: key tiles of the fp8 path as TMA boxes pipelined
    over ``num_stages`` buffers (``indexer_tma``; default: on sm_90+ CUDA and the interpreter where tiles
    never cross a page; fp8 keys only, see ``indexer_tma``); False: pointer loads prefetched in registers.
    ``mx_scaled``: mxfp4 keys through ``tl.dot_scaled`` (``_mx_tiles_scaled``: no decode where the device has
    microscaling MMAs; default: where it does, ``DeviceFacts.mx_mma``); False: the integer decode to bf16.
    """
    num_tokens, heads, dim = q.shape
    max_entries = key_block_table.shape[1] * layout.block_size
    logits = torch.empty((num_tokens, max_entries), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_entries == 0:
        if row_lens is not None:
            row_lens.zero_()
        return logits
    facts = device_facts(q.device)
    meta, extra = logits_launch(facts, layout, key_cache, dim, heads, block_entries=block_entries, fp8=fp8,
                                imprecise=imprecise, prefetch=prefetch, mx_fp16=mx_fp16, tma=tma,
                                mx_scaled=mx_scaled, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    bn, fp8, mxfp4 = meta["BN"], meta["FP8"], meta["MXFP4"]
    tiles = -(-max_entries // bn)
    # Programs per multiprocessor (at least 4 tiles each: q is read once a program). H200, b=128 at 128K
    # (graph ms): bf16 path 4/SM 0.44, 16/SM 0.38; fp8 mxfp4 splits 17: 0.297, 9: 0.267, 6: 0.253,
    # 4: 0.247; fp8 keys 17: 0.239, 9: 0.229, 6: 0.226.
    target = ((4 if mxfp4 else 6) if fp8 else 16) * facts.num_sms / num_tokens
    min_tiles = 1 if num_splits else 4  # the kernel's per-token rule (BOUNDED) takes the same minimum
    splits = num_splits or max(1, min(round(target) if fp8 else math.ceil(target), tiles // min_tiles))
    chunk = -(-tiles // splits) * bn
    splits = -(-max_entries // chunk)
    q = q.contiguous()
    w = w.contiguous()
    f32 = key_cache.view(torch.float32) if key_cache.shape[1] % 4 == 0 else key_cache
    codes, w2, exact = q_codes(q, w, mxfp4=mxfp4 and not meta["MX_SCALED"]) if fp8 else (q, w, w)
    desc = key_descriptor(key_cache, layout, bn) if meta["TMA"] else None
    # BOUNDED: the rule above per token (its own tiles, at most `splits` ranges of >= min_tiles tiles)
    _indexer_logits_kernel[(num_tokens, splits)](
        q, q.stride(0), q.stride(1), w, positions, token_request, key_block_table, key_block_table.stride(0),
        key_cache, f32, *layout.kernel_args(), logits, max_entries, chunk, min_tiles,
        logits if row_lens is None else row_lens, ratio, topk, heads, codes, w2, exact, desc,
        BOUNDED=row_lens is not None, **meta, **extra)
    return logits


def indexer_topk(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                 key_cache: torch.Tensor, layout: KeyLayout, key_block_table: torch.Tensor, *,
                 topk: int, ratio: int, select: str = "triton", **tuning) -> torch.Tensor:
    """[T, topk] int32 request-local indices, valid first, -1 padded (SPEC §6.3).

    ``select``: "triton" (``topk_indices``; H200 b=128 x 32768: 0.025 ms vs torch.topk 0.117 ms) or
    "torch" (``torch.topk``); ``tuning`` goes to indexer_logits.
    """
    num_tokens = q.shape[0]
    row_lens = torch.empty((num_tokens,), dtype=torch.int32, device=q.device) if select == "triton" else None
    logits = indexer_logits(q, w, positions, token_request, key_cache, layout, key_block_table,
                            topk=topk, ratio=ratio, row_lens=row_lens, **tuning)
    if select == "triton":  # rows read to their visible entries only (what a padded row still costs: topk_indices)
        return topk_indices(logits, topk, row_lens=row_lens)
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    k = min(topk, logits.shape[1])
    if num_tokens == 0 or k == 0:
        return out
    values, index = torch.topk(logits, k, dim=1, sorted=True)  # descending: -inf (invalid) last
    out[:, :k] = torch.where(values == float("-inf"), -1, index).to(torch.int32)
    return out
