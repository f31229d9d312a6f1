"""Sparse MQA over paged latent caches (SPEC §7): split over keys, then a combine step.

One kernel serves decode and prefill. A program owns one token, a block of (up to 64) heads and
one split of that token's key list. The list is the SWA indices followed by the extra
(compressed) indices, walked as ONE loop of ``BN``-key tiles (the source is picked per tile with
scalar selects), so Triton's software pipeline runs across the SWA -> extra boundary.

Per tile: the ``BN`` latent rows are gathered in place as ``[BN, D // CHUNK, CHUNK]`` (one
64-wide chunk per UE8M0 scale, SPEC §9.1): a row's 8 scale bytes are one 8-byte load, e4m3
bytes are converted by the hardware (``cvt`` e4m3x2, exact) on sm_89+ CUDA and by the exact
integer decode elsewhere (interpreter, ROCm FNUZ parts, XPU), and the rope chunk is one
``[BN, 1, CHUNK]`` bf16 load broadcast over the chunk axis. bf16 rows are one 2-D load that
Triton copies straight into the dot's shared-memory operand. The K tile is the B operand of
both dots (scores and P@V), so it is dequantized once. With one split the program finishes the
softmax itself (sink, lse); with several, each writes a partial (max, sum, unnormalised output)
and ``_combine_kernel`` merges them.

H200 (docs/triton.md): one 64-head program per SM (a [64, 512] fp32 accumulator fills the
registers, 215 KB of shared memory double-buffers the fp8 gathers); the kernel is latency-bound
(about a third of issue slots used, stalls on barriers and fixed-latency waits), not
bandwidth-bound. Per-tile work kept small: page offsets by shift and mask for power-of-two pages
(else 32-bit divisions), probabilities rounded by the hardware's RNE bf16 cast on CUDA (integer
rounding only under the interpreter), the softmax scale folded into one FMA per score.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton import hopper_dispatch
from dsv4.backends.triton._common import (
    INTERPRET,
    FittingLaunch,
    decode_e4m3,
    device_facts,
    host_cdiv,
    next_pow2,
    round_bf16,
    to_bf16,
)
from dsv4.backends.triton.layout import LatentLayout
from dsv4.backends.triton.sparse_tuning import SparseTuning, choose_num_splits, default_tuning, smaller_shapes
from dsv4.specs.errors import CacheLayoutError

__all__ = ["SparseTuning", "choose_num_splits", "default_tuning", "sparse_attention"]

_LOG2E = 1.4426950408889634
_FITTING = FittingLaunch()  # the launch shape each device and kernel variant takes (sparse_tuning)


@triton.jit
def _load_slots(idx_row, local_tile, length, BN: tl.constexpr, REPEAT: tl.constexpr):
    """[BN] int32 slots of one tile and [BN] validity (in the list and not -1, SPEC §10).

    A tile covers ``BN // REPEAT`` keys, each repeated ``REPEAT`` times in a row.
    """
    j = local_tile * (BN // REPEAT) + tl.arange(0, BN) // REPEAT
    in_list = j < length
    slots = tl.load(idx_row + j, mask=in_list, other=-1)
    return slots, in_list & (slots >= 0)


@triton.jit
def _tile_slots(tile, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA: tl.constexpr, BN: tl.constexpr,
                REPEAT: tl.constexpr, ROW_SELECT: tl.constexpr):
    """[BN] int32 slots and [BN] validity of virtual tile ``tile`` (past the list: all invalid).

    ``ROW_SELECT``: one load through a select between the SWA and extra index rows (CUDA: 23% faster decode
    than two loads on the H200). Else two masked loads, the other list's empty: Triton 3.6's AMD buffer-op
    pass asserts on that select (every CSA / HCA variant failed to compile for gfx942 / gfx950 there).
    """
    if HAS_EXTRA:
        in_swa = tile < n_swa
        if ROW_SELECT:
            return _load_slots(tl.where(in_swa, swa_row, ext_row), tl.where(in_swa, tile, tile - n_swa),
                               tl.where(in_swa, swa_len, ext_len), BN, REPEAT)
        swa_slots, swa_valid = _load_slots(swa_row, tile, tl.where(in_swa, swa_len, 0), BN, REPEAT)
        ext_slots, ext_valid = _load_slots(ext_row, tl.maximum(tile - n_swa, 0), tl.where(in_swa, 0, ext_len), BN,
                                           REPEAT)
        return tl.where(in_swa, swa_slots, ext_slots), swa_valid | ext_valid
    return _load_slots(swa_row, tile, swa_len, BN, REPEAT)


@triton.jit
def _gather(tile, slots, valid, n_swa, swa_u8, ext_u8, swa_bf16, ext_bf16, swa_i64, ext_i64, swa_block, ext_block,
            swa_page_stride, ext_page_stride, swa_scale_off, ext_scale_off, token_stride, nope_offset, rope_offset,
            scale_stride, HAS_EXTRA: tl.constexpr, FP8: tl.constexpr, POW2_BLOCKS: tl.constexpr,
            NOPE_CHUNKS: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Loads of the ``BN`` records of tile ``tile``: (raw, rope, scale word); invalid rows read nothing.

    fp8 (SPEC §9.1, A5 §9.2): raw = e4m3 codes u8 ``[BN, CHUNKS, CHUNK]`` (the rope chunk masked),
    rope = bf16 ``[BN, 1, CHUNK]``, word = the row's 8 UE8M0 bytes as one little-endian int64 (byte
    c = chunk c: one 8-byte load a row). bf16 rows: raw = ``[BN, D]`` bf16 (2-D, so that Triton can
    copy the rows straight into the dot's shared-memory operand). Page sizes: log2 when
    ``POW2_BLOCKS`` (shift and mask), else a 32-bit division per row.
    """
    in_swa = tile < n_swa
    if HAS_EXTRA:
        u8 = tl.where(in_swa, swa_u8, ext_u8)
        bf16 = tl.where(in_swa, swa_bf16, ext_bf16)
        i64 = tl.where(in_swa, swa_i64, ext_i64)
        block = tl.where(in_swa, swa_block, ext_block)
        page_stride = tl.where(in_swa, swa_page_stride, ext_page_stride)
        scale_off = tl.where(in_swa, swa_scale_off, ext_scale_off)
    else:
        u8, bf16, i64, block, page_stride, scale_off = (swa_u8, swa_bf16, swa_i64, swa_block, swa_page_stride,
                                                        swa_scale_off)
    safe = tl.where(valid, slots, 0)  # int32 slots >= 0
    if POW2_BLOCKS:
        page32 = safe >> block
        in_page = safe & ((1 << block) - 1)
    else:
        page32 = safe // block
        in_page = safe - page32 * block
    page = page32.to(tl.int64)
    record = page * page_stride + in_page.to(tl.int64) * token_stride  # [BN] byte offsets
    if FP8:
        rows = record[:, None, None]
        row_ok = valid[:, None, None]
        chunk = tl.arange(0, CHUNKS)[None, :, None]
        elem = tl.arange(0, CHUNK)[None, None, :]
        raw = tl.load(u8 + rows + nope_offset + chunk * CHUNK + elem, mask=row_ok & (chunk < NOPE_CHUNKS),
                      other=0)
        rope = tl.load(bf16 + (rows + rope_offset) // 2 + elem, mask=row_ok, other=0.0)
        scale_row = page * page_stride + scale_off + in_page * scale_stride  # [BN] bytes, 8-aligned
        word = tl.load(i64 + (scale_row >> 3), mask=valid, other=0)
    else:
        cols = tl.arange(0, CHUNKS * CHUNK)[None, :]
        raw = tl.load(bf16 + (record[:, None] + nope_offset) // 2 + cols, mask=valid[:, None], other=0.0)
        rope = tl.zeros([1, 1, CHUNK], tl.bfloat16)
        word = tl.zeros([1], tl.int64)
    return raw, rope, word


@triton.jit
def _dequantize(raw, rope, word, FP8: tl.constexpr, HW_FP8: tl.constexpr, NOPE_CHUNKS: tl.constexpr,
                CHUNKS: tl.constexpr, CHUNK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``_gather``'s bytes -> K = V rows ``[BN, CHUNKS * CHUNK]`` in ``OUT_DTYPE`` (exact bf16 values).

    SPEC §9.1: value = e4m3 * 2**(ue8m0 - 127), converted by the hardware (``cvt`` e4m3x2, exact) on
    sm_89+ CUDA and by the exact integer decode elsewhere (interpreter, ROCm FNUZ parts, XPU); e4m3
    (4 significant bits) times a power of two is a bf16 value, so the cast is exact. The rope chunk
    keeps its bf16 values.
    """
    if FP8:
        chunk = tl.arange(0, CHUNKS)[None, :, None]
        is_nope = chunk < NOPE_CHUNKS
        scale_byte = ((word[:, None, None] >> (chunk * 8).to(tl.int64)) & 255).to(tl.int32)  # [BN, C, 1]
        scale_byte = tl.where(is_nope, scale_byte, 127)
        scale = (scale_byte << 23).to(tl.float32, bitcast=True)  # 2**(byte-127), byte >= 1
        if HW_FP8:
            nope = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # hardware cvt, exact
        else:
            nope = decode_e4m3(raw)
        k = tl.where(is_nope, (nope * scale).to(OUT_DTYPE), rope.to(OUT_DTYPE))
        k = tl.reshape(k, [k.shape[0], CHUNKS * CHUNK])
    else:
        k = raw.to(OUT_DTYPE)
    return k


@triton.jit
def _sparse_attention_kernel(
        q_ptr, stride_qt, stride_qh,
        swa_u8, swa_bf16, swa_i64, swa_idx, swa_idx_stride, swa_lens,
        swa_block, swa_page_stride, swa_token_stride, swa_nope_off, swa_rope_off, swa_scale_off, swa_scale_stride,
        ext_u8, ext_bf16, ext_i64, ext_idx, ext_idx_stride, ext_lens,
        ext_block, ext_page_stride, ext_token_stride, ext_nope_off, ext_rope_off, ext_scale_off, ext_scale_stride,
        sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, part_acc, part_ml,
        num_heads, swa_width, ext_width, scale_log2,
        HAS_EXTRA: tl.constexpr, FP8: tl.constexpr, HW_FP8: tl.constexpr,
        NOPE_CHUNKS: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
        BH: tl.constexpr, BN: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
        PROBS_BF16: tl.constexpr, REPEAT: tl.constexpr, POW2_BLOCKS: tl.constexpr, RNE_CVT: tl.constexpr,
        ISOLATE_S: tl.constexpr, PREFETCH: tl.constexpr, ROW_SELECT: tl.constexpr):
    """Grid (T, cdiv(H, BH), NUM_SPLITS). q [T,H,D] bf16; out [T,H,D] bf16; lse [T,H] fp32.

    Per tile: ``S = q K^T`` ``[BH, BN]`` and ``O += P K`` with K the B operand of both dots (one
    shared-memory tile, q in shared memory too, P in registers). With 8 warps Triton gives the
    P@V accumulator ``[64, 512]`` to two warpgroups of 256 columns each; for the scores it picks a
    layout in which both warpgroups compute the full ``[64, BN]`` (its rule for a dot feeding
    another dot) unless ``ISOLATE_S`` puts the score dot in a region of its own (a one-trip loop
    whose trip count the compiler cannot see): then each warpgroup computes half the score columns
    and P reaches the P@V dot through shared memory. Triton's pipeliner only handles innermost
    loops, so ``ISOLATE_S`` forgoes its pipelining; ``PREFETCH`` issues the next tile's loads into
    registers before this tile's math instead (1: the slot indices, 2: the records too).

    ``REPEAT`` = 2 (fp32 probabilities through bf16 tensor cores, the vllm profile): every key
    appears twice in a tile, the first copy's probability is ``hi = bf16(p)`` and the second's
    ``lo = bf16(p - hi)``, so ONE P@V dot sums ``(hi + lo) v`` with relative error ~2**-16; two
    chained dots instead spill the accumulator.
    The SWA and extra caches share one format: token stride, nope/rope offsets and scale stride
    are taken from the SWA layout for both.
    """
    D: tl.constexpr = CHUNKS * CHUNK
    KEYS: tl.constexpr = BN // REPEAT  # distinct keys a tile
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BH + tl.arange(0, BH)
    head_ok = heads < num_heads
    cols = tl.arange(0, D)
    t64 = t.to(tl.int64)
    # int64 head offsets: a head-major q (stride_qh = T * D) passes 2**31 at long T.
    q = tl.load(q_ptr + t64 * stride_qt + heads.to(tl.int64)[:, None] * stride_qh + cols[None, :],
                mask=head_ok[:, None], other=0.0).to(DOT_DTYPE)

    swa_len = tl.minimum(tl.load(swa_lens + t), swa_width)
    n_swa = tl.cdiv(swa_len, KEYS)
    if HAS_EXTRA:
        ext_len = tl.minimum(tl.load(ext_lens + t), ext_width)
    else:
        ext_len = 0
    total = n_swa + tl.cdiv(ext_len, KEYS)
    per_split = tl.cdiv(total, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)
    swa_row = swa_idx + t64 * swa_idx_stride
    ext_row = ext_idx + t64 * ext_idx_stride

    one = tl.minimum(num_heads, 1)  # 1, unknown at compile time (ISOLATE_S)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    if PREFETCH >= 1:
        n_slots, n_valid = _tile_slots(lo, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA, BN, REPEAT,
                                       ROW_SELECT)
    if PREFETCH == 2:
        n_raw, n_rope, n_word = _gather(
            lo, n_slots, n_valid, n_swa, swa_u8, ext_u8, swa_bf16, ext_bf16, swa_i64, ext_i64, swa_block,
            ext_block, swa_page_stride, ext_page_stride, swa_scale_off, ext_scale_off, swa_token_stride,
            swa_nope_off, swa_rope_off, swa_scale_stride, HAS_EXTRA, FP8, POW2_BLOCKS, NOPE_CHUNKS, CHUNKS, CHUNK)
    for tile in range(lo, hi):
        if PREFETCH >= 1:
            # The next tile's loads go out now and land while this tile computes (past hi: masked).
            slots, valid = n_slots, n_valid
            n_slots, n_valid = _tile_slots(tile + 1, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA, BN,
                                           REPEAT, ROW_SELECT)
        else:
            slots, valid = _tile_slots(tile, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA, BN, REPEAT,
                                       ROW_SELECT)
        if PREFETCH == 2:
            raw, rope, word = n_raw, n_rope, n_word
            n_raw, n_rope, n_word = _gather(
                tile + 1, n_slots, n_valid, n_swa, swa_u8, ext_u8, swa_bf16, ext_bf16, swa_i64, ext_i64, swa_block,
                ext_block, swa_page_stride, ext_page_stride, swa_scale_off, ext_scale_off, swa_token_stride,
                swa_nope_off, swa_rope_off, swa_scale_stride, HAS_EXTRA, FP8, POW2_BLOCKS, NOPE_CHUNKS, CHUNKS,
                CHUNK)
        else:
            raw, rope, word = _gather(
                tile, slots, valid, n_swa, swa_u8, ext_u8, swa_bf16, ext_bf16, swa_i64, ext_i64, swa_block, ext_block,
                swa_page_stride, ext_page_stride, swa_scale_off, ext_scale_off, swa_token_stride, swa_nope_off,
                swa_rope_off, swa_scale_stride, HAS_EXTRA, FP8, POW2_BLOCKS, NOPE_CHUNKS, CHUNKS, CHUNK)
        k = _dequantize(raw, rope, word, FP8, HW_FP8, NOPE_CHUNKS, CHUNKS, CHUNK, DOT_DTYPE)  # [BN, D]
        if ISOLATE_S:
            s = tl.zeros([BH, BN], tl.float32)
            for _ in range(one):
                s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k))  # [BH, BN] fp32 accumulation
        s = tl.where(valid[None, :], s, float("-inf"))
        # Statistics in the log2 domain; max(s) * c = max(s * c) (c > 0, rounding is monotonic) and
        # s * c - m is one FMA per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale_log2 - m_safe[:, None])
        acc = acc * alpha[:, None]
        if REPEAT == 2:
            first = (tl.arange(0, BN) % 2 == 0)[None, :]
            l_i = l_i * alpha + tl.sum(tl.where(first, p, 0.0), 1)
            if RNE_CVT:
                p_hi = p.to(tl.bfloat16).to(tl.float32)
            else:
                p_hi = round_bf16(p)
            p = tl.where(first, p_hi, p - p_hi)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)  # the denominator sums fp32 probabilities (SPEC §6.6)
            if PROBS_BF16 and not RNE_CVT:
                p = round_bf16(p)  # SPEC §6.6 deepseek: bf16 probabilities (RNE; on CUDA the cast rounds so)
        acc = tl.dot(p.to(DOT_DTYPE), k, acc)
        m_i = m_new

    if NUM_SPLITS == 1:
        _finish(acc, m_i, l_i, sink_ptr, heads, head_ok, cols, out_ptr + t64 * stride_ot, stride_oh,
                lse_ptr + t64 * num_heads)
    else:
        row = (t64 * num_heads + heads) * NUM_SPLITS + split  # [BH] partial row ids
        tl.store(part_acc + row[:, None] * D + cols[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml + row * 2, m_i, mask=head_ok)
        tl.store(part_ml + row * 2 + 1, l_i, mask=head_ok)


@triton.jit
def _finish(acc, m_i, l_i, sink_ptr, heads, head_ok, cols, out_row, stride_oh, lse_row):
    """SPEC §7: the sink joins the denominator, lse excludes it; empty set -> out 0, lse +inf."""
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf")) * 1.4426950408889634
    empty = l_i == 0.0
    m_safe = tl.where(empty, 0.0, m_i)
    top = tl.maximum(m_safe, sink)
    denominator = l_i * tl.exp2(m_safe - top) + tl.exp2(sink - top)
    factor = tl.where(empty, 0.0, tl.exp2(m_safe - top) / tl.where(empty, 1.0, denominator))  # no 0 / 0 lanes
    out = acc * factor[:, None]
    tl.store(out_row + heads[:, None] * stride_oh + cols[None, :], to_bf16(out), mask=head_ok[:, None])
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(lse_row + heads, lse, mask=head_ok)


@triton.jit
def _combine_kernel(part_acc, part_ml, sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, num_heads,
                    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    """Grid (T, H): merge NUM_SPLITS partials (max, sum, unnormalised out) of one (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    row = (t * num_heads + h) * NUM_SPLITS + splits
    m = tl.load(part_ml + row * 2, mask=split_ok, other=float("-inf"))
    ls = tl.load(part_ml + row * 2 + 1, mask=split_ok, other=0.0)
    live = ls > 0.0
    m_max = tl.max(tl.where(live, m, float("-inf")), 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(live, tl.exp2(tl.where(live, m, 0.0) - m_max), 0.0)
    l_i = tl.sum(ls * weight, 0)
    cols = tl.arange(0, D)
    acc = tl.load(part_acc + row[:, None] * D + cols[None, :], mask=split_ok[:, None] & live[:, None], other=0.0)
    acc = tl.sum(acc * weight[:, None], 0)
    # Reuse the single-split epilogue on a one-head block.
    one = tl.arange(0, 1) + h
    _finish(acc[None, :], tl.zeros([1], tl.float32) + m_max, tl.zeros([1], tl.float32) + l_i, sink_ptr,
            one, one < num_heads, cols, out_ptr + t * stride_ot, stride_oh, lse_ptr + t * num_heads)


def _record_geometry(swa: LatentLayout, ext: LatentLayout) -> tuple[int, int, int]:
    """(CHUNK, NOPE_CHUNKS, CHUNKS) of the kernel's ``[BN, CHUNKS, CHUNK]`` view of a record.

    Rows are cut into rope-dim-wide chunks: the last is the bf16 rope, each other one nope chunk
    with one UE8M0 scale (SPEC §9.1). Both caches must share the record layout (the kernel reads
    one), fp8 scale rows must be 8-aligned (one 8-byte word a row) and bf16 rows contiguous.
    """
    chunk = swa.rope_dim
    same = ("format_name", "token_stride", "nope_offset", "rope_offset", "scale_stride")
    if any(getattr(swa, name) != getattr(ext, name) for name in same):
        raise CacheLayoutError.of("extra_cache", f"the record layout of swa_cache ({swa.format_name})",
                                  ext.format_name)
    if swa.nope_dim % chunk or (swa.fp8_nope and swa.quant_block != chunk):
        raise CacheLayoutError.of("kv_format", f"nope dims a multiple of the rope dim {chunk} with one scale "
                                  f"per {chunk} (SPEC §9.1)", f"{swa.format_name}: nope {swa.nope_dim}, "
                                  f"quant block {swa.quant_block}")
    if swa.fp8_nope:
        offsets = (swa.page_stride, ext.page_stride, swa.scale_offset, ext.scale_offset, swa.scale_stride)
        if any(v % 8 for v in offsets):
            raise CacheLayoutError.of("kv_format", "8-aligned UE8M0 scale rows (SPEC §9.1)", swa.format_name)
    elif swa.rope_offset != swa.nope_offset + 2 * swa.nope_dim:
        raise CacheLayoutError.of("kv_format", "contiguous bf16 rows (SPEC §9.2)", swa.format_name)
    return chunk, swa.nope_dim // chunk, swa.row_dim // chunk


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_layout: LatentLayout,
                     swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                     extra_cache: torch.Tensor | None, extra_layout: LatentLayout | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, softmax_scale: float, probs_bf16: bool,
                     num_splits: int | None = None, block_heads: int | None = None,
                     block_keys: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, split_probs: bool | None = None,
                     isolate_scores: bool | None = None, prefetch: int | None = None,
                     hopper: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch. q [T,H,D] bf16 at any token and head strides (unit stride along the last dim; the kernels'
    token and head offsets are int64); indices [T,W] int32 global slots; lens [T] int32 (unit stride);
    sink [H] fp32.

    Returns (out [T,H,D] bf16 contiguous, lse [T,H] fp32). Inputs are assumed validated by the backend.
    The tuning keywords (``num_splits``, ``block_heads`` ...) override ``default_tuning``;
    ``split_probs`` forces (or disables) the hi/lo probability split of fp32-probability profiles,
    which is on by default wherever the dots take bf16 operands; ``isolate_scores`` and ``prefetch``
    select the kernel's ``ISOLATE_S`` / ``PREFETCH`` variants. ``hopper``: None (default) runs
    ``sparse_hopper`` where ``hopper_dispatch.hopper_unsupported`` allows it and no Triton-kernel tuning
    keyword is given, False never, True always (RuntimeError with the reason where it cannot).
    """
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # not empty_like: q's strides may be odd
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_heads == 0:  # nothing to compute (no program to launch)
        return out, lse
    triton_tuned = any(v is not None for v in (block_heads, block_keys, num_warps, num_stages, split_probs,
                                                isolate_scores, prefetch))  # before defaults fill them in
    has_extra = extra_cache is not None and extra_indices is not None
    swa_width = swa_indices.shape[1]
    ext_width = extra_indices.shape[1] if has_extra else 0
    facts = device_facts(q.device)
    num_sms, hardware_e4m3, rne_cvt = facts.num_sms, facts.hw_e4m3, facts.rne_cvt
    swa = swa_layout
    ext = extra_layout if has_extra else swa_layout
    chunk, nope_chunks, chunks = _record_geometry(swa, ext)
    use_hopper = False
    if hopper or (hopper is None and not triton_tuned):
        why = hopper_dispatch.hopper_unsupported(facts, swa, ext, dim, probs_bf16)
        if why is not None and hopper:
            raise RuntimeError(f"sparse_attention(hopper=True): {why}")
        use_hopper = why is None
    ext_cache = extra_cache if has_extra else swa_cache
    ext_idx = extra_indices if has_extra else swa_indices
    ext_lens = extra_lens if has_extra else swa_lens

    def partials(bh: int, keys: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(splits, part_acc, part_ml) for ``bh``-head blocks of ``keys``-key tiles."""
        head_blocks = host_cdiv(num_heads, bh)
        splits = num_splits or choose_num_splits(num_tokens, head_blocks,
                                                 host_cdiv(swa_width, keys) + host_cdiv(ext_width, keys), num_sms)
        if splits == 1:
            return 1, lse, lse  # unused placeholders
        return (splits, torch.empty((num_tokens * num_heads * splits, dim), dtype=torch.float32, device=q.device),
                torch.empty((num_tokens * num_heads * splits, 2), dtype=torch.float32, device=q.device))

    if use_hopper:  # the split count from the kernel that runs: the Hopper kernel's own tile shape
        splits, part_acc, part_ml = partials(hopper_dispatch.BLOCK_HEADS, hopper_dispatch.BLOCK_KEYS)
        hopper_dispatch.loader()[0].sparse_hopper(
            q, swa_cache, swa, swa_indices, swa_lens, ext_cache, ext, ext_idx, ext_lens, has_extra, sink, out,
            lse, part_acc, part_ml, scale_log2=softmax_scale * _LOG2E, num_splits=splits)
        _combine(part_acc, part_ml, sink, out, lse, num_tokens, num_heads, dim, splits)
        return out, lse
    tuning = default_tuning(num_tokens, num_heads, swa_width + ext_width, num_sms, swa_layout.fp8_nope)
    bh = block_heads or tuning.block_heads
    isolate = tuning.isolate_scores if isolate_scores is None else isolate_scores
    prefetch = tuning.prefetch if prefetch is None else int(prefetch)
    # fp32 probabilities on bf16 tensor cores: each key twice a tile (hi and lo parts, see the kernel).
    repeat = 2 if (not probs_bf16 and (not INTERPRET if split_probs is None else split_probs)) else 1
    warps = num_warps or (8 if bh >= 64 else 4)
    swa_u8, swa_bf16 = swa.byte_views(swa_cache)
    ext_u8, ext_bf16 = ext.byte_views(ext_cache)
    # int64 views for the 8-byte scale words (unused by bf16 rows, whose pages are 8-aligned too).
    swa_i64, ext_i64 = swa_u8.view(torch.int64), ext_u8.view(torch.int64)
    # Power-of-two pages (the usual case): the kernel takes log2 of the page size and shifts.
    pow2 = all(b & (b - 1) == 0 for b in (swa.block_size, ext.block_size))
    swa_args, ext_args = swa.kernel_args(), ext.kernel_args()
    if pow2:
        swa_args = (swa.block_size.bit_length() - 1, *swa_args[1:])
        ext_args = (ext.block_size.bit_length() - 1, *ext_args[1:])

    def launch(shape: tuple[int, int]) -> None:
        bn, stages = shape
        splits, part_acc, part_ml = partials(bh, bn // repeat)
        _sparse_attention_kernel[(num_tokens, host_cdiv(num_heads, bh), splits)](
            q, q.stride(0), q.stride(1),
            swa_u8, swa_bf16, swa_i64, swa_indices, swa_indices.stride(0), swa_lens, *swa_args,
            ext_u8, ext_bf16, ext_i64, ext_idx, ext_idx.stride(0), ext_lens, *ext_args,
            sink, out, out.stride(0), out.stride(1), lse, part_acc, part_ml,
            num_heads, swa_width, ext_width, softmax_scale * _LOG2E,
            HAS_EXTRA=has_extra, FP8=swa.fp8_nope, HW_FP8=swa.fp8_nope and hardware_e4m3,
            NOPE_CHUNKS=nope_chunks, CHUNKS=chunks, CHUNK=chunk,
            BH=bh, BN=bn, NUM_SPLITS=splits, DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16,
            PROBS_BF16=probs_bf16, REPEAT=repeat, POW2_BLOCKS=pow2, RNE_CVT=rne_cvt,
            ISOLATE_S=isolate, PREFETCH=prefetch, ROW_SELECT=not facts.hip,
            **({} if INTERPRET else {"num_warps": warps, "num_stages": stages}))
        _combine(part_acc, part_ml, sink, out, lse, num_tokens, num_heads, dim, splits)

    shape = (block_keys or tuning.block_keys, num_stages or tuning.num_stages)
    # a caller's block_keys / num_stages run as given; the defaults step down where the device is smaller
    fixed = INTERPRET or block_keys or num_stages
    _FITTING((q.device, bh, warps, swa.fp8_nope, hardware_e4m3, has_extra, probs_bf16, repeat, isolate, prefetch,
              pow2, chunks, facts.hip, shape), lambda: [shape] if fixed else [shape, *smaller_shapes(*shape)], launch)
    return out, lse


def _combine(part_acc: torch.Tensor, part_ml: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, num_tokens: int, num_heads: int, dim: int, splits: int) -> None:
    """Merge the split partials into ``out`` / ``lse`` (nothing to do for one split)."""
    if splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, sink, out, out.stride(0), out.stride(1), lse, num_heads,
            D=dim, NUM_SPLITS=splits, SPLITS_P2=next_pow2(splits))
