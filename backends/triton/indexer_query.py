"""Lightning Indexer query prep (SPEC §6.1, §6.5, §6.6): RoPE, Hadamard, quantization and weights of the
index queries, one program per (token, block of heads). ``indexer.py`` scores the keys with them."""
from __future__ import annotations

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

__all__ = ["indexer_q"]

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
