"""Sparse MQA over paged latent caches (SPEC §7): split over keys, then a combine step.

One kernel serves decode and prefill. A program owns one token, a block of heads and one split of
that token's key list; the list is the SWA indices followed by the extra (compressed) indices, read
in place from the caches (fp8_ds_mla pages dequantized in registers, bf16 rows as they are). With
one split the program finishes the softmax itself (sink, lse); with several, each writes a partial
(max, sum, unnormalised output) and ``_combine_kernel`` merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import INTERPRET, decode_e4m3, next_pow2, round_bf16, to_bf16
from dsv4.backends.triton.layout import LatentLayout

__all__ = ["choose_num_splits", "sparse_attention"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _load_latent_rows(u8_ptr, bf16_ptr, slots, valid, cols,
                      block_size, page_stride, token_stride, nope_offset, rope_offset,
                      scale_offset, scale_stride,
                      FP8: tl.constexpr, NOPE: tl.constexpr, QBLOCK: tl.constexpr, NUM_SCALES: tl.constexpr):
    """Dequantized rows [BN, D] fp32 (exact bf16 values) of the latent cache at ``slots`` [BN].

    Offsets are bytes (SPEC §9.1 / §9.2, from ``layout.LatentLayout``); invalid rows read as 0.
    """
    safe = tl.where(valid, slots, 0).to(tl.int64)
    page = safe // block_size
    in_page = safe % block_size
    token_base = page * page_stride + in_page * token_stride  # byte offset of the token record
    rows = token_base[:, None]
    is_nope = cols[None, :] < NOPE
    if FP8:
        # SPEC §9.1: e4m3 nope bytes times 2**(ue8m0 - 127) per 64-block; rope dims bf16.
        codes = tl.load(u8_ptr + rows + nope_offset + cols[None, :], mask=valid[:, None] & is_nope, other=0)
        scale_index = tl.minimum(cols // QBLOCK, NUM_SCALES - 1)
        scale_base = page * page_stride + scale_offset + in_page * scale_stride
        scale_byte = tl.load(u8_ptr + scale_base[:, None] + scale_index[None, :],
                             mask=valid[:, None] & is_nope, other=127).to(tl.int32)
        scale = ((scale_byte << 23).to(tl.float32, bitcast=True))  # 2**(byte-127), byte >= 1
        nope = decode_e4m3(codes) * scale
        rope = tl.load(bf16_ptr + (rows + rope_offset) // 2 + (cols[None, :] - NOPE),
                       mask=valid[:, None] & (cols[None, :] >= NOPE), other=0.0).to(tl.float32)
        return tl.where(is_nope, nope, rope)
    else:
        # bf16 rows: nope and rope both bf16 (rope_offset == nope_offset + 2 * NOPE for plain rows).
        nope = tl.load(bf16_ptr + (rows + nope_offset) // 2 + cols[None, :],
                       mask=valid[:, None] & is_nope, other=0.0).to(tl.float32)
        rope = tl.load(bf16_ptr + (rows + rope_offset) // 2 + (cols[None, :] - NOPE),
                       mask=valid[:, None] & (cols[None, :] >= NOPE), other=0.0).to(tl.float32)
        return tl.where(is_nope, nope, rope)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, u8_ptr, bf16_ptr, idx_ptr, length, width, tile, cols,
                 block_size, page_stride, token_stride, nope_offset, rope_offset, scale_offset, scale_stride,
                 scale_log2,
                 FP8: tl.constexpr, NOPE: tl.constexpr, QBLOCK: tl.constexpr, NUM_SCALES: tl.constexpr,
                 BN: tl.constexpr, DOT_DTYPE: tl.constexpr, PROBS_BF16: tl.constexpr):
    """One online-softmax step over keys ``tile*BN ..`` of one index list (log2 domain)."""
    j = tile * BN + tl.arange(0, BN)
    in_list = (j < length) & (j < width)
    slots = tl.load(idx_ptr + j, mask=in_list, other=-1)
    valid = in_list & (slots >= 0)  # SPEC §10: -1 entries are skipped
    k = _load_latent_rows(u8_ptr, bf16_ptr, slots, valid, cols, block_size, page_stride, token_stride,
                          nope_offset, rope_offset, scale_offset, scale_stride,
                          FP8, NOPE, QBLOCK, NUM_SCALES).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BH, BN], fp32 accumulation
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if PROBS_BF16:
        p = round_bf16(p)  # SPEC §6.6 deepseek: probabilities cast to bf16 before P@V
        acc += tl.dot(p.to(DOT_DTYPE), k)
    elif DOT_DTYPE == tl.bfloat16:
        # fp32 probabilities (vllm profile) through bf16 tensor cores: p = hi + lo, two exact-operand
        # dots, relative error ~2**-16 instead of bf16's 2**-8.
        p_hi = round_bf16(p)
        acc += tl.dot(p_hi.to(tl.bfloat16), k) + tl.dot((p - p_hi).to(tl.bfloat16), k)
    else:
        acc += tl.dot(p, k)
    return acc, m_new, l_i


@triton.jit
def _sparse_attention_kernel(
        q_ptr, stride_qt, stride_qh,
        swa_u8, swa_bf16, swa_idx, swa_idx_stride, swa_lens,
        swa_block, swa_page_stride, swa_token_stride, swa_nope_off, swa_rope_off, swa_scale_off, swa_scale_stride,
        ext_u8, ext_bf16, ext_idx, ext_idx_stride, ext_lens,
        ext_block, ext_page_stride, ext_token_stride, ext_nope_off, ext_rope_off, ext_scale_off, ext_scale_stride,
        sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, part_acc, part_ml,
        num_heads, swa_width, ext_width, scale_log2,
        HAS_EXTRA: tl.constexpr, FP8: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
        QBLOCK: tl.constexpr, NUM_SCALES: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, PROBS_BF16: tl.constexpr):
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BH + tl.arange(0, BH)
    head_ok = heads < num_heads
    cols = tl.arange(0, D)
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)

    swa_len = tl.load(swa_lens + t)
    n_swa = tl.cdiv(tl.minimum(swa_len, swa_width), BN)
    if HAS_EXTRA:
        ext_len = tl.load(ext_lens + t)
        n_ext = tl.cdiv(tl.minimum(ext_len, ext_width), BN)
    else:
        ext_len = 0
        n_ext = 0
    total = n_swa + n_ext
    per_split = tl.cdiv(total, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)

    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for tile in range(lo, tl.minimum(hi, n_swa)):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, swa_u8, swa_bf16, swa_idx + t64 * swa_idx_stride,
                                     swa_len, swa_width, tile, cols, swa_block, swa_page_stride,
                                     swa_token_stride, swa_nope_off, swa_rope_off, swa_scale_off,
                                     swa_scale_stride, scale_log2, FP8, NOPE, QBLOCK, NUM_SCALES,
                                     BN, DOT_DTYPE, PROBS_BF16)
    if HAS_EXTRA:
        for tile in range(tl.maximum(lo, n_swa), hi):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, ext_u8, ext_bf16, ext_idx + t64 * ext_idx_stride,
                                         ext_len, ext_width, tile - n_swa, cols, ext_block, ext_page_stride,
                                         ext_token_stride, ext_nope_off, ext_rope_off, ext_scale_off,
                                         ext_scale_stride, scale_log2, FP8, NOPE, QBLOCK, NUM_SCALES,
                                         BN, DOT_DTYPE, PROBS_BF16)

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
    factor = tl.where(empty, 0.0, tl.exp2(m_safe - top) / denominator)
    out = acc * factor[:, None]
    tl.store(out_row + heads[:, None] * stride_oh + cols[None, :], to_bf16(out), mask=head_ok[:, None])
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(lse_row + heads, lse, mask=head_ok)


@triton.jit
def _combine_kernel(part_acc, part_ml, sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, num_heads,
                    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
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


def choose_num_splits(num_tokens: int, head_blocks: int, max_tiles: int, num_sms: int) -> int:
    """Splits over keys so that a decode batch fills about two waves of the device; 1 for prefill."""
    programs = num_tokens * head_blocks
    if programs >= num_sms or max_tiles <= 1:
        return 1
    return max(1, min(max_tiles, (2 * num_sms + programs - 1) // programs, 32))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_layout: LatentLayout,
                     swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                     extra_cache: torch.Tensor | None, extra_layout: LatentLayout | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, softmax_scale: float, probs_bf16: bool,
                     num_splits: int | None = None, block_heads: int | None = None,
                     block_keys: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch. q [T,H,D] bf16; indices int32 global slots; lens [T] int32; sink [H] fp32.

    Returns (out [T,H,D] bf16, lse [T,H] fp32). Inputs are assumed validated by the backend.
    The tuning keywords (``num_splits``, ``block_heads`` ...) default to the heuristics here.
    """
    num_tokens, num_heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    bh = block_heads or max(16, min(64, next_pow2(num_heads)))
    bn = block_keys or (16 if INTERPRET else 32)
    head_blocks = triton.cdiv(num_heads, bh)
    has_extra = extra_cache is not None and extra_indices is not None
    swa_width = swa_indices.shape[1]
    ext_width = extra_indices.shape[1] if has_extra else 0
    max_tiles = triton.cdiv(swa_width, bn) + triton.cdiv(ext_width, bn)
    splits = num_splits or choose_num_splits(num_tokens, head_blocks, max_tiles, _num_sms(q.device))
    dot_dtype = tl.float32 if INTERPRET else tl.bfloat16
    if splits > 1:
        part_acc = torch.empty((num_tokens * num_heads * splits, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_tokens * num_heads * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = lse  # unused placeholders
    swa = swa_layout
    ext = extra_layout if has_extra else swa_layout
    ext_cache = extra_cache if has_extra else swa_cache
    ext_idx = extra_indices if has_extra else swa_indices
    ext_lens = extra_lens if has_extra else swa_lens
    swa_u8, swa_bf16 = swa.byte_views(swa_cache)
    ext_u8, ext_bf16 = ext.byte_views(ext_cache)
    kwargs = {}
    if num_warps is not None:
        kwargs["num_warps"] = num_warps
    elif not INTERPRET:
        kwargs["num_warps"] = 8 if bh >= 64 else 4
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    elif not INTERPRET:
        # H200 sweep (docs/triton.md): 3 stages best for split decode, 2 for prefill.
        kwargs["num_stages"] = 3 if splits > 1 else 2
    _sparse_attention_kernel[(num_tokens, head_blocks, splits)](
        q, q.stride(0), q.stride(1),
        swa_u8, swa_bf16, swa_indices, swa_indices.stride(0), swa_lens, *swa.kernel_args(),
        ext_u8, ext_bf16, ext_idx, ext_idx.stride(0), ext_lens, *ext.kernel_args(),
        sink, out, out.stride(0), out.stride(1), lse, part_acc, part_ml,
        num_heads, swa_width, ext_width, softmax_scale * _LOG2E,
        HAS_EXTRA=has_extra, FP8=swa.fp8_nope, D=dim, NOPE=swa.nope_dim, QBLOCK=swa.quant_block,
        NUM_SCALES=max(1, swa.num_scales), BH=bh, BN=bn, NUM_SPLITS=splits, DOT_DTYPE=dot_dtype,
        PROBS_BF16=probs_bf16, **kwargs)
    if splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, sink, out, out.stride(0), out.stride(1), lse, num_heads,
            D=dim, NUM_SPLITS=splits, SPLITS_P2=next_pow2(splits))
    return out, lse


