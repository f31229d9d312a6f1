"""Fused q-norm + RoPE on q, and RoPE + quantize + SWA insert of kv (SPEC §3 steps 2-3, §4, §9).

Grid ``(T, head_blocks + 1)``: programs ``(t, b < head_blocks)`` normalise and rotate a block of
heads of token t; program ``(t, head_blocks)`` rotates kv[t] and writes it into the SWA cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import (
    INTERPRET,
    ceil_log2_exponent,
    encode_e4m3,
    next_pow2,
    round_bf16,
    to_bf16,
)
from dsv4.backends.triton.layout import LatentLayout

__all__ = ["qnorm_rope_insert", "write_latent_row"]


@triton.jit
def _rope_tail(x, partner, cos_sin_row, cols, NOPE: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """GPT-J RoPE on columns >= NOPE of rows ``x`` (SPEC §4); ``partner`` holds x[..., c ^ 1]."""
    in_rope = cols >= NOPE
    pair = tl.where(in_rope, (cols - NOPE) // 2, 0)
    cos = tl.load(cos_sin_row + pair, mask=in_rope, other=1.0)
    sin = tl.load(cos_sin_row + ROPE // 2 + pair, mask=in_rope, other=0.0)
    if INVERSE:
        sin = -sin
    odd = (cols & 1) == 1
    # even e' = e cos - o sin ; odd o' = o cos + e sin
    rotated = tl.where(odd, x * cos + partner * sin, x * cos - partner * sin)
    return tl.where(in_rope, rotated, x)


@triton.jit
def write_latent_row(u8_ptr, bf16_ptr, slot, row, cols,
                     block_size, page_stride, token_stride, nope_offset, rope_offset, scale_offset, scale_stride,
                     FP8: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, QBLOCK: tl.constexpr,
                     SCALE_ROW: tl.constexpr):
    """Write one 512-d row (fp32, bf16-exact values) at ``slot`` (SPEC §9.1 / §9.2). slot >= 0."""
    slot64 = slot.to(tl.int64)
    page = slot64 // block_size
    in_page = slot64 % block_size
    base = page * page_stride + in_page * token_stride
    is_nope = cols < NOPE
    if FP8:
        # SPEC §9.1: per 64-block amax = max(|x|, 1e-4), e = ceil(log2(amax/448)), byte e+127.
        blocks = tl.reshape(tl.abs(row), (D // QBLOCK, QBLOCK))
        amax = tl.maximum(tl.max(blocks, 1), 1e-4)
        exponent = ceil_log2_exponent(tl.div_rn(amax, 448.0))  # [D//QBLOCK]
        block_of_col = cols // QBLOCK
        exp_col = tl.sum(tl.where(block_of_col[:, None] == tl.arange(0, D // QBLOCK)[None, :],
                                  exponent[None, :], 0), 1)
        inv_scale = ((127 - exp_col) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
        scaled = tl.minimum(tl.maximum(row * inv_scale, -448.0), 448.0)
        tl.store(u8_ptr + base + nope_offset + cols, encode_e4m3(scaled), mask=is_nope)
        rope_cols = tl.where(is_nope, 0, cols - NOPE)
        tl.store(bf16_ptr + (base + rope_offset) // 2 + rope_cols, row.to(tl.bfloat16), mask=~is_nope)
        scale_idx = tl.arange(0, SCALE_ROW)
        scale_byte = tl.minimum(tl.maximum(exponent + 127, 0), 255)
        byte_of_idx = tl.sum(tl.where(scale_idx[:, None] == tl.arange(0, D // QBLOCK)[None, :],
                                      scale_byte[None, :], 0), 1)
        # Writers write 0 into the pad byte(s) after the NOPE // QBLOCK scales.
        byte_of_idx = tl.where(scale_idx < NOPE // QBLOCK, byte_of_idx, 0)
        tl.store(u8_ptr + page * page_stride + scale_offset + in_page * scale_stride + scale_idx,
                 byte_of_idx.to(tl.uint8))
    else:
        nope_cols = tl.where(is_nope, cols, 0)
        rope_cols = tl.where(is_nope, 0, cols - NOPE)
        tl.store(bf16_ptr + (base + nope_offset) // 2 + nope_cols, row.to(tl.bfloat16), mask=is_nope)
        tl.store(bf16_ptr + (base + rope_offset) // 2 + rope_cols, row.to(tl.bfloat16), mask=~is_nope)


@triton.jit
def _qnorm_rope_insert_kernel(
        q_ptr, stride_qt, stride_qh, kv_ptr, stride_kvt, positions, cos_sin, stride_cs,
        out_ptr, stride_ot, stride_oh, slot_mapping,
        u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset,
        scale_offset, scale_stride, num_heads, head_blocks, eps,
        FP8: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, QBLOCK: tl.constexpr,
        SCALE_ROW: tl.constexpr, BH: tl.constexpr, DEEPSEEK_QNORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, D)
    position = tl.load(positions + t)
    cs_row = cos_sin + position * stride_cs
    partner_cols = cols ^ 1
    if block < head_blocks:
        heads = block * BH + tl.arange(0, BH)
        ok = heads < num_heads
        heads64 = heads.to(tl.int64)  # a head-major q: head * stride_qh passes 2**31 at long T
        base = q_ptr + t * stride_qt + heads64[:, None] * stride_qh
        x = tl.load(base + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        partner = tl.load(base + partner_cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if DEEPSEEK_QNORM:
            # SPEC §6.6 deepseek: the official norm is bf16 tensor ops; each step rounds to bf16.
            mean_sq = round_bf16(tl.sum(round_bf16(x * x), 1) / D)
            inv = round_bf16(tl.div_rn(1.0, tl.sqrt_rn(round_bf16(mean_sq + eps))))
            normed = round_bf16(x * inv[:, None])
            partner_normed = round_bf16(partner * inv[:, None])
        else:
            inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 1) / D + eps))
            normed = round_bf16(x * inv[:, None])
            partner_normed = round_bf16(partner * inv[:, None])
        rotated = _rope_tail(normed, partner_normed, cs_row, cols[None, :], NOPE, ROPE, False)
        tl.store(out_ptr + t * stride_ot + heads64[:, None] * stride_oh + cols[None, :], to_bf16(rotated),
                 mask=ok[:, None])
    else:
        slot = tl.load(slot_mapping + t)
        if slot >= 0:  # SPEC §10: slot -1 skips the write
            kv = tl.load(kv_ptr + t * stride_kvt + cols).to(tl.float32)
            kv_partner = tl.load(kv_ptr + t * stride_kvt + partner_cols).to(tl.float32)
            row = round_bf16(_rope_tail(kv, kv_partner, cs_row, cols, NOPE, ROPE, False))
            write_latent_row(u8_ptr, bf16_ptr, slot, row, cols, block_size, page_stride, token_stride,
                             nope_offset, rope_offset, scale_offset, scale_stride, FP8, D, NOPE, QBLOCK,
                             SCALE_ROW)


def qnorm_rope_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      swa_cache: torch.Tensor, layout: LatentLayout, swa_slot_mapping: torch.Tensor,
                      *, eps: float, deepseek_qnorm: bool) -> torch.Tensor:
    """Launch. q [T,H,512] bf16 at any token and head strides (unit stride along the last dim; token and
    head offsets in int64), kv [T,512] bf16, positions [T] int64, cos_sin [P,64] fp32 (index tensors of
    unit stride).

    Returns q_out [T,H,512] bf16, contiguous; writes kv rows into ``swa_cache`` (layout ``layout``).
    """
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # not empty_like: q's strides may be odd
    if num_tokens == 0:
        return out
    bh = min(16 if INTERPRET else 8, next_pow2(num_heads))
    head_blocks = triton.cdiv(num_heads, bh)
    u8, bf16 = layout.byte_views(swa_cache)
    scale_row = next_pow2(max(layout.scale_row_bytes, 1)) if layout.fp8_nope else 1
    if layout.fp8_nope and scale_row != layout.scale_row_bytes:
        raise NotImplementedError(f"scale rows of {layout.scale_row_bytes} bytes")
    _qnorm_rope_insert_kernel[(num_tokens, head_blocks + 1)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), positions, cos_sin, cos_sin.stride(0),
        out, out.stride(0), out.stride(1), swa_slot_mapping,
        u8, bf16, *layout.kernel_args(), num_heads, head_blocks, eps,
        FP8=layout.fp8_nope, D=dim, NOPE=layout.nope_dim, ROPE=layout.rope_dim, QBLOCK=layout.quant_block,
        SCALE_ROW=scale_row, BH=bh, DEEPSEEK_QNORM=deepseek_qnorm)
    return out
