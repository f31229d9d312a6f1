"""Lightning Indexer (SPEC §6): query prep (RoPE, Hadamard, quantization, weights) and scoring.

``indexer_q``: one program per (token, block of heads). ``indexer_topk``: a Triton kernel writes
``logit[t, j] = sum_h w[t,h] relu(q[t,h] . k[j])`` for every request-local entry j (keys read in
place from the fp8 / mxfp4 pages through the block table, ``-inf`` past ``(p+1)//r``): one program
per (token, range of entries) holds q once and streams key tiles through the tensor cores. The
top-k then runs as ``torch.topk`` over those logits (see docs/triton.md). Rows whose visible count
is <= topk skip scoring (SPEC §6.3 short-context shortcut).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import (
    INTERPRET,
    ceil_log2_exponent,
    decode_e4m3,
    encode_e4m3,
    pow2_from_exponent,
    round_bf16,
    simulate_fp4,
    to_bf16,
)
from dsv4.backends.triton.layout import KeyLayout

__all__ = ["indexer_logits", "indexer_q", "indexer_topk"]

_QUANT_FP4, _QUANT_FP8 = 0, 1


@triton.jit
def _indexer_q_kernel(q_ptr, stride_qt, stride_qh, weights, stride_wt, positions, cos_sin, stride_cs,
                      hadamard, hadamard_scale, out_ptr, w_out, weight_scale, num_heads,
                      D: tl.constexpr, ROPE: tl.constexpr, BH: tl.constexpr, HADAMARD: tl.constexpr,
                      QUANT: tl.constexpr, FP4_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = heads < num_heads
    cols = tl.arange(0, D)
    base = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    x = tl.load(base + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    partner = tl.load(base + (cols ^ 1)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    nope = D - ROPE
    in_rope = cols >= nope
    pair = tl.where(in_rope, (cols - nope) // 2, 0)
    cs_row = cos_sin + tl.load(positions + t) * stride_cs
    cos = tl.load(cs_row + pair, mask=in_rope, other=1.0)
    sin = tl.load(cs_row + ROPE // 2 + pair, mask=in_rope, other=0.0)
    odd = (cols & 1) == 1
    rotated = tl.where(odd, x * cos[None, :] + partner * sin[None, :], x * cos[None, :] - partner * sin[None, :])
    q = round_bf16(tl.where(in_rope[None, :], rotated, x))  # SPEC §6.1: fp32 math, bf16 round
    if HADAMARD:
        # SPEC §6.5: +-1 matrix products are exact in bf16; fp32 accumulation; one bf16 round.
        h = tl.load(hadamard + cols[:, None] * D + cols[None, :]).to(DOT_DTYPE)
        q = round_bf16(tl.dot(q.to(DOT_DTYPE), h) * hadamard_scale)
    if QUANT == 0:
        # SPEC §6.6 deepseek: e2m1 per 32, scale 2**ceil(log2(max(amax, 6*2^-126)/6)).
        blocks = tl.reshape(q, (BH, D // FP4_BLOCK, FP4_BLOCK))
        amax = tl.maximum(tl.max(tl.abs(blocks), 2), 6.0 * 1.1754943508222875e-38)
        e = ceil_log2_exponent(tl.div_rn(amax, 6.0))
        scaled = blocks * pow2_from_exponent(-e)[:, :, None]
        q = tl.reshape(simulate_fp4(scaled) * pow2_from_exponent(e)[:, :, None], (BH, D))
    else:
        # SPEC §6.6 vllm: e4m3 with one pow2 scale per 128-vector.
        amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-4)
        e = ceil_log2_exponent(tl.div_rn(amax, 448.0))
        scaled = tl.minimum(tl.maximum(q * pow2_from_exponent(-e)[:, None], -448.0), 448.0)
        q = decode_e4m3(encode_e4m3(scaled)) * pow2_from_exponent(e)[:, None]
    tl.store(out_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :], to_bf16(q), mask=ok[:, None])
    w = tl.load(weights + t * stride_wt + heads, mask=ok, other=0.0).to(tl.float32)
    tl.store(w_out + t * num_heads + heads, w * weight_scale, mask=ok)


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
def _mxfp4_halves(u8_ptr, page, in_page, valid, page_stride, value_bytes, scale_offset, scale_bytes,
                  BN: tl.constexpr, D: tl.constexpr, QBLOCK: tl.constexpr):
    """(even, odd) elements [BN, D/2] fp32 (times 2**-14, see _key_tile) of mxfp4 keys: the low and
    high nibbles of each byte, no interleave (the caller dots them with q's even / odd columns)."""
    NB: tl.constexpr = D // QBLOCK
    HB: tl.constexpr = QBLOCK // 2
    page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride
    blk = tl.arange(0, NB)
    byte_idx = blk[None, :, None] * HB + tl.arange(0, HB)[None, None, :]
    raw = tl.load(u8_ptr + (page_base + in_page * value_bytes)[:, None, None] + byte_idx,
                  mask=valid[:, None, None], other=0)
    b = raw.to(tl.int32)
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    scale_byte = tl.load(u8_ptr + (page_base + scale_offset + in_page * scale_bytes)[:, None] + blk[None, :],
                         mask=valid[:, None], other=127)
    factor = (scale_byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None]
    return tl.reshape(lo * factor, (BN, D // 2)), tl.reshape(hi * factor, (BN, D // 2))


@triton.jit
def _indexer_logits_kernel(q_ptr, stride_qt, stride_qh, w_ptr, positions, token_request, block_table, stride_bt,
                           u8_ptr, f32_ptr, block_size, page_stride, value_bytes, scale_offset, scale_bytes,
                           logits, max_entries, chunk, ratio, topk, num_heads,
                           D: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, MXFP4: tl.constexpr,
                           QBLOCK: tl.constexpr, HW_E4M3: tl.constexpr, KEYS_AS_A: tl.constexpr,
                           SPLIT_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One program per (token, range of ``chunk`` entries): q loaded once, then a loop of BN-key
    tiles, each ``S^T = K q^T`` (KEYS_AS_A: the dequantized keys are the register operand) or
    ``S = q K^T`` on the tensor cores with relu and the weighted head sum fused; keys are read once
    from their pages (the bytes floor), logits written once."""
    t = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, max_entries)
    visible = ((tl.load(positions + t) + 1) // ratio).to(tl.int32)  # SPEC §6.3: entries j < (p+1)//r
    out_row = logits + t * max_entries
    offs = tl.arange(0, BN)
    if visible <= topk:
        # Short-context shortcut: every visible entry is selected, no scoring needed.
        for start in range(lo, hi, BN):
            j = start + offs
            tl.store(out_row + j, tl.where(j < visible, 0.0, float("-inf")), mask=j < hi)
    else:
        scored_end = tl.minimum(hi, visible)
        request = tl.load(token_request + t).to(tl.int64)
        heads = tl.arange(0, HP)
        head_ok = heads < num_heads
        cols = tl.arange(0, D)
        q_hd = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :], mask=head_ok[:, None],
                       other=0.0).to(tl.float32).to(DOT_DTYPE)  # [HP, D], loaded once per program
        if KEYS_AS_A:
            q_t = tl.trans(q_hd)
        if SPLIT_DOT:
            # mxfp4: q's even / odd columns [D/2, HP] against the low / high nibbles (no interleave).
            half = tl.arange(0, D // 2)
            q_base = q_ptr + t * stride_qt + heads[None, :] * stride_qh + 2 * half[:, None]
            q_even = tl.load(q_base, mask=head_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
            q_odd = tl.load(q_base + 1, mask=head_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
        w = tl.load(w_ptr + t * num_heads + heads, mask=head_ok, other=0.0)
        score_scale = 16384.0 if MXFP4 else 1.0  # undoes the 2**-14 of the fp16 nibble decode (exact)
        for start in range(lo, scored_end, BN):
            j = start + offs
            valid = j < scored_end
            page = tl.load(block_table + request * stride_bt + j // block_size, mask=valid, other=-1)
            valid = valid & (page >= 0)
            if SPLIT_DOT:
                even, odd = _mxfp4_halves(u8_ptr, page, j % block_size, valid, page_stride, value_bytes,
                                          scale_offset, scale_bytes, BN, D, QBLOCK)
                dots = tl.dot(even.to(DOT_DTYPE), q_even)
                dots = tl.dot(odd.to(DOT_DTYPE), q_odd, dots)  # [BN, HP], fp32 accumulation
                score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1) * score_scale
            elif KEYS_AS_A:
                keys = _key_tile(u8_ptr, f32_ptr, page, j % block_size, valid, page_stride, value_bytes,
                                 scale_offset, scale_bytes, BN, D, MXFP4, QBLOCK, HW_E4M3)
                dots = tl.dot(keys.to(DOT_DTYPE), q_t)  # [BN, HP], fp32 accumulation
                score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1) * score_scale
            else:
                keys = _key_tile(u8_ptr, f32_ptr, page, j % block_size, valid, page_stride, value_bytes,
                                 scale_offset, scale_bytes, BN, D, MXFP4, QBLOCK, HW_E4M3)
                dots_t = tl.dot(q_hd, tl.trans(keys.to(DOT_DTYPE)))  # [HP, BN]
                score = tl.sum(tl.maximum(dots_t, 0.0) * w[:, None], 0) * score_scale
            tl.store(out_row + j, tl.where(valid, score, float("-inf")), mask=j < hi)
        # Entries past the visible count (this range's tail): -inf.
        tail = tl.maximum(scored_end, lo)
        tail = lo + ((tail - lo) // BN) * BN  # tile-aligned; re-writes a partial tile's -inf, same values
        for start in range(tail, hi, BN):
            j = start + offs
            tl.store(out_row + j, tl.full([BN], float("-inf"), tl.float32), mask=(j < hi) & (j >= scored_end))


def indexer_q(index_q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              *, hadamard: torch.Tensor | None, quant: str, rope_dim: int,
              fp4_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch. index_q [T,heads,128] bf16, weights [T,heads] -> (q bf16 [T,heads,128], w fp32 [T,heads])."""
    num_tokens, heads, dim = index_q.shape
    index_q = index_q.contiguous()
    out = torch.empty_like(index_q)
    w = torch.empty((num_tokens, heads), dtype=torch.float32, device=index_q.device)
    if num_tokens == 0:
        return out, w
    bh = 16
    dot_dtype = tl.float32 if INTERPRET else tl.bfloat16
    _indexer_q_kernel[(num_tokens, triton.cdiv(heads, bh))](
        index_q, index_q.stride(0), index_q.stride(1), weights, weights.stride(0), positions, cos_sin,
        cos_sin.stride(0), hadamard if hadamard is not None else index_q, dim ** -0.5, out, w,
        dim ** -0.5 * heads ** -0.5, heads,
        D=dim, ROPE=rope_dim, BH=bh, HADAMARD=hadamard is not None,
        QUANT=_QUANT_FP4 if quant == "fp4" else _QUANT_FP8, FP4_BLOCK=fp4_block, DOT_DTYPE=dot_dtype)
    return out, w


@functools.cache
def _device_facts(device_type: str, index: int | None) -> tuple[int, bool]:
    """(multiprocessors, hardware e4m3 cvt) of a device, looked up once (host overhead per call)."""
    if device_type != "cuda" or INTERPRET:
        return 4, False
    props = torch.cuda.get_device_properties(index)
    # cvt e4m3x2 exists on sm_89+ CUDA; ROCm (FNUZ e4m3 on gfx942) uses the exact integer decode.
    return props.multi_processor_count, torch.version.hip is None and (props.major, props.minor) >= (8, 9)


def indexer_logits(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                   key_cache: torch.Tensor, layout: KeyLayout, key_block_table: torch.Tensor, *,
                   topk: int, ratio: int, block_entries: int | None = None, num_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   keys_as_a: bool = True, split_dot: bool = False) -> torch.Tensor:
    """logits [T, mb*B] fp32: scores of visible entries, -inf elsewhere (0 on short-context rows).

    q [T, heads, 128] bf16, w [T, heads] fp32; keys read in place from ``key_cache`` (uint8 pages).
    ``block_entries`` (key tile), ``num_splits`` (entry ranges per token), ``num_warps`` and
    ``num_stages``, ``keys_as_a`` (dot orientation), ``split_dot`` (mxfp4: even/odd dots instead of
    an interleaved key tile) are tuning knobs for benchmarks; the default
    grid fills the device's multiprocessors.
    """
    num_tokens, heads, dim = q.shape
    max_entries = key_block_table.shape[1] * layout.block_size
    logits = torch.empty((num_tokens, max_entries), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_entries == 0:
        return logits
    sms, hw_e4m3 = _device_facts(q.device.type, q.device.index)
    bn = block_entries or (32 if INTERPRET else 64)
    tiles = -(-max_entries // bn)
    # ~16 programs per multiprocessor (H200 sweep: 4 -> 0.44 ms, 16 -> 0.38 ms at b=128, 128K), but at
    # least 4 tiles each (q is loaded once per program).
    splits = num_splits or max(1, min(-(-16 * sms // num_tokens), tiles // 4))
    chunk = -(-tiles // splits) * bn
    splits = -(-max_entries // chunk)
    q = q.contiguous()
    w = w.contiguous()
    f32 = key_cache.view(torch.float32) if key_cache.shape[1] % 4 == 0 else key_cache
    extra = {} if INTERPRET else {"num_warps": num_warps or 4, "num_stages": num_stages or 3}
    _indexer_logits_kernel[(num_tokens, splits)](
        q, q.stride(0), q.stride(1), w, positions, token_request, key_block_table, key_block_table.stride(0),
        key_cache, f32, *layout.kernel_args(), logits, max_entries, chunk, ratio, topk, heads,
        D=dim, HP=max(16, triton.next_power_of_2(heads)), BN=bn, MXFP4=layout.format_name == "indexer_mxfp4",
        QBLOCK=layout.quant_block, HW_E4M3=hw_e4m3, KEYS_AS_A=keys_as_a,
        SPLIT_DOT=split_dot and layout.format_name == "indexer_mxfp4", DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16, **extra)
    return logits


def indexer_topk(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                 key_cache: torch.Tensor, layout: KeyLayout, key_block_table: torch.Tensor, *,
                 topk: int, ratio: int) -> torch.Tensor:
    """[T, topk] int32 request-local indices, valid first, -1 padded (SPEC §6.3)."""
    num_tokens = q.shape[0]
    logits = indexer_logits(q, w, positions, token_request, key_cache, layout, key_block_table,
                            topk=topk, ratio=ratio)
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    k = min(topk, logits.shape[1])
    if num_tokens == 0 or k == 0:
        return out
    values, index = torch.topk(logits, k, dim=1, sorted=True)  # descending: -inf (invalid) last
    out[:, :k] = torch.where(values == float("-inf"), -1, index).to(torch.int32)
    return out
