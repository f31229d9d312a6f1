"""Reference ``output_projection``: inverse RoPE, grouped ``wo_a``, ``wo_b`` (SPEC §3 steps 6-7, §8)."""
from __future__ import annotations

import torch
from dsv4.batch_invariant import grouped_linear, linear
from dsv4.reference._common import (
    OUTPUT_FP8_AMAX_FLOOR,
    OUTPUT_FP8_BLOCK,
    bf16_round,
    check_dim,
    check_float,
    check_positions,
    compute_dtype,
    is_ideal,
)
from dsv4.rope import apply_rope_to_tail
from dsv4.specs.errors import DSV4ValueError

__all__ = ["output_projection"]


def output_projection(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, wo_a: torch.Tensor,
                      wo_b: torch.Tensor, *, fp8_activations: bool) -> torch.Tensor:
    """Attention output to hidden size (SPEC §3 steps 6-7, §8).

    Args:
        o: ``[T, H, 512]`` bf16 (float64: the ideal), the sparse-attention output.
        positions: ``[T]`` int64; cos_sin: ``[P, 64]`` fp32.
        wo_a: ``[G*o_lora, (H/G)*512]``; group ``g`` (heads ``g*hpg .. g*hpg+hpg-1``) uses rows
            ``g*o_lora .. (g+1)*o_lora-1``. wo_b: ``[hidden, G*o_lora]``.
        fp8_activations: quantize-dequantize ``o`` per (token, group) block of 128 with scale
            ``2^ceil(log2(max(amax, 1e-10)/448))`` before ``wo_a`` (SPEC §8, vLLM's default).

    Returns:
        ``[T, hidden]`` o.dtype. Serving numerics: inverse RoPE in fp32 then bf16; each GEMM
        accumulates in fp32 and rounds its output to bf16 (``z`` and the result), as DeepSeek's
        bf16 einsum and Linear do. The ideal keeps float64 throughout (FP8 simulation included).
    """
    check_float("o", o)
    check_dim("o", o, 3, "[T, H, D]")
    num_tokens, heads, head_dim = o.shape
    check_positions(positions, num_tokens, cos_sin)
    check_float("wo_a", wo_a)
    check_dim("wo_a", wo_a, 2, "[G*o_lora, (H/G)*D]")
    check_float("wo_b", wo_b)
    check_dim("wo_b", wo_b, 2, "[hidden, G*o_lora]")
    group_width = wo_a.shape[1]
    if group_width == 0 or group_width % head_dim or heads % (group_width // head_dim):
        raise DSV4ValueError.of("wo_a", f"a second dim (H/G)*{head_dim} that divides H={heads} heads",
                                list(wo_a.shape))
    groups = heads * head_dim // group_width
    if wo_a.shape[0] % groups:
        raise DSV4ValueError.of("wo_a", f"a first dim G*o_lora divisible by G={groups}", list(wo_a.shape))
    o_lora = wo_a.shape[0] // groups
    if wo_b.shape[1] != groups * o_lora:
        raise DSV4ValueError.of("wo_b", f"second dim G*o_lora = {groups * o_lora}", list(wo_b.shape))
    if fp8_activations and group_width % OUTPUT_FP8_BLOCK:
        raise DSV4ValueError.of("wo_a", f"a group width divisible by {OUTPUT_FP8_BLOCK} for FP8 activations",
                                group_width)
    ideal = is_ideal(o.dtype)
    compute = compute_dtype(o.dtype)

    # SPEC §3 step 6: undo the rotation the values carry, at the query's own position.
    rotated = bf16_round(apply_rope_to_tail(o.to(compute), cos_sin[positions], inverse=True), ideal)
    grouped = rotated.reshape(num_tokens, groups, group_width)
    if fp8_activations:
        from dsv4.quant import simulate_fp8_blocks

        grouped = simulate_fp8_blocks(grouped, OUTPUT_FP8_BLOCK, amax_floor=OUTPUT_FP8_AMAX_FLOOR)
    wo_a_grouped = wo_a.to(compute).view(groups, o_lora, group_width)
    # the ideal's products are batch-invariant (dsv4.batch_invariant): same bits for any chunking
    z = bf16_round(grouped_linear(grouped, wo_a_grouped), ideal)
    out = bf16_round(linear(z.flatten(1), wo_b.to(compute)), ideal)
    return out.to(o.dtype)
