"""Inverse RoPE (+ optional FP8 activation simulation) in Triton, then the grouped output
projection as two torch matmuls (SPEC §3 steps 6-7, §8).

The GEMMs are plain bf16 ``torch.bmm`` / ``torch.matmul`` (cuBLAS / hipBLASLt / oneDNN); the
Triton kernel fuses the rotation, the bf16 round and, for the FP8 variant, the per-128 block
quantize-dequantize, in one pass over ``o``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import (
    ceil_log2_exponent,
    decode_e4m3,
    encode_e4m3,
    pow2_from_exponent,
    round_bf16,
    to_bf16,
)

__all__ = ["inverse_rope", "output_projection"]


@triton.jit
def _inverse_rope_kernel(o_ptr, stride_ot, stride_oh, positions, cos_sin, stride_cs, out_ptr,
                         D: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr, FP8_BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)  # a head-major o: h * stride_oh passes 2**31 at long T
    cols = tl.arange(0, D)
    base = o_ptr + t * stride_ot + h * stride_oh
    x = tl.load(base + cols).to(tl.float32)
    partner = tl.load(base + (cols ^ 1)).to(tl.float32)
    nope = D - ROPE
    in_rope = cols >= nope
    pair = tl.where(in_rope, (cols - nope) // 2, 0)
    cs_row = cos_sin + tl.load(positions + t) * stride_cs
    cos = tl.load(cs_row + pair, mask=in_rope, other=1.0)
    sin = -tl.load(cs_row + ROPE // 2 + pair, mask=in_rope, other=0.0)  # inverse: rotate by -angle
    odd = (cols & 1) == 1
    rotated = tl.where(odd, x * cos + partner * sin, x * cos - partner * sin)
    y = round_bf16(tl.where(in_rope, rotated, x))
    if FP8:
        # SPEC §8: blocks of 128, scale 2**ceil(log2(max(amax, 1e-10)/448)), e4m3 values.
        blocks = tl.reshape(y, (D // FP8_BLOCK, FP8_BLOCK))
        amax = tl.maximum(tl.max(tl.abs(blocks), 1), 1e-10)
        e = ceil_log2_exponent(tl.div_rn(amax, 448.0))
        scaled = tl.minimum(tl.maximum(blocks * pow2_from_exponent(-e)[:, None], -448.0), 448.0)
        y = tl.reshape(decode_e4m3(encode_e4m3(scaled)) * pow2_from_exponent(e)[:, None], (D,))
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * D + cols, to_bf16(y))


def inverse_rope(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *, rope_dim: int,
                 fp8_activations: bool, fp8_block: int) -> torch.Tensor:
    """o [T,H,512] bf16 at any token and head strides (unit stride along the last dim; offsets in int64)
    -> contiguous [T,H,512] bf16 with the rope dims rotated back at p."""
    num_tokens, heads, dim = o.shape
    out = torch.empty((num_tokens, heads, dim), dtype=torch.bfloat16, device=o.device)
    if num_tokens:
        _inverse_rope_kernel[(num_tokens, heads)](
            o, o.stride(0), o.stride(1), positions, cos_sin, cos_sin.stride(0), out,
            D=dim, ROPE=rope_dim, FP8=fp8_activations, FP8_BLOCK=fp8_block)
    return out


def output_projection(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, wo_a: torch.Tensor,
                      wo_b: torch.Tensor, *, fp8_activations: bool, rope_dim: int,
                      fp8_block: int) -> torch.Tensor:
    """o [T,H,512] bf16, wo_a [G*o_lora, (H/G)*512], wo_b [hidden, G*o_lora] -> [T, hidden] bf16."""
    num_tokens, heads, dim = o.shape
    group_width = wo_a.shape[1]
    groups = heads * dim // group_width
    o_lora = wo_a.shape[0] // groups
    rotated = inverse_rope(o, positions, cos_sin, rope_dim=rope_dim, fp8_activations=fp8_activations,
                           fp8_block=fp8_block)
    # z[:, g] = o[:, g] @ Wo_a[g]^T as one batched GEMM over groups, bf16 out (SPEC §3 step 7).
    z = torch.bmm(rotated.view(num_tokens, groups, group_width).transpose(0, 1),
                  wo_a.view(groups, o_lora, group_width).transpose(1, 2))  # [G, T, o_lora]
    z = z.transpose(0, 1).reshape(num_tokens, groups * o_lora)
    return torch.matmul(z, wo_b.t())
