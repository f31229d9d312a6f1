"""The end of a compressor block (SPEC §5.2, §6.4-6.5, §9.3): weighted RMSNorm, RoPE, (indexer keys)
Hadamard, quantization and the cache insert of one pooled row [D] fp32; used by both launches of
``compressor``."""
from __future__ import annotations

import triton
import triton.language as tl
from dsv4.backends.triton._common import ceil_log2_exponent, encode_e4m3, pow2_from_exponent, round_bf16
from dsv4.backends.triton.qnorm_rope_insert import write_latent_row

__all__ = ["OUT_KEY_FP8", "OUT_KEY_MXFP4", "OUT_LATENT", "_e2m1_code", "_finish", "_sylvester"]

# Output kinds of _finish.
OUT_LATENT, OUT_KEY_FP8, OUT_KEY_MXFP4 = 0, 1, 2


@triton.jit
def _sylvester(N: tl.constexpr):
    """[N, N] fp32 Sylvester Hadamard matrix of +-1 (N <= 256): (-1)^popcount(i & j)."""
    i = tl.arange(0, N)
    x = i[:, None] & i[None, :]
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1.0 - 2.0 * (x & 1).to(tl.float32)


@triton.jit
def _finish(c, p, out_slot, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
            u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset, scale_offset,
            scale_stride, RATIO: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
            QBLOCK: tl.constexpr, SCALE_ROW: tl.constexpr, FP8: tl.constexpr, OUT_KIND: tl.constexpr,
            DEEPSEEK_ROUNDING: tl.constexpr, HADAMARD: tl.constexpr, HAD_A: tl.constexpr):
    """Pooled row ``c`` [D] fp32 of the block closing at position ``p`` -> cache row at ``out_slot``."""
    cols = tl.arange(0, D)
    w = tl.load(norm_weight + cols)
    if DEEPSEEK_ROUNDING:
        c = round_bf16(c)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(c * c, 0) / D + eps))
    n = c * inv * w
    if DEEPSEEK_ROUNDING:
        n = round_bf16(n)
    # SPEC §4: GPT-J pairs (2i, 2i+1) of the last ROPE dims, rotated at the block's first position.
    even, odd = tl.split(tl.reshape(n, (D // 2, 2)))
    pair = tl.arange(0, D // 2)
    in_rope = pair >= NOPE // 2
    k = tl.where(in_rope, pair - NOPE // 2, 0)
    cs_row = cos_sin + ((p // RATIO) * RATIO) * stride_cs
    cos = tl.load(cs_row + k, mask=in_rope, other=1.0)
    sin = tl.load(cs_row + ROPE // 2 + k, mask=in_rope, other=0.0)
    even_rot = tl.where(in_rope, even * cos - odd * sin, even)
    odd_rot = tl.where(in_rope, odd * cos + even * sin, odd)
    row = round_bf16(tl.reshape(tl.join(even_rot, odd_rot), (D,)))
    if HADAMARD:
        # SPEC §6.5: Sylvester Walsh-Hadamard, fp32 math, one bf16 round. Sylvester H_D = H_A (x) H_B
        # (D = A*B, index a*B + b), so H x = vec(H_A X H_B) with X = x as [A, B]: A*B*(A+B) products
        # instead of D*D. Both factors are Sylvester matrices, H[i, j] = (-1)^popcount(i & j): built from
        # bits in registers (no loads, no layout conversions of loaded tiles); ``hadamard`` is not read.
        HB: tl.constexpr = D // HAD_A
        x = tl.reshape(row, (HAD_A, HB))
        h_b = _sylvester(HB)
        h_a = _sylvester(HAD_A)
        y = tl.sum(x[:, :, None] * h_b[None, :, :], 1)  # [A, B] = X @ H_B
        z = tl.sum(h_a[:, :, None] * y[None, :, :], 1)  # [A, B] = H_A @ (X @ H_B)
        row = round_bf16(tl.reshape(z, (D,)) * hadamard_scale)
    if OUT_KIND == 0:
        write_latent_row(u8_ptr, bf16_ptr, out_slot, row, cols, block_size, page_stride, token_stride,
                         nope_offset, rope_offset, scale_offset, scale_stride, FP8, D, NOPE, QBLOCK, SCALE_ROW)
    else:
        slot = out_slot.to(tl.int64)
        page_base = (slot // block_size) * page_stride
        in_page = slot % block_size
        if OUT_KIND == 1:
            # SPEC §9.3 fp8 keys: one pow2 scale per vector, 2**ceil(log2(max(amax,1e-4)/448)).
            amax = tl.maximum(tl.max(tl.abs(row), 0), 1e-4)
            e = ceil_log2_exponent(tl.div_rn(amax, 448.0))
            scaled = tl.minimum(tl.maximum(row * pow2_from_exponent(-e), -448.0), 448.0)
            tl.store(u8_ptr + page_base + in_page * token_stride + cols, encode_e4m3(scaled))
            scale_ptr = (u8_ptr + page_base + scale_offset + in_page * scale_stride).to(tl.pointer_type(tl.float32))
            tl.store(scale_ptr, pow2_from_exponent(e))
        else:
            # SPEC §9.3 mxfp4 keys: e2m1 per QBLOCK with UE8M0 scales, nibbles packed low-first.
            blocks = tl.reshape(row, (D // QBLOCK, QBLOCK))
            amax = tl.maximum(tl.max(tl.abs(blocks), 1), 6.0 * 1.1754943508222875e-38)
            e = ceil_log2_exponent(tl.div_rn(amax, 6.0))
            scaled = blocks * pow2_from_exponent(-e)[:, None]
            code = _e2m1_code(scaled)
            low, high = tl.split(tl.reshape(code, (D // 2, 2)))
            tl.store(u8_ptr + page_base + in_page * token_stride + tl.arange(0, D // 2),
                     (low | (high << 4)).to(tl.uint8))
            tl.store(u8_ptr + page_base + scale_offset + in_page * scale_stride + tl.arange(0, D // QBLOCK),
                     (e + 127).to(tl.uint8))


@triton.jit
def _e2m1_code(x):
    """Scaled fp32 x -> 4-bit e2m1 code (sign << 3 | index in {0,.5,1,1.5,2,3,4,6}), round to nearest
    even, saturating at 6: the code of ``simulate_fp4`` (SPEC §6.6), from bits. |x| >= 1: round the
    mantissa to one bit (RNE on the bits), code = 2 * (exponent + 1) + bit; |x| < 1: code = rne(2|x|)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    high = tl.minimum(((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252, 7)
    low = ((a * 2.0 + 8388608.0) - 8388608.0).to(tl.int32)  # 2|x| < 2: adding 2**23 rounds to even
    return tl.where(a < 1.0, low, high) | (x < 0).to(tl.int32) * 8
